"""Data sets made or shipped locally (never downloaded), the task they pose (loss, eval metric),
and the seeded DistributedSampler/DataLoader every run uses, world size 1 included."""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from gradsync.repro import derive_seed


@dataclass
class DataBundle:
    train: TensorDataset
    eval: TensorDataset
    in_dim: int
    out_dim: int
    task: str  # "classification" | "regression"


def synthetic(cfg: dict[str, Any], seed: int) -> DataBundle:
    """Teacher-student regression: a fixed random tanh network plus noise, all from the seed."""
    g = torch.Generator().manual_seed(seed)
    n, d, k = cfg["num_samples"] + cfg["eval_samples"], cfg["in_dim"], cfg["out_dim"]
    x = torch.randn(n, d, generator=g)
    w1 = torch.randn(d, 64, generator=g) / d**0.5
    w2 = torch.randn(64, k, generator=g) / 8.0
    y = torch.tanh(x @ w1) @ w2 + cfg["noise"] * torch.randn(n, k, generator=g)
    split = cfg["num_samples"]
    return DataBundle(TensorDataset(x[:split], y[:split]), TensorDataset(x[split:], y[split:]),
                      d, k, "regression")


def digits(cfg: dict[str, Any], seed: int) -> DataBundle:
    """scikit-learn's bundled digits; the held-out split depends on split_seed, not the run
    seed, so runs with different seeds are scored on the same images."""
    from sklearn.datasets import load_digits  # heavy import, only where used

    x, y = load_digits(return_X_y=True)
    order = np.random.default_rng(cfg["split_seed"]).permutation(len(y))
    n_test = int(round(cfg["test_fraction"] * len(y)))
    xt = torch.tensor(x / 16.0, dtype=torch.float32)
    yt = torch.tensor(y, dtype=torch.long)
    test, train = torch.from_numpy(order[:n_test]), torch.from_numpy(order[n_test:])
    return DataBundle(TensorDataset(xt[train], yt[train]), TensorDataset(xt[test], yt[test]),
                      64, 10, "classification")


DATASETS = {"synthetic": synthetic, "digits": digits}


def build_data(cfg: dict[str, Any], seed: int) -> DataBundle:
    return DATASETS[cfg["name"]](cfg, seed)


class EpochSampler(DistributedSampler):
    """A DistributedSampler that can start an epoch part-way: a resumed run skips the indices
    its checkpoint already consumed without loading them, and the order stays the epoch's
    order. ``len()`` stays the whole epoch's share (the window plan is cut from it)."""

    skip = 0  # indices of this epoch to leave out at the start

    def __iter__(self) -> Iterator:
        return itertools.islice(super().__iter__(), self.skip, None)


def train_loader(ds: TensorDataset, micro_batch_size: int, rank: int, world_size: int,
                 seed: int, num_workers: int = 0) -> tuple[DataLoader, EpochSampler]:
    """Seeded shuffling identical for every world size: a single process sees the same global
    batches that W processes see as W x N micro-batches. The loader draws its workers' seeds
    from its own generator (see epoch_batches), never from the global torch stream."""
    sampler = EpochSampler(ds, num_replicas=world_size, rank=rank, shuffle=True, seed=seed,
                           drop_last=False)
    loader = DataLoader(ds, batch_size=micro_batch_size, sampler=sampler,
                        num_workers=num_workers, generator=torch.Generator())
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


def loss_sum(task: str, out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Sum over the micro-batch of per-sample losses (the loop divides by the window count)."""
    if task == "classification":
        return F.cross_entropy(out.float(), y, reduction="sum")
    return F.mse_loss(out.float(), y, reduction="sum") / y.shape[1]


@torch.no_grad()
def evaluate(model: torch.nn.Module, ds: TensorDataset, task: str, rank: int, world_size: int,
             device: torch.device, batch_size: int = 512) -> dict[str, float]:
    """Held-out metrics over the whole eval set, each rank scoring a disjoint shard."""
    was_training = model.training
    model.eval()
    x_all, y_all = ds.tensors
    idx = torch.arange(rank, len(ds), world_size)
    totals = torch.zeros(3, dtype=torch.float64, device=device)  # loss sum, correct, count
    for start in range(0, len(idx), batch_size):
        sel = idx[start:start + batch_size]
        x, y = x_all[sel].to(device), y_all[sel].to(device)
        out = model(x)
        totals[0] += loss_sum(task, out, y).double()
        if task == "classification":
            totals[1] += (out.argmax(dim=1) == y).sum()
        totals[2] += len(sel)
    if world_size > 1:
        torch.distributed.all_reduce(totals)
    model.train(was_training)
    loss, correct, count = totals.tolist()
    metrics = {"loss": loss / count}
    if task == "classification":
        metrics["accuracy"] = correct / count
    return metrics
