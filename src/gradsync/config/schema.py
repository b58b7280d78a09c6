"""The typed run configuration every worker receives: dataclasses for the groups with a fixed
shape (trainer, schedule, precision, loss), and ``_target_`` nodes (plain dicts: a callable's
dotted path and its keyword arguments, see components.py) for the components a user may bring
(model, data, sync, optimizer, lr_scheduler).

No Hydra here: config.py registers these dataclasses as Hydra's schemas and turns a composed,
validated config into a ``RunConfig``; workers, tests and the benchmark only see this module.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any


@dataclass
class TrainerConfig:
    devices: int = 2
    max_steps: int = -1  # optimizer steps; -1: no limit (max_epochs decides)
    max_epochs: int = 30
    log_every: int = 10  # optimizer steps between TensorBoard/console logs
    eval_every: int = 0  # optimizer steps between evaluations; 0: only at the end
    backend: str = "auto"  # auto | gloo | nccl
    threads_per_worker: int = 0  # 0: the CPUs this process may use // ranks on the node
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
    check_replicas: int = 0  # optimizer steps between cross-rank parameter checksums; 0: off
    fail_at_step: int = -1  # test aid: the last rank raises after this optimizer step
    requeue: bool = True  # under SLURM, SIGUSR1/SIGUSR2: checkpoint, then scontrol requeue


@dataclass
class ConstantScheduleConfig:
    name: str = "constant"
    accum_steps: int = 1


@dataclass
class EpochwiseScheduleConfig:
    """Like Lightning's GradientAccumulationScheduler: {first_epoch: accum_steps}."""

    name: str = "epochwise"
    # dict[int, int]; typed Any so that an override can replace the mapping (train.py)
    accum_steps_by_epoch: Any = field(default_factory=lambda: {0: 1})


@dataclass
class GlobalBatchScheduleConfig:
    """N = global_batch_size / (world_size * micro_batch_size); must divide exactly."""

    name: str = "global_batch"
    global_batch_size: int = 256


ScheduleConfig = ConstantScheduleConfig | EpochwiseScheduleConfig | GlobalBatchScheduleConfig
SCHEDULES: dict[str, type] = {"constant": ConstantScheduleConfig,
                              "epochwise": EpochwiseScheduleConfig,
                              "global_batch": GlobalBatchScheduleConfig}


@dataclass
class PrecisionConfig:
    name: str = "fp32"  # fp32 | bf16 | fp16
    # the GradScaler's settings (fp16 only)
    init_scale: float = 65536.0
    growth_interval: int = 2000
    growth_factor: float = 2.0
    backoff_factor: float = 0.5


@dataclass
class LossConfig:
    normalize: str = "auto"  # auto (the data's unit: tokens or samples) | tokens | samples
    #                          | micro_batch_mean (the 2024 accumulation bug, to measure it)


COMPONENTS = ("model", "data", "sync", "optimizer", "lr_scheduler")


@dataclass
class RunConfig:
    """One run, resolved and validated. ``plain`` is the same as plain data: what checkpoints
    store and the config hash is taken of."""

    model: dict[str, Any]
    data: dict[str, Any]
    sync: dict[str, Any]
    optimizer: dict[str, Any]
    lr_scheduler: dict[str, Any]
    schedule: ScheduleConfig
    precision: PrecisionConfig
    trainer: TrainerConfig
    loss: LossConfig
    seed: int
    resume: str
    plain: dict[str, Any]

    @classmethod
    def from_plain(cls, plain: dict[str, Any]) -> RunConfig:
        def typed(kind: type, node: dict[str, Any]) -> Any:
            known = {f.name for f in fields(kind)}
            return kind(**{k: v for k, v in node.items() if k in known})

        schedule = plain["schedule"]
        return cls(**{k: plain[k] for k in COMPONENTS},
                   schedule=typed(SCHEDULES[schedule["name"]], schedule),
                   precision=typed(PrecisionConfig, plain["precision"]),
                   trainer=typed(TrainerConfig, plain["trainer"]),
                   loss=typed(LossConfig, plain["loss"]),
                   seed=plain["seed"], resume=plain["resume"], plain=plain)

    @property
    def micro_batch_size(self) -> int:
        return int(self.data["micro_batch_size"])
