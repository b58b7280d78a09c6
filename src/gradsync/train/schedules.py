"""Accumulation schedules (how many micro-batches make the next optimizer step: per epoch, or
following the measured noise scale) and the windows of an epoch, cut one at a time from where
the epoch stands, including the short windows at its end."""

from __future__ import annotations

import bisect
import math
from dataclasses import dataclass
from typing import Any, Protocol

from gradsync.config.schema import (
    AdaptiveScheduleConfig,
    ConstantScheduleConfig,
    EpochwiseScheduleConfig,
    ScheduleConfig,
)


class MeasuredNoise(Protocol):
    """The measured noise scale as a schedule reads it (train/noise_scale.py NoiseScale)."""

    def current(self) -> dict[str, float]:
        """Collective: the newest estimates (``noise_scale``: B_simple)."""
        ...


class Schedule(Protocol):
    def accum_steps(self, epoch: int) -> int:
        """Micro-batches of the next window (an epoch's last window may hold fewer)."""
        ...

    def after_step(self, step: int, noise: MeasuredNoise | None) -> None:
        """After each optimizer step taken (step: steps taken so far), on every rank."""
        ...

    def sizes(self, max_epochs: int) -> list[int]:
        """The window sizes the run uses (so far), for summary.json."""
        ...

    def largest(self, max_epochs: int) -> int:
        """The largest window the run may use."""
        ...


class ConstantSchedule:
    def __init__(self, accum_steps: int):
        self.steps = accum_steps

    def accum_steps(self, epoch: int) -> int:
        return self.steps

    def after_step(self, step: int, noise: MeasuredNoise | None) -> None:
        pass

    def sizes(self, max_epochs: int) -> list[int]:
        return [self.steps]

    def largest(self, max_epochs: int) -> int:
        return self.steps


class EpochwiseSchedule:
    """{first_epoch: accum_steps}; each entry holds until the next one starts."""

    def __init__(self, accum_steps_by_epoch: dict[int, int]):
        items = sorted((int(e), int(n)) for e, n in accum_steps_by_epoch.items())
        self.starts = [e for e, _ in items]
        self.steps = [n for _, n in items]

    def accum_steps(self, epoch: int) -> int:
        return self.steps[bisect.bisect_right(self.starts, epoch) - 1]

    def after_step(self, step: int, noise: MeasuredNoise | None) -> None:
        pass

    def sizes(self, max_epochs: int) -> list[int]:
        return sorted({self.accum_steps(e) for e in range(max_epochs)})

    def largest(self, max_epochs: int) -> int:
        return max(self.sizes(max_epochs))


class AdaptiveSchedule:
    """schedule=adaptive: every `every` optimizer steps, N becomes the window that makes the
    global batch scale x B_simple (the measured noise scale, train/noise_scale.py), clamped to
    [lowest, highest]. B_simple is in the loss's units (samples, or tokens on token data):
    `units_per_micro` is what one micro-batch on every rank holds of them (world size x
    micro-batch x units per sample). The decision is a function of all-reduced numbers, the
    same on every rank; its state (N, the sizes used) is saved in checkpoints."""

    def __init__(self, scale: float, initial: int, lowest: int, highest: int, every: int,
                 units_per_micro: float):
        self.scale, self.lowest, self.highest, self.every = scale, lowest, highest, every
        self.units_per_micro = units_per_micro
        self.size = initial
        self.used = [initial]

    def accum_steps(self, epoch: int) -> int:
        return self.size

    def target(self, b_simple: float) -> int | None:
        """The window size for a measured B_simple (None: no decision, B_simple unknown)."""
        if math.isnan(b_simple):
            return None
        want = self.scale * b_simple / self.units_per_micro
        n = self.highest if math.isinf(want) else math.floor(want + 0.5)
        return min(self.highest, max(self.lowest, n))

    def after_step(self, step: int, noise: MeasuredNoise | None) -> None:
        if noise is None or step % self.every:
            return
        n = self.target(noise.current().get("noise_scale", math.nan))  # collective
        if n is not None and n != self.size:
            self.size = n
            if n not in self.used:
                self.used.append(n)

    def sizes(self, max_epochs: int) -> list[int]:
        return sorted(self.used)

    def largest(self, max_epochs: int) -> int:
        return self.highest

    def state_dict(self) -> dict[str, Any]:
        return {"size": self.size, "used": list(self.used)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.size, self.used = state["size"], list(state["used"])


def build_schedule(cfg: ScheduleConfig, world_size: int, *,
                   units_per_sample: float = 1.0) -> Schedule:
    """The schedule of a config (its micro_batch_size included) on world_size ranks.
    units_per_sample: of the loss's unit (tokens per sequence on token-normalised data)."""
    micro_batch_size = cfg.micro_batch_size
    if isinstance(cfg, ConstantScheduleConfig):
        return ConstantSchedule(cfg.accum_steps)
    if isinstance(cfg, EpochwiseScheduleConfig):
        return EpochwiseSchedule(cfg.accum_steps_by_epoch)
    if isinstance(cfg, AdaptiveScheduleConfig):
        return AdaptiveSchedule(cfg.scale, cfg.initial_accum_steps, cfg.min_accum_steps,
                                cfg.max_accum_steps, cfg.every_steps,
                                world_size * micro_batch_size * units_per_sample)
    # divides exactly, at least once (GlobalBatchScheduleConfig.check)
    return ConstantSchedule(cfg.global_batch_size // (world_size * micro_batch_size))


@dataclass(frozen=True)
class Shard:
    """Which positions of one rank's epoch hold real samples. DistributedSampler(drop_last=False)
    (data.train_loader) pads the epoch's shuffled index list to a multiple of world_size by
    repeating its head, and rank r takes global positions r, r + W, r + 2W, ...: global positions
    >= dataset_size are repeats. Every rank's share has the same length (the same micro-batches,
    so DDP's collectives match), and a rank's repeats are the end of its share: at most one
    sample, on ranks r >= dataset_size mod W, when the data set is not smaller than the world.
    Pure arithmetic, identical on every rank: no communication."""

    dataset_size: int
    rank: int = 0
    world_size: int = 1

    def __len__(self) -> int:
        return -(-self.dataset_size // self.world_size)

    def real(self, start: int, stop: int) -> int:
        """Real samples at this rank's positions [start, stop)."""
        n_real = max(0, -(-(self.dataset_size - self.rank) // self.world_size))
        return max(0, min(stop, n_real) - start)

    def global_real(self, start: int, stop: int) -> int:
        """Real samples at positions [start, stop) of every rank: global [start W, stop W)."""
        w = self.world_size
        return max(0, min(stop * w, self.dataset_size) - start * w)


@dataclass(frozen=True)
class Window:
    """Micro-batches [start, stop) of one rank's epoch. They hold ``local_samples`` positions,
    the same number on every rank; the first ``real`` of them are this rank's real samples, the
    rest repeats the sampler padded with (see Shard); ``global_real`` counts the window's real
    samples over all ranks: what its mean loss is a mean over."""

    start: int
    stop: int
    local_samples: int
    real: int
    global_real: int

    @property
    def size(self) -> int:
        return self.stop - self.start


def micro_batches(shard: Shard, micro_batch_size: int) -> int:
    """Micro-batches in one rank's epoch (the last one may be short)."""
    return -(-len(shard) // micro_batch_size)


def cut_window(shard: Shard, micro_batch_size: int, start: int, accum_steps: int) -> Window:
    """The window of accum_steps micro-batches from micro-batch `start` of one rank's epoch,
    fewer where the epoch ends. The last micro-batch may be short (data not a multiple of the
    micro-batch); both are counted exactly, and the sampler's repeats are told apart from real
    samples, so the loss can be normalised per real sample. The window's micro-batches are the
    same on every rank; only ``real`` differs between ranks. The loop cuts one window at a
    time, so N may change inside an epoch (schedule=adaptive)."""
    local_samples = len(shard)
    stop = min(start + accum_steps, micro_batches(shard, micro_batch_size))
    first, last = start * micro_batch_size, min(stop * micro_batch_size, local_samples)
    return Window(start, stop, last - first, shard.real(first, last),
                  shard.global_real(first, last))


def optimizer_steps_per_epoch(schedule, epoch: int, local_samples: int, micro: int) -> int:
    """Windows per epoch (cut_window's, one after another): the same on every rank, so one
    rank holding local_samples tells."""
    return -(-micro_batches(Shard(local_samples), micro) // schedule.accum_steps(epoch))


def total_optimizer_steps(schedule, max_epochs: int, max_steps: int, local_samples: int,
                          micro: int) -> int:
    """Optimizer steps a fixed schedule takes: the LR scheduler's horizon and the progress
    bar's (an adaptive one's are counted in samples: train/lr_scaling.py horizon)."""
    total = 0
    for e in range(max_epochs):
        total += optimizer_steps_per_epoch(schedule, e, local_samples, micro)
        if 0 <= max_steps <= total:
            return max_steps
    return total
