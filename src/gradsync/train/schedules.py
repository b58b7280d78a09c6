"""Accumulation schedules (how many micro-batches make one optimizer step, per epoch) and the
window plan of an epoch, including the short windows at its end."""

from __future__ import annotations

import bisect
from dataclasses import dataclass

from gradsync.config.schema import ConstantScheduleConfig, EpochwiseScheduleConfig, ScheduleConfig


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


def plan_epoch(shard: Shard, micro_batch_size: int, accum_steps: int) -> list[Window]:
    """Cut one rank's epoch into windows of accum_steps micro-batches. The last micro-batch may
    be short (data not a multiple of the micro-batch) and the last window may hold fewer
    micro-batches; both are counted exactly, and the sampler's repeats are told apart from real
    samples, so the loss can be normalised per real sample. The windows' micro-batches are the
    same on every rank; only ``real`` differs between ranks."""
    local_samples = len(shard)
    num_batches = -(-local_samples // micro_batch_size)
    windows = []
    for start in range(0, num_batches, accum_steps):
        stop = min(start + accum_steps, num_batches)
        first, last = start * micro_batch_size, min(stop * micro_batch_size, local_samples)
        windows.append(Window(start, stop, last - first, shard.real(first, last),
                              shard.global_real(first, last)))
    return windows


def optimizer_steps_per_epoch(schedule, epoch: int, local_samples: int, micro: int) -> int:
    """Windows per epoch: the same on every rank, so one rank holding local_samples tells."""
    return len(plan_epoch(Shard(local_samples), micro, schedule.accum_steps(epoch)))


def total_optimizer_steps(schedule, max_epochs: int, max_steps: int, local_samples: int,
                          micro: int) -> int:
    """Optimizer steps the run will take: the LR scheduler's horizon and the progress bar's."""
    total, per_accum = 0, {}  # an epoch's windows depend on its accum_steps alone
    for e in range(max_epochs):
        accum = schedule.accum_steps(e)
        if accum not in per_accum:
            per_accum[accum] = optimizer_steps_per_epoch(schedule, e, local_samples, micro)
        total += per_accum[accum]
        if 0 <= max_steps <= total:
            return max_steps
    return total
