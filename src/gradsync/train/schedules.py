"""Accumulation schedules: how many micro-batches make the next window (per epoch, or
following the measured noise scale), and how many optimizer steps a run takes (the windows
themselves are cut by train/windows.py)."""

from __future__ import annotations

import bisect
import math
from typing import Any, Protocol

from gradsync.config.schema import (
    AdaptiveScheduleConfig,
    ConstantScheduleConfig,
    EpochwiseScheduleConfig,
    ScheduleConfig,
)
from gradsync.train.windows import Shard, micro_batches


class MeasuredNoise(Protocol):
    """The measured noise scale as a schedule reads it (train/noise_scale.py NoiseScale)."""

    def current(self) -> dict[str, float]:
        """Collective: the newest estimates (``noise_scale``: B_simple)."""
        ...


class Schedule(Protocol):
    def window_size(self, epoch: int) -> int:
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
    def __init__(self, window_size: int):
        self.size = window_size

    def window_size(self, epoch: int) -> int:
        return self.size

    def after_step(self, step: int, noise: MeasuredNoise | None) -> None:
        pass

    def sizes(self, max_epochs: int) -> list[int]:
        return [self.size]

    def largest(self, max_epochs: int) -> int:
        return self.size


class EpochwiseSchedule:
    """{first_epoch: window_size}; each entry holds until the next one starts."""

    def __init__(self, window_size_by_epoch: dict[int, int]):
        items = sorted((int(e), int(n)) for e, n in window_size_by_epoch.items())
        self.starts = [e for e, _ in items]
        self.by_start = [n for _, n in items]

    def window_size(self, epoch: int) -> int:
        return self.by_start[bisect.bisect_right(self.starts, epoch) - 1]

    def after_step(self, step: int, noise: MeasuredNoise | None) -> None:
        pass

    def sizes(self, max_epochs: int) -> list[int]:
        return sorted({self.window_size(e) for e in range(max_epochs)})

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

    def window_size(self, epoch: int) -> int:
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
        return ConstantSchedule(cfg.window_size)
    if isinstance(cfg, EpochwiseScheduleConfig):
        return EpochwiseSchedule(cfg.window_size_by_epoch)
    if isinstance(cfg, AdaptiveScheduleConfig):
        return AdaptiveSchedule(cfg.scale, cfg.initial_window_size, cfg.min_window_size,
                                cfg.max_window_size, cfg.every_steps,
                                world_size * micro_batch_size * units_per_sample)
    # divides exactly, at least once (GlobalBatchScheduleConfig.check)
    return ConstantSchedule(cfg.global_batch_size // (world_size * micro_batch_size))


def optimizer_steps_per_epoch(schedule, epoch: int, local_samples: int, micro: int) -> int:
    """Windows per epoch (cut_window's, one after another): the same on every rank, so one
    rank holding local_samples tells."""
    return -(-micro_batches(Shard(local_samples), micro) // schedule.window_size(epoch))


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
