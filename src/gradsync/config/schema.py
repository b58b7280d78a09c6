"""The typed run configuration every worker receives: dataclasses for the groups with a fixed
shape (trainer, schedule, precision, loss), each with the checks of its own values, and
``Component``s (a callable's dotted path and its keyword arguments, see components.py) for the
parts a user may bring (model, data, sync, optimizer, lr_scheduler).

No Hydra here: config/hydra.py registers these dataclasses as Hydra's schemas;
config/validate.py turns a composed config into a checked ``RunConfig`` once, before any worker
starts; workers, tests and the benchmark see only this module.
"""

from __future__ import annotations

import math
import typing
from dataclasses import asdict, dataclass, field, fields
from typing import Any

from gradsync.components import ConfigError, accepts, require
from gradsync.config.renames import upgrade_renamed_keys
from gradsync.core.numerics import BITS


def finite(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def check_types(obj: Any, group: str) -> None:
    """Every field of a settings dataclass holds a value of its annotated type (a bool is no
    integer, a string no bool): the first check of each ``check()``, so that the range checks
    after it compare numbers with numbers."""
    for name, hint in typing.get_type_hints(type(obj)).items():
        value = getattr(obj, name)
        require(accepts(hint, value), f"{group}.{name}", TYPE_NAMES.get(hint, str(hint)), value)


TYPE_NAMES: dict[Any, str] = {int: "an integer", float: "a number", bool: "true or false",
                              str: "a string", bool | None: "true, false or null"}


def _in_range(obj: Any, group: str, ranges: dict[str, tuple[int, int | None]]) -> None:
    """Integer fields within [low, high] (high None: no upper bound)."""
    for key, (low, high) in ranges.items():
        value = getattr(obj, key)
        allowed = f"an integer >= {low}" + ("" if high is None else f" (at most {high})")
        require(value >= low and (high is None or value <= high), f"{group}.{key}", allowed,
                value)


BACKENDS = ("auto", "gloo", "nccl")  # trainer.backend (run/placement.py resolves auto)
# Upper bounds of counts no machine runs: ranks one launcher starts on one node, threads of
# one rank, DataLoader worker processes of one rank.
MAX_LOCAL_RANKS = 1024
MAX_THREADS = 1024
MAX_LOADER_WORKERS = 256
MAX_EPOCHS = 10**6  # the run's epochs are planned one by one at its start
MAX_WINDOW_SIZE = 2**20  # micro-batches of one window (schedule=adaptive's bounds)
# A process group's timeout: torch's clocks count nanoseconds in 64 bits (about 292 years),
# Python's timedelta fewer than 10**14 seconds; 10**9 s (31 years) is far from both.
MAX_TIMEOUT_S = 10**9
MAX_FLOAT32 = 3.4028234663852886e38  # the GradScaler's scale is a float32


COMPILE_MODES = ("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")


@dataclass
class TrainerConfig:
    devices: int = 2
    max_steps: int = -1  # optimizer steps; -1: no limit (max_epochs decides)
    max_epochs: int = 30
    # windows (optimizer-step attempts: an fp16-skipped step's window counts) between
    # TensorBoard/console logs
    log_every_windows: int = 10
    eval_every_steps: int = 0  # optimizer steps taken between evaluations; 0: only at the end
    backend: str = "auto"  # auto | gloo | nccl
    threads_per_worker: int = 0  # 0: the CPUs this process may use // ranks on the node
    progress_bar: bool = True
    clip_grad_norm: float = 0.0  # 0: no clipping
    timeout_s: int = 300  # process-group timeout
    # torch's deterministic algorithms; null: on for CPU without torch's NaN fill of new
    # tensors, off for CUDA; true: torch's full mode (the fill too) (train/repro.py)
    deterministic: bool | None = None
    bits: str = "native"  # native | portable: the CPU numerics pinned (core/numerics.py)
    checkpoint_every_steps: int = 100  # optimizer steps taken; 0: only at the end (and stopped)
    keep_checkpoints: int = 3  # the newest K step checkpoints stay
    num_workers: int = 0  # DataLoader worker processes per rank
    check_replicas: int = 0  # optimizer steps between cross-rank parameter checksums; 0: off
    fail_at_step: int = -1  # test aid: the last rank raises after this optimizer step
    requeue: bool = True  # under SLURM, SIGUSR1/SIGUSR2: checkpoint, then scontrol requeue

    def check(self, device_type: str) -> None:
        """device_type: where the ranks compute (the job's placement), cpu or cuda."""
        check_types(self, "trainer")
        _in_range(self, "trainer", {
            "devices": (1, MAX_LOCAL_RANKS), "max_epochs": (1, MAX_EPOCHS),
            "log_every_windows": (1, None), "eval_every_steps": (0, None),
            "threads_per_worker": (0, MAX_THREADS), "timeout_s": (1, MAX_TIMEOUT_S),
            "checkpoint_every_steps": (0, None), "keep_checkpoints": (1, None),
            "num_workers": (0, MAX_LOADER_WORKERS), "check_replicas": (0, None)})
        require(self.max_steps == -1 or self.max_steps >= 1, "trainer.max_steps",
                "-1 (no limit) or an integer >= 1", self.max_steps)
        require(self.fail_at_step == -1 or self.fail_at_step >= 1, "trainer.fail_at_step",
                "-1 (never) or an integer >= 1", self.fail_at_step)
        require(finite(self.clip_grad_norm) and self.clip_grad_norm >= 0,
                "trainer.clip_grad_norm", "a finite number >= 0 (0: off)", self.clip_grad_norm)
        require(self.backend in BACKENDS, "trainer.backend", f"one of {', '.join(BACKENDS)}",
                self.backend)
        require(self.bits in BITS, "trainer.bits", f"one of {', '.join(BITS)}", self.bits)


@dataclass
class CompileConfig:
    """compile.*: torch.compile, on every engine (docs/components.md "Compile"; what each
    engine compiles: engines/compiled.py): its backend (inductor, aot_eager, ...), mode
    (inductor's: default, reduce-overhead, max-autotune...) and dynamic shapes (null: torch's
    default, dynamic after the first shape change)."""

    enabled: bool = False
    backend: str = "inductor"
    mode: str | None = None
    dynamic: bool | None = None

    def check(self) -> None:
        """enabled: a backend and mode torch.compile can run (the engine's bucket size: its
        capabilities, config/validate.py check_engine); off: no other compile.* setting (it
        would do nothing)."""
        check_types(self, "compile")
        if not self.enabled:
            for key in ("backend", "mode", "dynamic"):
                if getattr(self, key) != CompileConfig.__dataclass_fields__[key].default:
                    raise ConfigError(f"compile.{key}={getattr(self, key)!r} is for "
                                      "compile.enabled=true (it is false: nothing is compiled)")
            return
        from torch._dynamo import list_backends  # a second's import: only when compiling

        backends = sorted(set(list_backends(exclude_tags=())) | {"inductor"})
        require(self.backend in backends, "compile.backend", f"one of {', '.join(backends)}",
                self.backend)
        if self.mode is not None:
            require(self.mode in COMPILE_MODES, "compile.mode",
                    f"null or one of {', '.join(COMPILE_MODES)}", self.mode)
            require(self.backend == "inductor", "compile.mode",
                    "null with compile.backend other than inductor (modes are inductor's)",
                    self.mode)


@dataclass
class NoiseScaleConfig:
    """noise_scale.*: the gradient noise scale, measured at every synchronising window
    (docs/noise-scale.md); measured also whenever schedule=adaptive or lr_scaling=adascale needs
    it, enabled or not."""

    enabled: bool = False
    decay: float = 0.95  # of the exponential moving averages, per measured window

    def check(self) -> None:
        check_types(self, "noise_scale")
        require(finite(self.decay) and 0 < self.decay < 1, "noise_scale.decay",
                "a number in (0, 1)", self.decay)


@dataclass
class EngineConfig:
    """engine=<name> (conf/engine/<name>.yaml): the data-parallel engine, one of
    gradsync.engines.ENGINES (docs/engines.md, docs/sharded.md), and its settings, which the
    engine owns: its module's settings dataclass holds their defaults and checks
    (gradsync.engines.settings_of, run before any worker starts)."""

    name: str = "torch_ddp"
    settings: dict[str, Any] = field(default_factory=dict)  # engine.<key>, as composed

    @classmethod
    def from_node(cls, node: dict[str, Any]) -> EngineConfig:
        return cls(node["name"], {k: v for k, v in node.items() if k != "name"})

    @property
    def node(self) -> dict[str, Any]:
        return {"name": self.name, **self.settings}


# A window is N micro-batches of micro_batch_size samples on each rank; the schedule decides N.
MICRO_BATCH_SIZE = 16


@dataclass
class ConstantScheduleConfig:
    name: str = "constant"
    micro_batch_size: int = MICRO_BATCH_SIZE  # samples per rank per micro-batch
    window_size: int = 1  # micro-batches per optimizer step (the window's N)

    def check(self, world_size: int) -> None:
        check_types(self, "schedule")
        require(self.window_size >= 1, "schedule.window_size", "an integer >= 1",
                self.window_size)


@dataclass
class EpochwiseScheduleConfig:
    """Like Lightning's GradientAccumulationScheduler: {first_epoch: window_size}."""

    name: str = "epochwise"
    micro_batch_size: int = MICRO_BATCH_SIZE  # samples per rank per micro-batch
    # dict[int, int]; typed Any so that an override can replace the mapping (config/hydra.py)
    window_size_by_epoch: Any = field(default_factory=lambda: {0: 1})

    def check(self, world_size: int) -> None:
        check_types(self, "schedule")
        by_epoch = self.window_size_by_epoch
        require(isinstance(by_epoch, dict) and all(
            accepts(int, e) and accepts(int, n) for e, n in by_epoch.items()),
            "schedule.window_size_by_epoch", "a mapping {first_epoch: window_size} of integers",
            by_epoch)
        require(0 in by_epoch, "schedule.window_size_by_epoch",
                "a mapping {first_epoch: window_size} that starts at epoch 0", by_epoch)
        require(all(e >= 0 and n >= 1 for e, n in by_epoch.items()),
                "schedule.window_size_by_epoch", "epochs >= 0 mapped to window_size >= 1",
                by_epoch)


@dataclass
class GlobalBatchScheduleConfig:
    """N = global_batch_size / (world_size * micro_batch_size); must divide exactly."""

    name: str = "global_batch"
    micro_batch_size: int = MICRO_BATCH_SIZE  # samples per rank per micro-batch
    global_batch_size: int = 256

    def check(self, world_size: int) -> None:
        check_types(self, "schedule")
        gb, per_window = self.global_batch_size, world_size * self.micro_batch_size
        require(gb >= 1 and gb % per_window == 0, "schedule.global_batch_size",
                f"a positive multiple of world_size x schedule.micro_batch_size = {world_size} x "
                f"{self.micro_batch_size} = {per_window}", gb)


@dataclass
class AdaptiveScheduleConfig:
    """N follows the measured gradient noise scale: the global batch is kept near scale x
    B_simple, N clamped to [min_window_size, max_window_size], decided every `every_steps`
    optimizer steps (docs/noise-scale.md)."""

    name: str = "adaptive"
    micro_batch_size: int = MICRO_BATCH_SIZE  # samples per rank per micro-batch
    scale: float = 1.0  # target global batch / B_simple
    initial_window_size: int = 1  # until the first decision
    min_window_size: int = 1
    max_window_size: int = 16
    every_steps: int = 10  # optimizer steps between decisions: N changes at most this often

    def check(self, world_size: int) -> None:
        check_types(self, "schedule")
        _in_range(self, "schedule", {"initial_window_size": (1, MAX_WINDOW_SIZE), "min_window_size":
                                     (1, MAX_WINDOW_SIZE), "max_window_size": (1, MAX_WINDOW_SIZE),
                                     "every_steps": (1, None)})
        require(finite(self.scale) and self.scale > 0, "schedule.scale", "a finite number > 0",
                self.scale)
        require(self.min_window_size <= self.max_window_size, "schedule.max_window_size",
                f"an integer >= schedule.min_window_size={self.min_window_size}",
                self.max_window_size)
        require(self.min_window_size <= self.initial_window_size <= self.max_window_size,
                "schedule.initial_window_size", f"an integer in [{self.min_window_size}, "
                f"{self.max_window_size}] (schedule.min/max_window_size)",
                self.initial_window_size)
        if world_size == 1:
            require(self.min_window_size >= 2, "schedule.min_window_size",
                    "an integer >= 2 on 1 rank (the noise scale is measured there from a "
                    "window's first micro-batch and the whole window)", self.min_window_size)


ScheduleConfig = (ConstantScheduleConfig | EpochwiseScheduleConfig | GlobalBatchScheduleConfig
                  | AdaptiveScheduleConfig)
SCHEDULES: dict[str, type] = {"constant": ConstantScheduleConfig,
                              "epochwise": EpochwiseScheduleConfig,
                              "global_batch": GlobalBatchScheduleConfig,
                              "adaptive": AdaptiveScheduleConfig}
LR_SCALINGS = ("none", "linear", "sqrt", "adascale")


@dataclass
class LRScalingConfig:
    """How the learning rate follows the global batch (docs/noise-scale.md): none; linear or
    sqrt in global batch / reference_batch; adascale (AdaScale's gain from the measured noise
    scale, the LR schedule advanced by the gain)."""

    name: str = "none"
    # the global batch (samples) the optimizer's LR is set for; 0: the first window's,
    # world size x schedule.micro_batch_size x the schedule's first N
    reference_batch: int = 0

    def check(self) -> None:
        check_types(self, "lr_scaling")
        require(self.name in LR_SCALINGS, "lr_scaling.name", f"one of {', '.join(LR_SCALINGS)}",
                self.name)
        _in_range(self, "lr_scaling", {"reference_batch": (0, None)})


PRECISIONS = ("fp32", "bf16", "fp16")


@dataclass
class PrecisionConfig:
    name: str = "fp32"  # fp32 | bf16 | fp16
    # the GradScaler's settings (fp16 only)
    init_scale: float = 65536.0
    growth_interval: int = 2000
    growth_factor: float = 2.0
    backoff_factor: float = 0.5

    def check(self, device_type: str) -> None:
        """A precision autocast cannot run on the CPU is refused here, before the workers start
        (on CUDA: by the GPUs' compute capability, run/placement.py check_cuda, never by running
        an op here, which would put a CUDA context on GPU 0)."""
        from gradsync.core.dtypes import autocast_runs  # torch: only when checked

        check_types(self, "precision")
        require(self.name in PRECISIONS, "precision.name", f"one of {', '.join(PRECISIONS)}",
                self.name)
        if device_type == "cpu" and not autocast_runs(self.name, device_type):
            runnable = [name for name in PRECISIONS if autocast_runs(name, device_type)]
            raise ConfigError(f"precision.name={self.name!r} cannot run on {device_type} "
                              "(torch autocast falls back to fp32 there): choose one of "
                              f"{', '.join(runnable)}")
        require(finite(self.init_scale) and 0 < self.init_scale <= MAX_FLOAT32,
                "precision.init_scale", "a finite number > 0 (a float32: at most 3.4e38)",
                self.init_scale)
        require(1 <= self.growth_interval < 2**31, "precision.growth_interval",
                "an integer in [1, 2**31) (the scaler counts its steps in an int32)",
                self.growth_interval)
        require(finite(self.growth_factor) and self.growth_factor > 1,
                "precision.growth_factor", "a finite number > 1", self.growth_factor)
        require(finite(self.backoff_factor) and 0 < self.backoff_factor < 1,
                "precision.backoff_factor", "a number in (0, 1)", self.backoff_factor)


NORMALIZE = ("auto", "tokens", "samples", "micro_batch_mean")


@dataclass
class LossConfig:
    normalize: str = "auto"  # auto (the data's unit: tokens or samples) | tokens | samples
    #                          | micro_batch_mean (the 2024 accumulation bug, to measure it)

    def check(self, unit: str, data_target: str) -> None:
        """unit: what the data's loss counts (samples or tokens)."""
        check_types(self, "loss")
        require(self.normalize in NORMALIZE, "loss.normalize", f"one of {', '.join(NORMALIZE)}",
                self.normalize)
        if self.normalize == "tokens" and unit != "tokens":
            raise ConfigError(f"loss.normalize='tokens' needs token data; data ({data_target}) "
                              f"counts {unit}: use auto or samples")


@dataclass(frozen=True)
class Component:
    """A ``_target_`` node: the callable's dotted path and the keyword arguments the config
    sets (``partial``: ``_partial_: true``, called later with what only the worker knows)."""

    target: str
    args: dict[str, Any]
    partial: bool = False

    @classmethod
    def from_node(cls, node: dict[str, Any]) -> Component:
        args = {k: v for k, v in node.items() if k not in ("_target_", "_partial_")}
        return cls(node["_target_"], args, bool(node.get("_partial_", False)))

    @property
    def node(self) -> dict[str, Any]:
        """As the config holds it (and components.build takes it)."""
        return {"_target_": self.target, **self.args} | ({"_partial_": True} if self.partial
                                                         else {})


COMPONENTS = ("model", "data", "sync", "optimizer", "lr_scheduler")


@dataclass
class RunConfig:
    """One run, resolved and checked (config/validate.py). ``to_plain()`` is the same as plain
    data, as the config composes it: what checkpoints store and the config hash is taken of."""

    model: Component
    data: Component
    sync: Component
    optimizer: Component
    lr_scheduler: Component
    schedule: ScheduleConfig
    precision: PrecisionConfig
    trainer: TrainerConfig
    engine: EngineConfig
    compile: CompileConfig
    noise_scale: NoiseScaleConfig
    loss: LossConfig
    lr_scaling: LRScalingConfig
    seed: int
    resume: str  # none, or the checkpoint to start from (the job resolves auto to a path)
    # the experiment trackers by name (logger=tensorboard | csv | mlflow | wandb, or a list:
    # train/trackers.py); what a run logs to, not what it computes: outside the config hash
    logger: dict[str, Component] = field(default_factory=dict)
    # a sweep's job: the sweep dir (its trackers' parent runs: <sweep dir>/trackers.json); set
    # by the entry point, not a config key
    sweep_dir: str | None = None

    @classmethod
    def from_plain(cls, plain: dict[str, Any]) -> RunConfig:
        def typed(kind: type, node: dict[str, Any]) -> Any:
            known = {f.name for f in fields(kind)}
            return kind(**{k: v for k, v in node.items() if k in known})

        plain = upgrade_renamed_keys(plain)  # a config a checkpoint recorded before a rename
        components: dict[str, Any] = {k: Component.from_node(plain[k]) for k in COMPONENTS}
        return cls(**components,
                   schedule=typed(SCHEDULES[plain["schedule"]["name"]], plain["schedule"]),
                   precision=typed(PrecisionConfig, plain["precision"]),
                   trainer=typed(TrainerConfig, plain["trainer"]),
                   engine=EngineConfig.from_node(plain["engine"]),
                   compile=typed(CompileConfig, plain["compile"]),
                   noise_scale=typed(NoiseScaleConfig, plain["noise_scale"]),
                   loss=typed(LossConfig, plain["loss"]),
                   lr_scaling=typed(LRScalingConfig, plain["lr_scaling"]),
                   seed=plain["seed"], resume=plain["resume"],
                   logger={name: Component.from_node(node)
                           for name, node in (plain.get("logger") or {}).items()})

    @property
    def micro_batch_size(self) -> int:
        """schedule.micro_batch_size: samples per rank per micro-batch."""
        return self.schedule.micro_batch_size

    def to_plain(self) -> dict[str, Any]:
        out: dict[str, Any] = {k: getattr(self, k).node for k in (*COMPONENTS, "engine")}
        for group in ("schedule", "precision", "trainer", "compile", "noise_scale", "loss",
                      "lr_scaling"):
            out[group] = asdict(getattr(self, group))
        return out | {"seed": self.seed, "resume": self.resume,
                      "logger": {name: c.node for name, c in self.logger.items()}}


# The groups with a fixed shape, by option: Hydra's schemas (config/hydra.py) and the known-key
# check (config/validate.py).
SCHEMA_GROUPS: dict[str, dict[str, type]] = {
    "schedule": SCHEDULES,
    "precision": {name: PrecisionConfig for name in PRECISIONS},
    "trainer": {"default": TrainerConfig},
    "compile": {"default": CompileConfig},
    "noise_scale": {"default": NoiseScaleConfig},
    "loss": {"default": LossConfig},
    "lr_scaling": {name: LRScalingConfig for name in LR_SCALINGS},
}
# network: the launcher's (run/network.py), outside RunConfig: where the ranks talk, not what
# they compute (the same bits on any network). The config's top-level keys:
TOP_KEYS = (*COMPONENTS, *SCHEMA_GROUPS, "engine", "seed", "resume", "logger", "network")
