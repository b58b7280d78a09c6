"""Data sets made or shipped locally (never downloaded), the task they pose (loss, eval metric),
and the seeded DistributedSampler/DataLoader every run uses, world size 1 included."""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, Dataset, DistributedSampler, TensorDataset, default_collate

from gradsync.repro import derive_seed

IGNORE_INDEX = -100  # target of padding positions: no loss, no token count

@dataclass
class DataBundle:
    train: Dataset
    eval: Dataset
    in_dim: int  # features; for token data the vocabulary size
    out_dim: int
    task: str  # "classification" | "regression" | "lm"
    collate: Callable | None = None  # None: default_collate; token data pads per micro-batch
    max_len: int = 0  # token data: the longest input sequence (the model's position table)
    tokens_per_sample: float = 1.0  # token data: mean loss tokens per training sequence


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


class TokenSequences(Dataset):
    """Variable-length 1-D int64 token sequences."""

    def __init__(self, seqs: list[torch.Tensor]):
        self.seqs = seqs

    def __len__(self) -> int:
        return len(self.seqs)

    def __getitem__(self, i: int) -> torch.Tensor:
        return self.seqs[i]


def pad_batch(seqs: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """Next-token pairs, right-padded to the micro-batch's longest sequence: inputs s[:-1]
    (padding 0), targets s[1:] (padding IGNORE_INDEX)."""
    width = max(len(s) for s in seqs) - 1
    x = torch.zeros(len(seqs), width, dtype=torch.long)
    y = torch.full((len(seqs), width), IGNORE_INDEX, dtype=torch.long)
    for i, s in enumerate(seqs):
        x[i, :len(s) - 1] = s[:-1]
        y[i, :len(s) - 1] = s[1:]
    return x, y


def synthetic_lm(cfg: dict[str, Any], seed: int) -> DataBundle:
    """Token sequences from the seed, lengths uniform in [min_len, max_len]: each counts from a
    random start by a random stride in 1..max_stride modulo vocab_size, and each token is
    replaced by a random one with probability noise. Predicting the next token needs the
    stride, read from earlier tokens: a bigram model gets about 1/max_stride of them right."""
    g = torch.Generator().manual_seed(seed)
    n, vocab = cfg["num_samples"] + cfg["eval_samples"], cfg["vocab_size"]
    lengths = torch.randint(cfg["min_len"], cfg["max_len"] + 1, (n,), generator=g)
    starts = torch.randint(0, vocab, (n,), generator=g)
    strides = torch.randint(1, cfg["max_stride"] + 1, (n,), generator=g)
    seqs = []
    for length, start, stride in zip(lengths.tolist(), starts.tolist(), strides.tolist(),
                                     strict=True):
        clean = (start + stride * torch.arange(length)) % vocab
        noisy = torch.rand(length, generator=g) < cfg["noise"]
        seqs.append(torch.where(noisy, torch.randint(0, vocab, (length,), generator=g), clean))
    split = cfg["num_samples"]
    return DataBundle(TokenSequences(seqs[:split]), TokenSequences(seqs[split:]), vocab, vocab,
                      "lm", collate=pad_batch, max_len=cfg["max_len"] - 1,
                      tokens_per_sample=float((lengths[:split] - 1).double().mean()))


DATASETS = {"synthetic": synthetic, "digits": digits, "synthetic_lm": synthetic_lm}


def build_data(cfg: dict[str, Any], seed: int) -> DataBundle:
    return DATASETS[cfg["name"]](cfg, seed)


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
                        pin_memory=pin_memory)  # on CUDA: copies to the GPU need not wait
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


def loss_sum(task: str, out: torch.Tensor, y: torch.Tensor,
             per_sequence: bool = False) -> torch.Tensor:
    """Sum over the micro-batch of per-sample losses (the loop's normaliser decides what it is
    divided by). Token data: the sum of per-token losses over the non-padding targets, or with
    per_sequence the sum of each sequence's mean token loss."""
    if task == "lm":
        tokens = F.cross_entropy(out.float().transpose(1, 2), y, reduction="none",
                                 ignore_index=IGNORE_INDEX)  # [B, T], 0 at padding
        if per_sequence:
            return (tokens.sum(1) / (y != IGNORE_INDEX).sum(1).clamp_min(1)).sum()
        return tokens.sum()
    if task == "classification":
        return F.cross_entropy(out.float(), y, reduction="sum")
    return F.mse_loss(out.float(), y, reduction="sum") / y.shape[1]


def loss_units(task: str, y: torch.Tensor) -> torch.Tensor | int:
    """What a loss is averaged over: non-padding target tokens, or samples."""
    return (y != IGNORE_INDEX).sum() if task == "lm" else y.shape[0]


@torch.no_grad()
def evaluate(model: torch.nn.Module, ds: Dataset, task: str, rank: int, world_size: int,
             device: torch.device, batch_size: int = 512,
             collate: Callable | None = None) -> dict[str, float]:
    """Held-out metrics over the whole eval set, each rank scoring a disjoint shard; loss and
    accuracy are per sample, or per token on token data."""
    was_training = model.training
    model.eval()
    idx = range(rank, len(ds), world_size)  # type: ignore[arg-type]
    totals = torch.zeros(3, dtype=torch.float64, device=device)  # loss sum, correct, units
    for start in range(0, len(idx), batch_size):
        x, y = (collate or default_collate)([ds[i] for i in idx[start:start + batch_size]])
        x, y = x.to(device), y.to(device)
        out = model(x)
        totals[0] += loss_sum(task, out, y).double()
        if task != "regression":  # padding targets (IGNORE_INDEX) never equal an argmax
            totals[1] += (out.argmax(dim=-1) == y).sum()
        totals[2] += loss_units(task, y)
    if world_size > 1:
        torch.distributed.all_reduce(totals)
    model.train(was_training)
    loss, correct, count = totals.tolist()
    metrics = {"loss": loss / count}
    if task != "regression":
        metrics["accuracy"] = correct / count
    if task == "lm":
        metrics["perplexity"] = math.exp(metrics["loss"])
    return metrics
