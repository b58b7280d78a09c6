"""Data sets made or shipped locally (never downloaded), the task they pose (loss, eval metric),
and the seeded DistributedSampler/DataLoader every run uses, world size 1 included."""

from __future__ import annotations

import functools
import itertools
import json
import math
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, Dataset, DistributedSampler, TensorDataset, default_collate

from gradsync.components import (
    CheckContext,
    ConfigError,
    ContractError,
    build,
    checks,
    config_args,
    kind_of,
    require,
    require_fits,
)
from gradsync.core.lifeline import bind_loader_worker
from gradsync.core.seeds import derive_seed, seeded

IGNORE_INDEX = -100  # target of padding positions: no loss, no token count


@dataclass
class DataBundle:
    """The data contract: what a data builder (a ``_target_`` callable, conf/data/) returns.

    ``loss(output, target)`` gives, per sample of a micro-batch, the summed loss and the number
    of units it sums over (1 per sample; the non-padding tokens of a sequence): a *sum plus a
    count*, so the loop can divide every window by its exact global count of samples or tokens,
    across micro-batches and ranks. ``sizes`` is what a model may receive (it gets those that it
    names among its parameters)."""

    train: Dataset
    eval: Dataset
    loss: Callable[[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]
    sizes: dict[str, int]  # in_dim/out_dim (features), vocab_size/max_len (tokens)
    unit: str = "samples"  # what the loss averages over: "samples" or "tokens"
    collate: Callable | None = None  # None: default_collate; token data pads per micro-batch
    # eval metric: how many units of a batch the model got right (accuracy); None: no accuracy
    correct: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None
    tokens_per_sample: float = 1.0  # token data: mean loss tokens per training sequence


class DataBuilder(Protocol):
    """A callable returning a DataBundle; it receives its config's keyword arguments (all but
    ``micro_batch_size``, which the loader uses) and ``seed`` if it names it. Optional
    attributes, set with ``@provides``: the sizes it will put in ``DataBundle.sizes`` and its
    unit, so a config can be checked against the model before any worker starts."""

    def __call__(self, **kwargs: Any) -> DataBundle: ...


def provides(*sizes: str, unit: str = "samples") -> Callable[[Any], Any]:
    def mark(builder: Any) -> Any:
        builder.sizes, builder.unit = sizes, unit
        return builder

    return mark


UNITS = ("samples", "tokens")
# the last data built in this process (build_data): at most one, by its node and seed
_built: dict[str, DataBundle] = {}


def build_data(node: dict[str, Any], seed: int, extra: tuple[str, ...] = ("micro_batch_size",),
               take: bool = False) -> DataBundle:
    """The data a data node builds with the run seed, with the global random streams seeded
    from it (and restored after), so a builder that draws from them builds the same data
    wherever it is built. Built once per process and job: the config check builds and keeps it
    (so do +inspect=params and the sync.groups check, which find it built), and a worker forked
    from the checking process, or the env:// rank that checked, takes it (take=True: it is not
    kept for a later job of the process) instead of building it again."""
    key = json.dumps([node["_target_"], config_args(node, extra), seed], sort_keys=True,
                     default=repr)
    bundle = _built.pop(key, None) if take else _built.get(key)
    if bundle is None:
        with seeded(seed):
            bundle = build(node, {"seed": seed}, extra=extra)
        if not take:
            _built.clear()
            _built[key] = bundle
    return bundle


def forget_built_data() -> None:
    """Drop the data kept by build_data (a launcher whose ranks have their own)."""
    _built.clear()


def check_bundle(bundle: Any, builder: Any, target: str) -> DataBundle:
    """What a data builder returned holds to the contract as far as it can be seen before
    training: a DataBundle, whose sizes are the ones @provides declared and whose unit is
    the declared one. ConfigError naming the builder otherwise."""
    if not isinstance(bundle, DataBundle):
        raise ConfigError(f"data ({target}): returned {kind_of(bundle)}, which is no "
                          "gradsync.data.DataBundle (train, eval, loss, sizes, ...: "
                          "docs/components.md)")
    if not (isinstance(bundle.sizes, dict) and all(isinstance(k, str) for k in bundle.sizes)):
        raise ConfigError(f"data ({target}): its DataBundle's sizes are {bundle.sizes!r}; "
                          "expected a dict of names to sizes (e.g. {'in_dim': 64})")
    for name in ("train", "eval"):
        try:
            n = len(getattr(bundle, name))
        except TypeError:
            raise ConfigError(f"data ({target}): its DataBundle's {name} set has no len(): a "
                              "map-style torch Dataset (the sampler shards it by index)") from None
        if n < 1:
            raise ConfigError(f"data ({target}): its DataBundle's {name} set is empty")
    declared = getattr(builder, "sizes", None)
    lacking = [name for name in declared or () if name not in bundle.sizes]
    if lacking:
        raise ConfigError(f"data ({target}): @provides names {', '.join(lacking)}, which its "
                          f"DataBundle's sizes lack (they are {', '.join(bundle.sizes)})")
    if bundle.unit not in UNITS:
        raise ConfigError(f"data ({target}): its DataBundle's unit is {bundle.unit!r}; "
                          f"expected one of {', '.join(UNITS)}")
    declared_unit = getattr(builder, "unit", bundle.unit)
    if declared_unit != bundle.unit:
        raise ConfigError(f"data ({target}): @provides says unit={declared_unit!r}, its "
                          f"DataBundle says {bundle.unit!r}")
    for name in ("loss", "correct", "collate"):
        value = getattr(bundle, name)
        if not callable(value) and (value is not None or name == "loss"):
            raise ConfigError(f"data ({target}): its DataBundle's {name} is "
                              f"{kind_of(value)}, which is not callable")
    return bundle


def _returned(result: Any) -> str:
    def one(x: Any) -> str:
        return (f"a tensor of shape {list(x.shape)}" if isinstance(x, torch.Tensor)
                else kind_of(x))

    if isinstance(result, (tuple, list)):
        return f"{kind_of(result)} of {len(result)}: " + ", ".join(map(one, result))
    return one(result)


class FirstBatchChecked:
    """A DataBundle's loss, with the loss and ``correct`` contracts checked on the first
    micro-batch that holds a sample (on every rank, once per run; then one flag test per
    call): a loss that returns a mean, or a ``correct`` that returns per-sample values, would
    otherwise train without a word (or fail only at the final evaluation)."""

    def __init__(self, bundle: DataBundle, target: str):
        self.loss, self.correct, self.target = bundle.loss, bundle.correct, target
        self.pending = True

    def __call__(self, out: torch.Tensor, y: torch.Tensor) -> Any:
        result = self.loss(out, y)
        if self.pending and len(y):
            self.pending = False
            self.check(result, out, y)
        return result

    def check(self, result: Any, out: torch.Tensor, y: torch.Tensor) -> None:
        b = len(y)
        if not (isinstance(result, (tuple, list)) and len(result) == 2 and all(
                isinstance(t, torch.Tensor) and tuple(t.shape) == (b,) for t in result)):
            raise ContractError(
                f"data ({self.target}): loss(output, target) returned {_returned(result)}; "
                "expected per-sample loss sums and unit counts, each a tensor of shape "
                f"[{b}] for the micro-batch's {b} kept samples (a sum plus a count, never a "
                "mean: docs/components.md)")
        if self.correct is None:
            return
        with torch.no_grad():
            right = self.correct(out.detach(), y)
        if not (isinstance(right, torch.Tensor) and right.dim() == 0 or isinstance(
                right, (int, float)) and not isinstance(right, bool)):
            raise ContractError(
                f"data ({self.target}): correct(output, target) returned {_returned(right)}; "
                "expected a scalar count of the units predicted right (a 0-dim tensor, e.g. "
                "(output.argmax(-1) == target).sum())")


def mse_per_sample(out: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Each sample's mean squared error over its outputs, and a count of 1 per sample."""
    err = F.mse_loss(out.float(), y, reduction="none").mean(dim=1)
    return err, torch.ones_like(err)


def cross_entropy_per_sample(out: torch.Tensor,
                             y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    err = F.cross_entropy(out.float(), y, reduction="none")
    return err, torch.ones_like(err)


def argmax_correct(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Units whose argmax is the target (padding targets, IGNORE_INDEX, never are)."""
    return (out.argmax(dim=-1) == y).sum()


def _check_synthetic(a: dict[str, Any], ctx: CheckContext) -> None:
    for key in ("num_samples", "eval_samples", "in_dim", "out_dim"):
        require(a[key] >= 1, f"data.{key}", "an integer >= 1", a[key])
    require(0.0 <= a["noise"] < math.inf, "data.noise", "a finite number >= 0", a["noise"])
    n, d, k = a["num_samples"] + a["eval_samples"], a["in_dim"], a["out_dim"]
    require_fits(4 * n * (d + 2 * 64 + 3 * k),  # x, its hidden layer, y and its noise
                 f"data: num_samples={a['num_samples']} + eval_samples={a['eval_samples']} "
                 f"samples of in_dim={d}, out_dim={k}")


@checks(_check_synthetic)
@provides("in_dim", "out_dim")
def synthetic(seed: int, num_samples: int = 2048, eval_samples: int = 512, in_dim: int = 32,
              out_dim: int = 8, noise: float = 0.05) -> DataBundle:
    """Teacher-student regression: a fixed random tanh network plus noise, all from the seed."""
    g = torch.Generator().manual_seed(seed)
    n, d, k = num_samples + eval_samples, in_dim, out_dim
    x = torch.randn(n, d, generator=g)
    w1 = torch.randn(d, 64, generator=g) / d**0.5
    w2 = torch.randn(64, k, generator=g) / 8.0
    y = torch.tanh(x @ w1) @ w2 + noise * torch.randn(n, k, generator=g)
    split = num_samples
    return DataBundle(TensorDataset(x[:split], y[:split]), TensorDataset(x[split:], y[split:]),
                      mse_per_sample, {"in_dim": d, "out_dim": k})


def _check_digits(a: dict[str, Any], ctx: CheckContext) -> None:
    require(0.0 < a["test_fraction"] < 1.0, "data.test_fraction", "a number in (0, 1)",
            a["test_fraction"])
    require(a["split_seed"] >= 0, "data.split_seed", "an integer >= 0 (NumPy's seeds)",
            a["split_seed"])


@checks(_check_digits)
@provides("in_dim", "out_dim")
def digits(test_fraction: float = 0.2, split_seed: int = 0) -> DataBundle:
    """scikit-learn's bundled digits; the held-out split depends on split_seed, not the run
    seed, so runs with different seeds are scored on the same images."""
    x, y = digit_arrays()
    order = np.random.default_rng(split_seed).permutation(len(y))
    n_test = int(round(test_fraction * len(y)))
    xt = torch.tensor(x / 16.0, dtype=torch.float32)
    yt = torch.tensor(y, dtype=torch.long)
    test, train = torch.from_numpy(order[:n_test]), torch.from_numpy(order[n_test:])
    return DataBundle(TensorDataset(xt[train], yt[train]), TensorDataset(xt[test], yt[test]),
                      cross_entropy_per_sample, {"in_dim": 64, "out_dim": 10},
                      correct=argmax_correct)


def digit_arrays() -> tuple[np.ndarray, np.ndarray]:
    """scikit-learn's 1797 8x8 digit images (pixels 0..16, flattened to 64) and labels, read
    from the file it bundles as its load_digits does, without importing scikit-learn (a second
    or more at every worker's start)."""
    table = _digit_table()
    return table[:, :-1].copy(), table[:, -1].astype(int)


@functools.cache
def _digit_table() -> np.ndarray:
    """Read once per process (the config check and forked workers share it; never modified)."""
    import gzip
    import importlib.util

    spec = importlib.util.find_spec("sklearn")
    if spec is None or not spec.submodule_search_locations:
        raise ModuleNotFoundError("data=digits needs scikit-learn, which ships the images")
    path = Path(next(iter(spec.submodule_search_locations))) / "datasets" / "data" / \
        "digits.csv.gz"
    with gzip.open(path) as f:
        return np.loadtxt(f, delimiter=",")


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


def token_loss_per_sample(out: torch.Tensor,
                          y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Each sequence's summed next-token loss over its non-padding targets, and their count."""
    tokens = F.cross_entropy(out.float().transpose(1, 2), y, reduction="none",
                             ignore_index=IGNORE_INDEX)  # [B, T], 0 at padding
    return tokens.sum(1), (y != IGNORE_INDEX).sum(1)


def _check_synthetic_lm(a: dict[str, Any], ctx: CheckContext) -> None:
    for key in ("num_samples", "eval_samples"):
        require(a[key] >= 1, f"data.{key}", "an integer >= 1", a[key])
    require(a["vocab_size"] >= 2, "data.vocab_size", "an integer >= 2", a["vocab_size"])
    require(a["min_len"] >= 2, "data.min_len",
            "an integer >= 2 (a sequence needs one input and one target)", a["min_len"])
    require(a["max_len"] >= a["min_len"], "data.max_len",
            f"an integer >= data.min_len={a['min_len']}", a["max_len"])
    require(1 <= a["max_stride"] < a["vocab_size"], "data.max_stride",
            f"an integer in [1, data.vocab_size={a['vocab_size']})", a["max_stride"])
    require(0.0 <= a["noise"] <= 1.0, "data.noise", "a number in [0, 1]", a["noise"])
    # each sequence: its int64 tokens (and as much again while it is made) and a tensor object
    mean_len = (a["min_len"] + a["max_len"]) / 2
    require_fits((a["num_samples"] + a["eval_samples"]) * (16 * mean_len + 400),
                 f"data: num_samples={a['num_samples']} + eval_samples={a['eval_samples']} "
                 f"sequences of min_len={a['min_len']} to max_len={a['max_len']} tokens")


@checks(_check_synthetic_lm)
@provides("vocab_size", "max_len", unit="tokens")
def synthetic_lm(seed: int, num_samples: int = 2048, eval_samples: int = 256,
                 vocab_size: int = 32, min_len: int = 4, max_len: int = 64, max_stride: int = 4,
                 noise: float = 0.05) -> DataBundle:
    """Token sequences from the seed, lengths uniform in [min_len, max_len]: each counts from a
    random start by a random stride in 1..max_stride modulo vocab_size, and each token is
    replaced by a random one with probability noise. Predicting the next token needs the
    stride, read from earlier tokens: a bigram model gets about 1/max_stride of them right."""
    g = torch.Generator().manual_seed(seed)
    n, vocab = num_samples + eval_samples, vocab_size
    lengths = torch.randint(min_len, max_len + 1, (n,), generator=g)
    starts = torch.randint(0, vocab, (n,), generator=g)
    strides = torch.randint(1, max_stride + 1, (n,), generator=g)
    seqs = []
    for length, start, stride in zip(lengths.tolist(), starts.tolist(), strides.tolist(),
                                     strict=True):
        clean = (start + stride * torch.arange(length)) % vocab
        noisy = torch.rand(length, generator=g) < noise
        seqs.append(torch.where(noisy, torch.randint(0, vocab, (length,), generator=g), clean))
    return token_bundle(seqs[:num_samples], seqs[num_samples:], vocab, max_len)


def token_bundle(train: list[torch.Tensor], held_out: list[torch.Tensor], vocab_size: int,
                 max_len: int) -> DataBundle:
    """Next-token prediction on variable-length sequences (at most max_len tokens each)."""
    lengths = torch.tensor([len(s) for s in train], dtype=torch.float64)
    return DataBundle(TokenSequences(train), TokenSequences(held_out), token_loss_per_sample,
                      {"vocab_size": vocab_size, "max_len": max_len - 1}, unit="tokens",
                      collate=pad_batch, correct=argmax_correct,
                      tokens_per_sample=float((lengths - 1).mean()))


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


@torch.no_grad()
def evaluate(model: torch.nn.Module, data: DataBundle, rank: int, world_size: int,
             device: torch.device, batch_size: int = 512) -> dict[str, float]:
    """Held-out metrics over the whole eval set, each rank scoring a disjoint shard: the loss
    per unit (sample or token), accuracy when the data has a ``correct`` metric, perplexity on
    token data. Every rank runs the same number of forwards (a sharded model's forward is
    collective): a rank whose shard ran out scores its first sample again and counts nothing."""
    was_training = model.training
    model.eval()
    ds = data.eval
    idx = range(rank, len(ds), world_size)  # type: ignore[arg-type]
    totals = torch.zeros(3, dtype=torch.float64, device=device)  # loss sum, correct, units
    largest = -(-len(ds) // world_size)  # type: ignore[arg-type]
    for start in range(0, largest, batch_size):
        part = idx[start:start + batch_size]
        x, y = (data.collate or default_collate)([ds[i] for i in part or idx[:1] or [0]])
        x, y = x.to(device), y.to(device)
        out = model(x)
        if not part:
            continue
        sums, counts = data.loss(out, y)
        totals[0] += sums.double().sum()
        if data.correct is not None:
            totals[1] += data.correct(out, y)
        totals[2] += counts.sum()
    if world_size > 1:
        torch.distributed.all_reduce(totals)
    model.train(was_training)
    loss, correct, count = totals.tolist()
    metrics = {"loss": loss / count}
    if data.correct is not None:
        metrics["accuracy"] = correct / count
    if data.unit == "tokens":
        metrics["perplexity"] = math.exp(metrics["loss"])
    return metrics
