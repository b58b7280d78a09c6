"""The seeded DistributedSampler/DataLoader every run uses, world size 1 included, and one
epoch's micro-batches from it (a resumed run starts part-way)."""

from __future__ import annotations

import functools
import itertools
import os
from collections.abc import Callable, Iterator

import torch
from torch.utils.data import DataLoader, Dataset, DistributedSampler

from gradsync.core.lifeline import bind_loader_worker
from gradsync.core.seeds import derive_seed


class EpochSampler(DistributedSampler):
    """A DistributedSampler that can start an epoch part-way: a resumed run skips the indices
    its checkpoint already consumed without loading them, and the order stays the epoch's
    order. ``len()`` stays the whole epoch's share (the window plan is cut from it)."""

    skip = 0  # indices of this epoch to leave out at the start

    def __iter__(self) -> Iterator:
        return itertools.islice(super().__iter__(), self.skip, None)


def train_loader(ds: Dataset, micro_batch_size: int, rank: int, world_size: int, seed: int,
                 collate: Callable | None = None,
                 num_workers: int = 0, pin_memory: bool = False) -> tuple[DataLoader, EpochSampler]:
    """Seeded shuffling identical for every world size: a single process sees the same global
    batches that W processes see as W x N micro-batches. The loader draws its workers' seeds
    from its own generator (see epoch_batches), never from the global torch stream."""
    sampler = EpochSampler(ds, num_replicas=world_size, rank=rank, shuffle=True, seed=seed,
                           drop_last=False)
    loader = DataLoader(ds, batch_size=micro_batch_size, sampler=sampler, collate_fn=collate,
                        num_workers=num_workers, generator=torch.Generator(),
                        pin_memory=pin_memory,  # on CUDA: copies to the GPU need not wait
                        # a worker dies with this rank, as the rank with its launcher
                        worker_init_fn=functools.partial(bind_loader_worker, os.getpid())
                        if num_workers else None)
    return loader, sampler


def epoch_batches(loader: DataLoader, epoch: int, skip_samples: int = 0) -> Iterator:
    """The micro-batches of one epoch, the first skip_samples of this rank's share left out
    (a multiple of the micro-batch, so the batches keep their boundaries). DataLoader workers
    are seeded from (seed, rank, epoch): torch seeds each worker's Python, NumPy and torch
    from the loader generator's draw plus the worker id."""
    sampler = loader.sampler
    assert isinstance(sampler, EpochSampler) and loader.generator is not None
    sampler.set_epoch(epoch)
    sampler.skip = skip_samples
    loader.generator.manual_seed(derive_seed(sampler.seed, sampler.rank, epoch))
    return iter(loader)


def loader(dataset: Dataset, micro_batch_size: int, seed: int = 0,
           collate: Callable | None = None, num_workers: int = 0) -> DataLoader:
    """gradsync's loader of this rank's share (train_loader's), in a process group already
    initialised (torchrun's): what `windows` cuts exact windows from (docs/own-loop.md)."""
    import torch.distributed as dist

    up = dist.is_available() and dist.is_initialized()
    return train_loader(dataset, micro_batch_size, dist.get_rank() if up else 0,
                        dist.get_world_size() if up else 1, seed, collate, num_workers)[0]
