"""Typed structured configs (the schema every composed config is checked against) and the
semantic checks Hydra's types cannot express.

Each option of a config group has its own dataclass, stored in Hydra's ConfigStore under
`schema/<group>/<option>`; the YAML files in `conf/<group>/` extend their schema through their
defaults list, so a wrong type or an unknown key fails at composition, before any process starts.
Only this module and `train.py` import Hydra or OmegaConf.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field, fields
from typing import Any

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING, DictConfig, OmegaConf

from gradsync.normalize import CHOICES as NORMALIZE_CHOICES
from gradsync.precision import DTYPES, autocast_runs


class ConfigError(ValueError):
    """Bad configuration: reported as one line naming the key and what is allowed."""


# --- model -----------------------------------------------------------------------------------
@dataclass
class MLPConfig:
    name: str = "mlp"
    hidden_sizes: list[int] = field(default_factory=lambda: [128, 128])
    activation: str = "relu"  # relu | gelu | tanh
    dropout: float = 0.0  # after each hidden activation


@dataclass
class TransformerConfig:
    """Decoder-only causal transformer for token data; its vocabulary and position table come
    from the data."""

    name: str = "transformer"
    d_model: int = 32
    n_layers: int = 2
    n_heads: int = 2
    mlp_ratio: int = 4


# --- optimizer (instantiated with _partial_: the worker passes the parameters) ----------------
@dataclass
class SGDConfig:
    _target_: str = "torch.optim.SGD"
    _partial_: bool = True
    lr: float = 0.1
    momentum: float = 0.9
    weight_decay: float = 0.0
    nesterov: bool = False
    fused: bool | None = None  # torch's fused kernel (CPU, CUDA); null: torch's own default


@dataclass
class AdamWConfig:
    _target_: str = "torch.optim.AdamW"
    _partial_: bool = True
    lr: float = 1e-3
    betas: list[float] = field(default_factory=lambda: [0.9, 0.999])
    eps: float = 1e-8
    weight_decay: float = 0.01
    fused: bool | None = None  # torch's fused kernel (CPU, CUDA); null: torch's own default


# --- accumulation schedule ----------------------------------------------------------------------
@dataclass
class ConstantScheduleConfig:
    name: str = "constant"
    accum_steps: int = 1


@dataclass
class EpochwiseScheduleConfig:
    """Like Lightning's GradientAccumulationScheduler: {first_epoch: accum_steps}."""

    name: str = "epochwise"
    accum_steps_by_epoch: dict[int, int] = field(default_factory=lambda: {0: 1})


@dataclass
class GlobalBatchScheduleConfig:
    """N = global_batch_size / (world_size * micro_batch_size); must divide exactly."""

    name: str = "global_batch"
    global_batch_size: int = 256


# --- sync policy ------------------------------------------------------------------------------
@dataclass
class SyncConfig:
    name: str = "always"


@dataclass
class AccumulateSyncConfig:
    name: str = "accumulate"
    compression: str = "none"  # none | powersgd: all-reduce rank-r factors (approximate)
    powersgd_rank: int = 4
    powersgd_start_step: int = 10  # synchronising backwards all-reduced exactly first (>= 2)


@dataclass
class AmpAwareSyncConfig(AccumulateSyncConfig):
    name: str = "amp_aware"
    comm_dtype: str = "bf16"  # bf16 | fp16 (needs precision=fp16) | fp32: the all-reduce's dtype
    overflow_consensus: bool = True  # fp16 only: abort a window as soon as any rank overflows


@dataclass
class LocalSGDSyncConfig:
    """Each rank steps on its own gradients; the models are averaged every `every` windows."""

    name: str = "local_sgd"
    every: int = 8  # windows between averagings (H)
    warmup_steps: int = 0  # the first K windows run as exact accumulate (post-local SGD)
    comm_dtype: str = "fp32"  # fp32 | bf16: the averaging all-reduce's dtype


@dataclass
class DiLoCoSyncConfig:
    """The configured optimizer is the inner one; every `every` windows an outer SGD steps the
    global weights on the mean pseudo-gradient (global - local)."""

    name: str = "diloco"
    every: int = 32
    warmup_steps: int = 0
    comm_dtype: str = "fp32"  # fp32 | bf16: the pseudo-gradient all-reduce's dtype
    outer_lr: float = 0.7
    outer_momentum: float = 0.9
    outer_nesterov: bool = True


# --- precision --------------------------------------------------------------------------------
@dataclass
class PrecisionConfig:
    name: str = "fp32"  # fp32 | bf16 | fp16
    # the GradScaler's settings (fp16 only)
    init_scale: float = 65536.0
    growth_interval: int = 2000
    growth_factor: float = 2.0
    backoff_factor: float = 0.5


# --- data -------------------------------------------------------------------------------------
@dataclass
class SyntheticDataConfig:
    """Deterministic teacher-student regression made from the run's seed."""

    name: str = "synthetic"
    micro_batch_size: int = 32
    num_samples: int = 2048
    eval_samples: int = 512
    in_dim: int = 32
    out_dim: int = 8
    noise: float = 0.05


@dataclass
class DigitsDataConfig:
    """scikit-learn's bundled 8x8 handwritten digits (no download), fixed held-out split."""

    name: str = "digits"
    micro_batch_size: int = 16
    test_fraction: float = 0.2
    split_seed: int = 0


@dataclass
class SyntheticLMDataConfig:
    """Deterministic variable-length token sequences made from the run's seed."""

    name: str = "synthetic_lm"
    micro_batch_size: int = 8
    num_samples: int = 2048  # training sequences
    eval_samples: int = 256
    vocab_size: int = 32
    min_len: int = 4  # tokens per sequence, drawn uniformly in [min_len, max_len]
    max_len: int = 64
    max_stride: int = 4
    noise: float = 0.05


# --- loss -------------------------------------------------------------------------------------
@dataclass
class LossConfig:
    normalize: str = "auto"  # auto (tokens on token data, else samples) | tokens | samples
    #                          | micro_batch_mean (the 2024 accumulation bug, to measure it)


# --- trainer ----------------------------------------------------------------------------------
@dataclass
class TrainerConfig:
    devices: int = 2
    max_steps: int = -1  # optimizer steps; -1: no limit (max_epochs decides)
    max_epochs: int = 30
    log_every: int = 10  # optimizer steps between TensorBoard/console logs
    eval_every: int = 0  # optimizer steps between evaluations; 0: only at the end
    backend: str = "auto"  # auto | gloo | nccl
    threads_per_worker: int = 0  # 0: cpu_count // devices
    progress_bar: bool = True
    clip_grad_norm: float = 0.0  # 0: no clipping
    gradient_as_bucket_view: bool = True
    bucket_cap_mb: float = 25.0
    allreduce: str = "auto"  # auto | shared_memory | process_group: how CPU ranks all-reduce
    timeout_s: int = 300  # process-group timeout
    deterministic: bool | None = None  # torch deterministic algorithms; null: on for CPU
    checkpoint_every: int = 100  # optimizer steps; 0: only at the end (and when stopped)
    keep_checkpoints: int = 3  # the newest K step checkpoints stay
    num_workers: int = 0  # DataLoader worker processes per rank
    fail_at_step: int = -1  # test aid: the last rank raises after this optimizer step


# --- LR scheduler -----------------------------------------------------------------------------
@dataclass
class NoLRSchedulerConfig:
    name: str = "none"


@dataclass
class CosineLRSchedulerConfig:
    name: str = "cosine"
    warmup_steps: int = 0
    min_lr_ratio: float = 0.0


# --- top level --------------------------------------------------------------------------------
@dataclass
class Config:
    model: Any = MISSING
    optimizer: Any = MISSING
    schedule: Any = MISSING
    sync: Any = MISSING
    precision: Any = MISSING
    data: Any = MISSING
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    lr_scheduler: Any = MISSING
    loss: LossConfig = field(default_factory=LossConfig)
    seed: int = 0
    resume: str = "none"  # none | auto | a checkpoint file or run dir


GROUP_SCHEMAS: dict[str, dict[str, type]] = {
    "model": {"mlp": MLPConfig, "transformer": TransformerConfig},
    "optimizer": {"sgd": SGDConfig, "adamw": AdamWConfig},
    "schedule": {
        "constant": ConstantScheduleConfig,
        "epochwise": EpochwiseScheduleConfig,
        "global_batch": GlobalBatchScheduleConfig,
    },
    "sync": {"always": SyncConfig, "accumulate": AccumulateSyncConfig,
             "amp_aware": AmpAwareSyncConfig, "local_sgd": LocalSGDSyncConfig,
             "diloco": DiLoCoSyncConfig},
    "precision": {"fp32": PrecisionConfig, "bf16": PrecisionConfig, "fp16": PrecisionConfig},
    "data": {"synthetic": SyntheticDataConfig, "digits": DigitsDataConfig,
             "synthetic_lm": SyntheticLMDataConfig},
    "trainer": {"default": TrainerConfig},
    "lr_scheduler": {"none": NoLRSchedulerConfig, "cosine": CosineLRSchedulerConfig},
    "loss": {"default": LossConfig},
}

SCHEMAS_BY_NAME: dict[str, type] = {
    cls.__name__: cls for options in GROUP_SCHEMAS.values() for cls in options.values()
} | {"Config": Config}


def register_configs() -> None:
    cs = ConfigStore.instance()
    cs.store(name="schema_config", node=Config)
    for group, options in GROUP_SCHEMAS.items():
        for option, cls in options.items():
            cs.store(group=f"schema/{group}", name=option, node=cls)


def to_plain(cfg: DictConfig) -> dict[str, Any]:
    """Resolve interpolations and drop OmegaConf types: workers get plain, picklable data."""
    plain = OmegaConf.to_container(cfg, resolve=True, throw_on_missing=True)
    assert isinstance(plain, dict)
    return plain  # type: ignore[return-value]


def schema_keys(type_name: str) -> list[str]:
    cls = SCHEMAS_BY_NAME.get(type_name)
    return [f.name for f in fields(cls)] if cls else []


# --- semantic checks (run in the Hydra job, before any worker starts) -------------------------
def _require(ok: bool, key: str, allowed: str, got: Any) -> None:
    if not ok:
        raise ConfigError(f"{key}={got!r} is not allowed: {allowed}")


def resolve_world_size(cfg: dict[str, Any]) -> int:
    """torchrun's WORLD_SIZE when running under it, else trainer.devices."""
    env = os.environ.get("WORLD_SIZE")
    return int(env) if env else int(cfg["trainer"]["devices"])


def check_known_keys(cfg: dict[str, Any]) -> None:
    """Keys added with `+key=value` bypass the schema's struct mode: refuse them here."""
    allowed_top = {f.name for f in fields(Config)}
    for key in cfg:
        if key not in allowed_top:
            raise ConfigError(f"{key}: unknown key; allowed keys: {', '.join(sorted(allowed_top))}")
    for group, options in GROUP_SCHEMAS.items():
        allowed = {f.name for cls in options.values() for f in fields(cls)}
        for key in cfg[group]:
            if key not in allowed:
                raise ConfigError(f"{group}.{key}: unknown key; allowed keys: "
                                  f"{', '.join(sorted(allowed))}")


def validate(cfg: dict[str, Any], cuda_available: bool) -> None:
    """Checks across keys that types alone cannot express. Raises ConfigError."""
    check_known_keys(cfg)
    check_model_averaging(cfg["sync"])
    tr = cfg["trainer"]
    _require(tr["devices"] >= 1, "trainer.devices", "an integer >= 1", tr["devices"])
    _require(
        tr["max_steps"] == -1 or tr["max_steps"] >= 1,
        "trainer.max_steps", "-1 (no limit) or an integer >= 1", tr["max_steps"],
    )
    _require(tr["max_epochs"] >= 1, "trainer.max_epochs", "an integer >= 1", tr["max_epochs"])
    _require(tr["log_every"] >= 1, "trainer.log_every", "an integer >= 1", tr["log_every"])
    _require(tr["eval_every"] >= 0, "trainer.eval_every", "an integer >= 0", tr["eval_every"])
    _require(tr["clip_grad_norm"] >= 0, "trainer.clip_grad_norm", "a number >= 0 (0: off)",
             tr["clip_grad_norm"])
    _require(tr["threads_per_worker"] >= 0, "trainer.threads_per_worker",
             "an integer >= 0 (0: automatic)", tr["threads_per_worker"])
    _require(tr["timeout_s"] >= 1, "trainer.timeout_s", "an integer >= 1", tr["timeout_s"])
    _require(tr["checkpoint_every"] >= 0, "trainer.checkpoint_every",
             "an integer >= 0 (0: only at the end)", tr["checkpoint_every"])
    _require(tr["keep_checkpoints"] >= 1, "trainer.keep_checkpoints", "an integer >= 1",
             tr["keep_checkpoints"])
    _require(tr["num_workers"] >= 0, "trainer.num_workers", "an integer >= 0",
             tr["num_workers"])
    _require(tr["fail_at_step"] == -1 or tr["fail_at_step"] >= 1, "trainer.fail_at_step",
             "-1 (never) or an integer >= 1", tr["fail_at_step"])
    _require(cfg["resume"] in ("none", "auto") or os.path.exists(cfg["resume"]), "resume",
             "none, auto, or the path of a checkpoint file or run dir", cfg["resume"])
    backends = ("auto", "gloo", "nccl")
    _require(tr["backend"] in backends, "trainer.backend", f"one of {', '.join(backends)}",
             tr["backend"])
    if tr["backend"] == "nccl" and not cuda_available:
        raise ConfigError("trainer.backend='nccl' needs CUDA, which this machine lacks: "
                          "use auto or gloo")
    modes = ("auto", "shared_memory", "process_group")
    _require(tr["allreduce"] in modes, "trainer.allreduce", f"one of {', '.join(modes)}",
             tr["allreduce"])
    if tr["allreduce"] == "shared_memory" and (
            tr["backend"] == "nccl" or (tr["backend"] == "auto" and cuda_available)):
        raise ConfigError("trainer.allreduce=shared_memory is for CPU ranks on gloo; on CUDA "
                          "nccl all-reduces: use auto or process_group")

    micro = cfg["data"]["micro_batch_size"]
    _require(micro >= 1, "data.micro_batch_size", "an integer >= 1", micro)
    if cfg["data"]["name"] in ("synthetic", "synthetic_lm"):
        n = cfg["data"]["num_samples"]
        _require(n >= 1, "data.num_samples", "an integer >= 1", n)
    validate_tokens(cfg)

    world = resolve_world_size(cfg)
    sched = cfg["schedule"]
    if sched["name"] == "constant":
        _require(sched["accum_steps"] >= 1, "schedule.accum_steps", "an integer >= 1",
                 sched["accum_steps"])
    elif sched["name"] == "epochwise":
        by_epoch = sched["accum_steps_by_epoch"]
        _require(0 in by_epoch, "schedule.accum_steps_by_epoch",
                 "a mapping {first_epoch: accum_steps} that starts at epoch 0", by_epoch)
        _require(all(e >= 0 and n >= 1 for e, n in by_epoch.items()),
                 "schedule.accum_steps_by_epoch", "epochs >= 0 mapped to accum_steps >= 1",
                 by_epoch)
    elif sched["name"] == "global_batch":
        gb = sched["global_batch_size"]
        per_window = world * micro
        _require(gb >= 1 and gb % per_window == 0, "schedule.global_batch_size",
                 f"a positive multiple of world_size x data.micro_batch_size = {world} x {micro}"
                 f" = {per_window}", gb)

    act = cfg["model"].get("activation")
    if act is not None:
        _require(act in ("relu", "gelu", "tanh"), "model.activation", "one of relu, gelu, tanh",
                 act)
    if "dropout" in cfg["model"]:
        _require(0.0 <= cfg["model"]["dropout"] < 1.0, "model.dropout", "a number in [0, 1)",
                 cfg["model"]["dropout"])
    if "hidden_sizes" in cfg["model"]:
        _require(all(h >= 1 for h in cfg["model"]["hidden_sizes"]), "model.hidden_sizes",
                 "a list of integers >= 1", cfg["model"]["hidden_sizes"])

    check_precision(cfg, cuda_available)
    check_compression(cfg)
    lrs = cfg["lr_scheduler"]
    if lrs["name"] == "cosine":
        _require(lrs["warmup_steps"] >= 0, "lr_scheduler.warmup_steps", "an integer >= 0",
                 lrs["warmup_steps"])
        _require(0.0 <= lrs["min_lr_ratio"] <= 1.0, "lr_scheduler.min_lr_ratio",
                 "a number in [0, 1]", lrs["min_lr_ratio"])


def check_precision(cfg: dict[str, Any], cuda_available: bool) -> None:
    """The precision, its scaler settings and amp_aware's options; a precision that autocast
    cannot run on the device the workers will use is refused here, before they start."""
    pcfg, sync = cfg["precision"], cfg["sync"]
    prec = pcfg["name"]
    _require(prec in DTYPES, "precision.name", "one of fp32, bf16, fp16", prec)
    backend = cfg["trainer"]["backend"]
    device = "cuda" if backend == "nccl" or (backend == "auto" and cuda_available) else "cpu"
    if not autocast_runs(prec, device):
        runnable = [name for name in DTYPES if autocast_runs(name, device)]
        raise ConfigError(f"precision.name={prec!r} cannot run on {device} (torch autocast "
                          f"falls back to fp32 there): choose one of {', '.join(runnable)}")
    _require(pcfg["init_scale"] > 0, "precision.init_scale", "a number > 0", pcfg["init_scale"])
    _require(pcfg["growth_interval"] >= 1, "precision.growth_interval", "an integer >= 1",
             pcfg["growth_interval"])
    _require(pcfg["growth_factor"] > 1, "precision.growth_factor", "a number > 1",
             pcfg["growth_factor"])
    _require(0 < pcfg["backoff_factor"] < 1, "precision.backoff_factor", "a number in (0, 1)",
             pcfg["backoff_factor"])
    if sync["name"] == "amp_aware":
        _require(sync["comm_dtype"] in DTYPES, "sync.comm_dtype", "one of bf16, fp16, fp32",
                 sync["comm_dtype"])
        if sync["comm_dtype"] == "fp16" and prec != "fp16":
            raise ConfigError(f"sync.comm_dtype='fp16' needs precision=fp16, not {prec!r}: only "
                              "its GradScaler catches an overflow of the fp16 all-reduce; "
                              "use bf16 or fp32")


MODEL_AVERAGING = {"local_sgd": LocalSGDSyncConfig, "diloco": DiLoCoSyncConfig}


def check_model_averaging(sync: dict[str, Any]) -> None:
    """sync=local_sgd / diloco: their own options only (the gradient all-reduce's options,
    PowerSGD and amp_aware's overflow consensus, have nothing to act on), in range."""
    schema = MODEL_AVERAGING.get(sync["name"])
    if schema is None:
        return
    own = [f.name for f in fields(schema)]
    for key in sync:
        if key not in own:
            raise ConfigError(f"sync.{key} is not an option of sync={sync['name']} (its "
                              f"gradients are never all-reduced after warm-up); its options: "
                              f"{', '.join(own[1:])}")
    _require(sync["every"] >= 1, "sync.every", "an integer >= 1 (windows between averagings)",
             sync["every"])
    _require(sync["warmup_steps"] >= 0, "sync.warmup_steps", "an integer >= 0",
             sync["warmup_steps"])
    _require(sync["comm_dtype"] in ("fp32", "bf16"), "sync.comm_dtype", "one of fp32, bf16",
             sync["comm_dtype"])
    if sync["name"] == "diloco":
        _require(sync["outer_lr"] > 0, "sync.outer_lr", "a number > 0", sync["outer_lr"])
        _require(0 <= sync["outer_momentum"] < 1, "sync.outer_momentum", "a number in [0, 1)",
                 sync["outer_momentum"])
        if sync["outer_nesterov"] and sync["outer_momentum"] == 0:
            raise ConfigError("sync.outer_nesterov=true needs sync.outer_momentum > 0: set "
                              "sync.outer_nesterov=false")


def check_compression(cfg: dict[str, Any]) -> None:
    """sync.compression=powersgd and what it cannot go with."""
    sync = cfg["sync"]
    if sync.get("compression", "none") == "none":
        return
    _require(sync["compression"] == "powersgd", "sync.compression", "none or powersgd",
             sync["compression"])
    _require(sync["powersgd_rank"] >= 1, "sync.powersgd_rank", "an integer >= 1",
             sync["powersgd_rank"])
    _require(sync["powersgd_start_step"] >= 2, "sync.powersgd_start_step",
             "an integer >= 2 (torch's PowerSGD with error feedback)",
             sync["powersgd_start_step"])
    if sync["name"] == "amp_aware" and sync["comm_dtype"] != "fp32":
        raise ConfigError("sync.compression=powersgd sends its own fp32 factors: set "
                          f"sync.comm_dtype=fp32 (not {sync['comm_dtype']!r})")
    if cfg["trainer"]["allreduce"] == "shared_memory":
        raise ConfigError("sync.compression=powersgd all-reduces through the process "
                          "group: use trainer.allreduce=auto or process_group")


TOKEN_DATA = ("synthetic_lm",)


def validate_tokens(cfg: dict[str, Any]) -> None:
    """Token data, the transformer and loss.normalize go together."""
    data, model = cfg["data"], cfg["model"]
    tokens = data["name"] in TOKEN_DATA
    if tokens:
        _require(model["name"] == "transformer", "model",
                 f"data={data['name']} (token data) needs model=transformer", model["name"])
    elif model["name"] == "transformer":
        raise ConfigError(f"model=transformer needs token data (data=synthetic_lm); "
                          f"data={data['name']} has samples: use model=mlp")
    normalize = cfg["loss"]["normalize"]
    _require(normalize in NORMALIZE_CHOICES, "loss.normalize",
             f"one of {', '.join(NORMALIZE_CHOICES)}", normalize)
    if normalize == "tokens" and not tokens:
        raise ConfigError(f"loss.normalize='tokens' needs token data (data=synthetic_lm); "
                          f"data={data['name']} has samples: use auto or samples")
    if model["name"] == "transformer":
        _require(model["d_model"] >= 1 and model["d_model"] % model["n_heads"] == 0,
                 "model.d_model", f"a positive multiple of model.n_heads={model['n_heads']}",
                 model["d_model"])
        for key in ("n_layers", "n_heads", "mlp_ratio"):
            _require(model[key] >= 1, f"model.{key}", "an integer >= 1", model[key])
    if tokens:
        _require(data["vocab_size"] >= 2, "data.vocab_size", "an integer >= 2",
                 data["vocab_size"])
        _require(data["min_len"] >= 2, "data.min_len",
                 "an integer >= 2 (a sequence needs one input and one target)", data["min_len"])
        _require(data["max_len"] >= data["min_len"], "data.max_len",
                 f"an integer >= data.min_len={data['min_len']}", data["max_len"])
        _require(1 <= data["max_stride"] < data["vocab_size"], "data.max_stride",
                 f"an integer in [1, data.vocab_size={data['vocab_size']})", data["max_stride"])
        _require(0.0 <= data["noise"] <= 1.0, "data.noise", "a number in [0, 1]", data["noise"])
        _require(data["eval_samples"] >= 1, "data.eval_samples", "an integer >= 1",
                 data["eval_samples"])


def build_optimizer(cfg: dict[str, Any], params):
    """Hydra's instantiate on a plain dict with ``_partial_: true``: returns the optimizer."""
    from hydra.utils import instantiate

    return instantiate(cfg)(params)
