"""Windows: the micro-batches of one optimizer step, cut exactly from an epoch of gradsync's
loader (data/loader.py train_loader), a short last window and the sampler's repeats included.

    for window in windows(loader, epoch, window_size=4):
        for micro in window:                    # MicroBatch: index, x, y (real samples' targets)
            with engine.micro_batch(window.should_sync(policy, micro)):
                sums, counts = loss(micro.real(engine(micro.x)), micro.y)
                normalizer.micro_loss(window, micro.index, sums, counts).backward()
        optimizer_step(...)

An epoch's windows are the same on every rank (DDP's collectives must match); only how many
of a window's samples are a rank's real ones differs (Shard). Windows are cut one at a time
from where the epoch stands, so the window size may change inside an epoch (the adaptive
schedule follows the noise scale). gradsync's own loop (train/loop.py) runs on exactly these.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils.data import DataLoader

from gradsync.data.loader import EpochSampler, epoch_batches
from gradsync.sync.averaging import whole_model
from gradsync.sync.policy import SyncPolicy, last_micro_batch


class UnsyncedWindow(RuntimeError):
    """A window reached its optimizer step without a synchronising backward: every rank would
    step on its own gradients and the replicas would drift apart silently."""


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
class MicroBatch:
    """Micro-batch `index` of its window: `x`, every sample of it (each runs forward and
    backward: the ranks' collectives must match), its `targets` (every sample's: a model may
    take them, nanoGPT's forward(idx, targets)), of which the first `keep` are the real samples'
    (the sampler's repeats hold no loss)."""

    index: int
    x: Any
    targets: Any
    keep: int

    @property
    def y(self) -> Any:
        """The real samples' targets."""
        return self.targets if self.keep == len(self.targets) else self.targets[:self.keep]

    def real(self, out: Any) -> Any:
        """The model's outputs of the real samples (the first `keep` of the micro-batch)."""
        return out if len(out) == self.keep else out[:self.keep]


@dataclass(frozen=True)
class Window:
    """Micro-batches [start, stop) of one rank's epoch. They hold ``local_samples`` positions,
    the same number on every rank; the first ``real`` of them are this rank's real samples, the
    rest repeats the sampler padded with (see Shard); ``global_real`` counts the window's real
    samples over all ranks: what its mean loss is a mean over. Iterating a window cut by
    `windows` draws its micro-batches from the epoch's loader, on `device`."""

    start: int
    stop: int
    local_samples: int
    real: int
    global_real: int
    ends_epoch: bool = False  # the epoch's last window (windows() knows it)
    batches: Iterator[Any] | None = field(default=None, repr=False, compare=False)
    device: torch.device | None = field(default=None, repr=False, compare=False)
    synced: list[int] = field(default_factory=list, repr=False, compare=False)  # should_sync's

    @property
    def size(self) -> int:
        return self.stop - self.start

    def __iter__(self) -> Iterator[MicroBatch]:
        assert self.batches is not None, "a window cut by windows() holds its micro-batches"
        real_left = self.real
        for index in range(self.size):
            x, y = next(self.batches)
            keep = min(real_left, len(y))
            real_left -= keep
            if self.device is not None:
                x = x.to(self.device, non_blocking=True)
                y = y.to(self.device, non_blocking=True)
            yield MicroBatch(index, x, y, keep)

    def should_sync(self, policy: SyncPolicy, micro: MicroBatch) -> bool:
        """The policy's decision for this micro-batch; UnsyncedWindow where it would end the
        window inside no_sync() with nothing that keeps the replicas consistent (no averager of
        the whole model): every rank would step on gradients of its own."""
        sync = policy.should_sync(micro.index, self.size)
        if sync:
            self.synced.append(micro.index)
        elif last_micro_batch(micro.index, self.size) and not whole_model(policy.averager):
            raise UnsyncedWindow(self.unsynced(policy.name))
        return sync

    def unsynced(self, policy: str) -> str:
        """What goes wrong when the window's last micro-batch runs inside no_sync()."""
        last_synced = self.synced[-1] if self.synced else -1
        first_local = self.start + last_synced + 1  # the first micro-batch kept local since
        what = ("no micro-batch of the window synchronised: no gradient was all-reduced"
                if last_synced < 0 else
                f"micro-batch {first_local - 1} synchronised, but "
                + ("the last" if first_local == self.stop - 1 else
                   f"micro-batches {first_local}-{self.stop - 1} (the last included)")
                + " did not: the gradients accumulated after it were never all-reduced")
        return (f"sync policy {policy!r} ends a window of {self.size} micro-batches "
                f"(micro-batches {self.start}-{self.stop - 1} of the epoch) inside no_sync(): "
                f"{what}, so every rank would step on gradients of its own and the replicas "
                "drift apart (docs/debugging.md). The last micro-batch of a window must "
                "synchronise (the all-reduce of the accumulated gradients is what keeps the "
                "replicas equal), or the policy's averager must keep the whole model consistent "
                "itself (whole_model = True: it averages the parameters)")


def micro_batches(shard: Shard, micro_batch_size: int) -> int:
    """Micro-batches in one rank's epoch (the last one may be short)."""
    return -(-len(shard) // micro_batch_size)


def cut_window(shard: Shard, micro_batch_size: int, start: int, window_size: int) -> Window:
    """The window of window_size micro-batches from micro-batch `start` of one rank's epoch,
    fewer where the epoch ends. The last micro-batch may be short (data not a multiple of the
    micro-batch); both are counted exactly, and the sampler's repeats are told apart from real
    samples, so the loss can be normalised per real sample. The window's micro-batches are the
    same on every rank; only ``real`` differs between ranks."""
    local_samples = len(shard)
    stop = min(start + window_size, micro_batches(shard, micro_batch_size))
    first, last = start * micro_batch_size, min(stop * micro_batch_size, local_samples)
    return Window(start, stop, last - first, shard.real(first, last),
                  shard.global_real(first, last))


def shard_of(loader: DataLoader) -> Shard:
    """This rank's share of the epochs of gradsync's loader (its EpochSampler's)."""
    sampler = loader.sampler
    assert isinstance(sampler, EpochSampler), "windows() cuts the epochs of train_loader()"
    return Shard(len(sampler.dataset), sampler.rank, sampler.num_replicas)  # type: ignore[arg-type]


def windows(loader: DataLoader, epoch: int, window_size: int | Callable[[], int],
            start: int = 0, device: torch.device | None = None) -> Iterator[Window]:
    """The windows of one epoch of gradsync's loader (data/loader.py train_loader), from
    micro-batch `start` (a resumed epoch: the samples before it are not loaded), each of
    `window_size` micro-batches (a callable: asked before each window is cut) but the epoch's
    last, which holds what is left. Iterate each window fully before the next (they share the
    loader)."""
    shard, micro = shard_of(loader), loader.batch_size or 1
    end = micro_batches(shard, micro)
    batches = epoch_batches(loader, epoch, start * micro)
    while start < end:
        size = window_size() if callable(window_size) else window_size
        window = cut_window(shard, micro, start, size)
        yield Window(window.start, window.stop, window.local_samples, window.real,
                     window.global_real, window.stop == end, batches, device)
        start = window.stop
