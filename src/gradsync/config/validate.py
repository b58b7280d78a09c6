"""The config's edge: Hydra's schemas for the groups with a fixed shape (settings.py), the checks
of a composed config before any worker starts, and the typed ``RunConfig`` workers receive.

Groups with a fixed shape (trainer, schedule, precision, loss) are dataclasses in Hydra's
ConfigStore under ``schema/<group>/<option>``; their YAML files extend them and state only what
differs, so a wrong type or an unknown key fails at composition. Components (model, data, sync,
optimizer, lr_scheduler) are ``_target_`` nodes, held against their callable's own signature and
own checks (components.py). Only this module and ``train.py`` import Hydra or OmegaConf.
"""

from __future__ import annotations

import functools
import math
import os
from dataclasses import dataclass, field, fields, replace
from typing import Any

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING, DictConfig, OmegaConf

from gradsync.components import (
    CheckContext,
    ConfigError,
    build,
    check,
    locate,
    parameters,
    require,
)
from gradsync.config.schema import (
    SCHEDULES,
    LossConfig,
    PrecisionConfig,
    RunConfig,
    TrainerConfig,
)
from gradsync.sync.layer_sync import model_parameters
from gradsync.train.normalize import CHOICES as NORMALIZE_CHOICES
from gradsync.train.precision import DTYPES, autocast_runs

__all__ = ["ConfigError", "RunConfig", "register_configs", "to_plain", "validate"]


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


SCHEMA_GROUPS: dict[str, dict[str, type]] = {
    "schedule": SCHEDULES,
    "precision": {"fp32": PrecisionConfig, "bf16": PrecisionConfig, "fp16": PrecisionConfig},
    "trainer": {"default": TrainerConfig},
    "loss": {"default": LossConfig},
}
SCHEMAS_BY_NAME: dict[str, type] = {
    cls.__name__: cls for options in SCHEMA_GROUPS.values() for cls in options.values()
} | {"Config": Config}


def register_configs() -> None:
    cs = ConfigStore.instance()
    cs.store(name="schema_config", node=Config)
    for group, options in SCHEMA_GROUPS.items():
        for option, cls in options.items():
            cs.store(group=f"schema/{group}", name=option, node=cls)


def to_plain(cfg: DictConfig) -> dict[str, Any]:
    """Resolve interpolations and drop OmegaConf types: plain, picklable data."""
    plain = OmegaConf.to_container(cfg, resolve=True, throw_on_missing=True)
    assert isinstance(plain, dict)
    return plain  # type: ignore[return-value]


def schema_keys(type_name: str) -> list[str]:
    cls = SCHEMAS_BY_NAME.get(type_name)
    return [f.name for f in fields(cls)] if cls else []


def resolve_world_size(cfg: dict[str, Any]) -> int:
    """torchrun's WORLD_SIZE when running under it, else trainer.devices."""
    env = os.environ.get("WORLD_SIZE")
    return int(env) if env else int(cfg["trainer"]["devices"])


# --- checks (run in the Hydra job, before any worker starts) -------------------------------
def _finite(x: Any) -> bool:
    return isinstance(x, (int, float)) and math.isfinite(x)


def check_known_keys(cfg: dict[str, Any]) -> None:
    """Keys added with `+key=value` bypass the schema's struct mode: refuse them here, against
    the chosen option's own schema (never a sibling option's keys)."""
    allowed_top = {f.name for f in fields(Config)}
    for key in cfg:
        if key not in allowed_top:
            raise ConfigError(f"{key}: unknown key; allowed keys: {', '.join(sorted(allowed_top))}")
    for group, options in SCHEMA_GROUPS.items():
        node = cfg[group]
        name = node.get("name")
        if group == "schedule":
            require(name in options, "schedule.name", f"one of {', '.join(options)}", name)
        schema = options.get(name) or next(iter(options.values()))
        allowed = {f.name for f in fields(schema)}
        for key in node:
            if key not in allowed:
                raise ConfigError(f"{group}.{key}: unknown key; allowed keys: "
                                  f"{', '.join(sorted(allowed))}")


def check_trainer(tr: dict[str, Any], cuda_available: bool) -> None:
    at_least = {"devices": 1, "max_epochs": 1, "log_every": 1, "eval_every": 0,
                "threads_per_worker": 0, "timeout_s": 1, "checkpoint_every": 0,
                "keep_checkpoints": 1, "num_workers": 0, "check_replicas": 0}
    for key, low in at_least.items():
        meaning = {0: "an integer >= 0", 1: "an integer >= 1"}[low]
        require(tr[key] >= low, f"trainer.{key}", meaning, tr[key])
    require(tr["max_steps"] == -1 or tr["max_steps"] >= 1, "trainer.max_steps",
            "-1 (no limit) or an integer >= 1", tr["max_steps"])
    require(tr["fail_at_step"] == -1 or tr["fail_at_step"] >= 1, "trainer.fail_at_step",
            "-1 (never) or an integer >= 1", tr["fail_at_step"])
    require(_finite(tr["clip_grad_norm"]) and tr["clip_grad_norm"] >= 0,
            "trainer.clip_grad_norm", "a finite number >= 0 (0: off)", tr["clip_grad_norm"])
    require(_finite(tr["bucket_cap_mb"]) and tr["bucket_cap_mb"] > 0, "trainer.bucket_cap_mb",
            "a finite number > 0", tr["bucket_cap_mb"])
    backends = ("auto", "gloo", "nccl")
    require(tr["backend"] in backends, "trainer.backend", f"one of {', '.join(backends)}",
            tr["backend"])
    if tr["backend"] == "nccl" and not cuda_available:
        raise ConfigError("trainer.backend='nccl' needs CUDA, which this machine lacks: "
                          "use auto or gloo")
    modes = ("auto", "shared_memory", "process_group")
    require(tr["allreduce"] in modes, "trainer.allreduce", f"one of {', '.join(modes)}",
            tr["allreduce"])
    if tr["allreduce"] == "shared_memory" and (
            tr["backend"] == "nccl" or (tr["backend"] == "auto" and cuda_available)):
        raise ConfigError("trainer.allreduce=shared_memory is for CPU ranks on gloo; on CUDA "
                          "nccl all-reduces: use auto or process_group")


def check_schedule(sched: dict[str, Any], world: int, micro: int) -> None:
    if sched["name"] == "constant":
        require(sched["accum_steps"] >= 1, "schedule.accum_steps", "an integer >= 1",
                sched["accum_steps"])
    elif sched["name"] == "epochwise":
        by_epoch = sched["accum_steps_by_epoch"]
        require(isinstance(by_epoch, dict) and all(
            isinstance(e, int) and isinstance(n, int) for e, n in by_epoch.items()),
            "schedule.accum_steps_by_epoch", "a mapping {first_epoch: accum_steps} of integers",
            by_epoch)
        require(0 in by_epoch, "schedule.accum_steps_by_epoch",
                "a mapping {first_epoch: accum_steps} that starts at epoch 0", by_epoch)
        require(all(e >= 0 and n >= 1 for e, n in by_epoch.items()),
                "schedule.accum_steps_by_epoch", "epochs >= 0 mapped to accum_steps >= 1",
                by_epoch)
    elif sched["name"] == "global_batch":
        gb = sched["global_batch_size"]
        per_window = world * micro
        require(gb >= 1 and gb % per_window == 0, "schedule.global_batch_size",
                f"a positive multiple of world_size x data.micro_batch_size = {world} x {micro}"
                f" = {per_window}", gb)


# What the worker passes each component itself (runtime arguments, never in the config).
DATA_SIZES = ("in_dim", "out_dim", "vocab_size", "max_len")
RUNTIME = {"model": DATA_SIZES, "data": ("seed",), "sync": ("uses_scaler", "world_size", "counts"),
           "optimizer": ("params",), "lr_scheduler": ("optimizer", "total_steps")}
EXTRA = {"data": ("micro_batch_size",)}  # keys of a node that the loop reads, not the target


def accepted_keys(group: str, node: dict[str, Any]) -> str:
    """A component group's accepted keys, for messages."""
    try:
        names = parameters(locate(node["_target_"]))
    except (ConfigError, KeyError, TypeError):
        return ""
    return ", ".join(sorted(n for n in names if n not in RUNTIME.get(group, ())))


def check_components(cfg: dict[str, Any], world: int) -> None:
    """Every component against its callable's signature and own checks; then what components
    must agree on: the sizes the model needs and the data provides, the loss's unit."""
    precision = cfg["precision"]["name"]
    data_node = cfg["data"]
    require(isinstance(data_node, dict) and isinstance(data_node.get("micro_batch_size"), int)
            and data_node["micro_batch_size"] >= 1, "data.micro_batch_size", "an integer >= 1",
            data_node.get("micro_batch_size") if isinstance(data_node, dict) else data_node)
    ctx = CheckContext("", world, precision, provided={
        "allreduce": cfg["trainer"]["allreduce"],
        "clip_grad_norm": cfg["trainer"]["clip_grad_norm"],
        # the model's (name, shape, dtype) of every parameter, built on the meta device when a
        # check asks (sync.groups); after the data and model checks passed
        "parameters": functools.cache(lambda: model_parameters(cfg["model"], data_node,
                                                               cfg["seed"], EXTRA["data"]))})
    data = check("data", data_node, RUNTIME["data"], replace(ctx, group="data"), EXTRA["data"])
    provides = tuple(getattr(data, "sizes", DATA_SIZES))
    unit = getattr(data, "unit", "samples")
    # the model gets the data's sizes that it names: those are not config keys
    model_node = cfg["model"]
    if isinstance(model_node, dict) and "_target_" in model_node:
        for name, p in parameters(locate(model_node["_target_"], "model._target_")).items():
            if name in DATA_SIZES and p.default is p.empty and name not in provides:
                raise ConfigError(f"model: {model_node['_target_']} needs {name}, which "
                                  f"data ({data_node['_target_']}) does not provide (it "
                                  f"provides {', '.join(provides)})")
    check("model", model_node, provides, replace(ctx, group="model"))
    for group in ("sync", "optimizer", "lr_scheduler"):
        check(group, cfg[group], RUNTIME[group], replace(ctx, group=group))
    normalize = cfg["loss"]["normalize"]
    require(normalize in NORMALIZE_CHOICES, "loss.normalize",
            f"one of {', '.join(NORMALIZE_CHOICES)}", normalize)
    if normalize == "tokens" and unit != "tokens":
        raise ConfigError(f"loss.normalize='tokens' needs token data; data "
                          f"({cfg['data']['_target_']}) counts {unit}: use auto or samples")
    check_optimizer(cfg["optimizer"])


def check_optimizer(node: dict[str, Any]) -> None:
    """The optimizer's own argument checks (torch raises on lr=nan, betas out of range...), run
    on one dummy parameter."""
    import torch

    for key, value in node.items():
        values = value if isinstance(value, (list, tuple)) else [value]
        numbers = [v for v in values if isinstance(v, (int, float)) and not isinstance(v, bool)]
        require(all(map(math.isfinite, numbers)), f"optimizer.{key}", "finite numbers", value)
    try:
        build(node)([torch.nn.Parameter(torch.zeros(1))])
    except Exception as e:
        raise ConfigError(f"optimizer ({node['_target_']}) refuses its arguments: "
                          f"{type(e).__name__}: {e}") from None


def validate(cfg: dict[str, Any], cuda_available: bool) -> None:
    """Every check a config must pass before any worker starts. Raises ConfigError."""
    check_known_keys(cfg)
    check_trainer(cfg["trainer"], cuda_available)
    require(isinstance(cfg["seed"], int) and 0 <= cfg["seed"] < 2**63, "seed",
            "an integer in [0, 2**63)", cfg["seed"])
    require(cfg["resume"] in ("none", "auto") or os.path.exists(cfg["resume"]), "resume",
            "none, auto, or the path of a checkpoint file or run dir", cfg["resume"])
    world = resolve_world_size(cfg)
    check_components(cfg, world)
    check_schedule(cfg["schedule"], world, cfg["data"]["micro_batch_size"])
    check_precision(cfg, cuda_available)


def check_precision(cfg: dict[str, Any], cuda_available: bool) -> None:
    """The precision and its scaler settings; a precision that autocast cannot run on the CPU
    is refused here, before the workers start (on CUDA: by the GPUs' compute capability, in
    train.check_devices)."""
    pcfg = cfg["precision"]
    prec = pcfg["name"]
    require(prec in DTYPES, "precision.name", "one of fp32, bf16, fp16", prec)
    backend = cfg["trainer"]["backend"]
    device = "cuda" if backend == "nccl" or (backend == "auto" and cuda_available) else "cpu"
    # CUDA: refused by the capability of the GPUs the ranks will use (train.check_devices),
    # never by running an op here, which would put a CUDA context on GPU 0
    if device == "cpu" and not autocast_runs(prec, device):
        runnable = [name for name in DTYPES if autocast_runs(name, device)]
        raise ConfigError(f"precision.name={prec!r} cannot run on {device} (torch autocast "
                          f"falls back to fp32 there): choose one of {', '.join(runnable)}")
    require(_finite(pcfg["init_scale"]) and pcfg["init_scale"] > 0, "precision.init_scale",
            "a finite number > 0", pcfg["init_scale"])
    require(pcfg["growth_interval"] >= 1, "precision.growth_interval", "an integer >= 1",
            pcfg["growth_interval"])
    require(_finite(pcfg["growth_factor"]) and pcfg["growth_factor"] > 1,
            "precision.growth_factor", "a finite number > 1", pcfg["growth_factor"])
    require(0 < pcfg["backoff_factor"] < 1, "precision.backoff_factor", "a number in (0, 1)",
            pcfg["backoff_factor"])

