"""Accumulation schedules (how many micro-batches make one optimizer step, per epoch) and the
window plan of an epoch, including the short windows at its end."""

from __future__ import annotations

import bisect
from dataclasses import dataclass

from gradsync.settings import ConstantScheduleConfig, EpochwiseScheduleConfig, ScheduleConfig


class ConstantSchedule:
    def __init__(self, accum_steps: int):
        self.steps = accum_steps

    def accum_steps(self, epoch: int) -> int:
        return self.steps


class EpochwiseSchedule:
    """{first_epoch: accum_steps}; each entry holds until the next one starts."""

    def __init__(self, accum_steps_by_epoch: dict[int, int]):
        items = sorted((int(e), int(n)) for e, n in accum_steps_by_epoch.items())
        self.starts = [e for e, _ in items]
        self.steps = [n for _, n in items]

    def accum_steps(self, epoch: int) -> int:
        return self.steps[bisect.bisect_right(self.starts, epoch) - 1]


def build_schedule(cfg: ScheduleConfig, world_size: int, micro_batch_size: int):
    if isinstance(cfg, ConstantScheduleConfig):
        return ConstantSchedule(cfg.accum_steps)
    if isinstance(cfg, EpochwiseScheduleConfig):
        return EpochwiseSchedule(cfg.accum_steps_by_epoch)
    per_window, rem = divmod(cfg.global_batch_size, world_size * micro_batch_size)
    assert rem == 0 and per_window >= 1, "validated in config.validate"
    return ConstantSchedule(per_window)


@dataclass(frozen=True)
class Window:
    """Micro-batches [start, stop) of one rank's epoch, and how many samples they hold."""

    start: int
    stop: int
    local_samples: int

    @property
    def size(self) -> int:
        return self.stop - self.start


def plan_epoch(local_samples: int, micro_batch_size: int, accum_steps: int) -> list[Window]:
    """Cut one rank's epoch into windows of accum_steps micro-batches. The last micro-batch may
    be short (data not a multiple of the micro-batch) and the last window may hold fewer
    micro-batches; both are counted exactly so the loss can be normalised per sample."""
    num_batches = -(-local_samples // micro_batch_size)
    windows = []
    for start in range(0, num_batches, accum_steps):
        stop = min(start + accum_steps, num_batches)
        samples = min(stop * micro_batch_size, local_samples) - start * micro_batch_size
        windows.append(Window(start, stop, samples))
    return windows


def optimizer_steps_per_epoch(schedule, epoch: int, local_samples: int, micro: int) -> int:
    return len(plan_epoch(local_samples, micro, schedule.accum_steps(epoch)))


def total_optimizer_steps(schedule, max_epochs: int, max_steps: int, local_samples: int,
                          micro: int) -> int:
    """Optimizer steps the run will take: the LR scheduler's horizon and the progress bar's."""
    total = sum(optimizer_steps_per_epoch(schedule, e, local_samples, micro)
                for e in range(max_epochs))
    return total if max_steps < 0 else min(total, max_steps)
