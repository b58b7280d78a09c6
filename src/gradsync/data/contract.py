"""The data contract: what a data component (a ``_target_`` callable, conf/data/) returns
(``DataBundle``), the checks that hold a bundle to it (before training: ``check_bundle``; on
the first micro-batch: ``FirstBatchChecked``), the per-sample losses and metric the built-in
data sets share, and ``build_data``, which builds a data node with the run seed."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import torch
import torch.nn.functional as F
from torch.utils.data import Dataset

from gradsync.components import ConfigError, ContractError, build, kind_of
from gradsync.core.seeds import seeded


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
    # token data: every training sequence holds exactly tokens_per_sample loss tokens (windows
    # of packed text), so a window's token count is known without counting (train/normalize.py)
    uniform_length: bool = False


class DataBuilder(Protocol):
    """A callable returning a DataBundle; it receives its config's keyword arguments and
    ``seed`` if it names it. Optional
    attributes, set with ``@provides``: the sizes it will put in ``DataBundle.sizes`` and its
    unit, so a config can be checked against the model before any worker starts."""

    def __call__(self, **kwargs: Any) -> DataBundle: ...


def provides(*sizes: str, unit: str = "samples") -> Callable[[Any], Any]:
    def mark(builder: Any) -> Any:
        builder.sizes, builder.unit = sizes, unit
        return builder

    return mark


UNITS = ("samples", "tokens")


def build_data(node: dict[str, Any], seed: int) -> DataBundle:
    """The data a data node builds with the run seed, with the global random streams seeded
    from it (and restored after), so a builder that draws from them builds the same data
    wherever it is built (the run's preflight, each rank, +inspect)."""
    with seeded(seed):
        return build(node, {"seed": seed})


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


