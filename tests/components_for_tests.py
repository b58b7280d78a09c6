"""User-style components the tests name as `_target_`s (importable from the tests directory)."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from gradsync.components import CheckContext, checks
from gradsync.data import provides
from gradsync.sync.averaging import Averager
from gradsync.sync.comm import Wire


def _divide_by_zero(args: dict[str, Any], ctx: CheckContext) -> None:
    1 / 0  # noqa: B018  a component's own check that fails with something else than ConfigError


@checks(_divide_by_zero)
def data_whose_check_fails(test_fraction: float = 0.2, split_seed: int = 0):
    """The digits' keys; its own check raises ZeroDivisionError."""
    raise AssertionError("never built: the check refuses it first")


class NeverSync:
    """The widely copied mistake: every backward inside no_sync(), nothing averaged."""

    def should_sync(self, micro_index: int, window_size: int) -> bool:
        return False


class SyncLast:
    """A policy of one's own with nothing but should_sync: accumulate's decisions."""

    def should_sync(self, micro_index: int, window_size: int) -> bool:
        return micro_index == window_size - 1


class WireIsADtype:
    """A policy whose `wire` is a dtype's name, not a Wire: refused before any worker starts."""

    wire = "bf16"

    def should_sync(self, micro_index: int, window_size: int) -> bool:
        return True


class CorruptRank1After:
    """accumulate, except that rank 1 nudges one parameter after window `window` (its
    averager, the role the loop calls after each window): a replica gone wrong, which the
    averager says is in sync, for trainer.check_replicas to catch."""

    def __init__(self, window: int = 3):
        self.averager = Rank1Nudge(window)

    def should_sync(self, micro_index: int, window_size: int) -> bool:
        return micro_index == window_size - 1


class Rank1Nudge(Averager):
    def __init__(self, window: int):
        self.window = window

    def after_window(self, model: nn.Module, windows_done: int) -> None:
        if windows_done == self.window and torch.distributed.get_rank() == 1:
            with torch.no_grad():
                next(iter(model.parameters()))[0].add_(1e-3)


class Unreadable(torch.utils.data.Dataset):
    def __len__(self) -> int:
        return 64

    def __getitem__(self, i: int):
        raise ValueError("the data cannot be loaded (a test aid)")


def data_that_fails(seed: int, num_samples: int = 2048, eval_samples: int = 512,
                    in_dim: int = 32, out_dim: int = 8, noise: float = 0.05):
    """data=synthetic's keys, but its samples cannot be read: builds (the config check passes),
    then fails in every worker on its first micro-batch."""
    from gradsync.data import synthetic

    return replace(synthetic(seed, 64, 16, in_dim, out_dim, noise), train=Unreadable())


# --- contract breaks (issue 21): each must be refused before any worker starts, or on the
# first micro-batch, in one line naming the component ----------------------------------------

def not_a_model(in_dim: int, out_dim: int):
    """A model builder returning layers in a list instead of an nn.Module."""
    return [nn.Linear(in_dim, out_dim)]


class ImageModel(nn.Module):
    """A model that needs sizes of its own naming (digits gives in_dim, out_dim)."""

    def __init__(self, image_size: int, num_classes: int):
        super().__init__()
        self.head = nn.Linear(image_size * image_size, num_classes)


def not_data(test_fraction: float = 0.2, split_seed: int = 0):
    """A data builder returning a dict of its parts instead of a DataBundle."""
    from gradsync.data import digits

    return vars(digits(test_fraction, split_seed))


@provides("in_dim", "out_dim", "n_classes")
def digits_lacking_a_size(test_fraction: float = 0.2, split_seed: int = 0):
    """@provides names n_classes; the bundle has in_dim and out_dim only."""
    from gradsync.data import digits

    return digits(test_fraction, split_seed)


def mean_loss(out: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The micro-batch's mean, not per-sample sums and counts: it trains, wrongly."""
    return F.cross_entropy(out, y), torch.tensor(len(y))


def per_sample_correct(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """1 per sample predicted right, not their count."""
    return (out.argmax(dim=-1) == y).long()


def digits_with_mean_loss(test_fraction: float = 0.2, split_seed: int = 0):
    from gradsync.data import digits

    return replace(digits(test_fraction, split_seed), loss=mean_loss)


def digits_with_per_sample_correct(test_fraction: float = 0.2, split_seed: int = 0):
    from gradsync.data import digits

    return replace(digits(test_fraction, split_seed), correct=per_sample_correct)


def list_optimizer(params, lr: float = 0.1):
    """An optimizer factory returning a list."""
    return [torch.optim.SGD(params, lr=lr)]


def no_scheduler(optimizer):
    """An LR scheduler factory that forgot its return."""
    torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)


class Periodic:
    """Written to the earlier contract: averaging on the policy itself, which gradsync no
    longer calls there (the averager role's now)."""

    def should_sync(self, micro_index: int, window_size: int) -> bool:
        return micro_index == window_size - 1

    def after_window(self, model, windows_done: int) -> None:
        raise AssertionError("never called: the policy is refused before any worker starts")


class NoShouldSync:
    """A policy whose one method is misspelt."""

    def should_synch(self, micro_index: int, window_size: int) -> bool:
        return True


class ShouldSyncOfOneArgument:
    def should_sync(self, micro_index: int) -> bool:
        return True


class SyncFirstOnly:
    """Synchronises a window's first micro-batch, not its last: the later gradients stay
    local."""

    def should_sync(self, micro_index: int, window_size: int) -> bool:
        return micro_index == 0


def digits_without_eval(test_fraction: float = 0.2, split_seed: int = 0):
    """No held-out samples: the final evaluation would divide by zero."""
    from gradsync.data import digits
    from gradsync.data.tokens import TokenSequences

    return replace(digits(test_fraction, split_seed), eval=TokenSequences([]))


def data_from_the_global_stream(seed: int, num_samples: int = 8):
    """Draws from torch's global stream (not a generator of its own)."""
    from gradsync.data import DataBundle, mse_per_sample

    x, y = torch.randn(num_samples, 2), torch.randn(num_samples, 1)
    ds = torch.utils.data.TensorDataset(x, y)
    return DataBundle(ds, ds, mse_per_sample, {"in_dim": 2, "out_dim": 1})


class LastLayerAtWindowEnd:
    """`always`, except the gradient buckets holding a parameter that matches `params`: they
    stay local and accumulate until the window's last micro-batch (per-bucket decisions:
    engine=gradsync only)."""

    def __init__(self, params: str = "4.*"):
        self.params = params
        self.last = False
        self.wire = LastLayerWire(self)

    def should_sync(self, micro_index: int, window_size: int) -> bool:
        self.last = micro_index == window_size - 1
        return True


class LastLayerWire(Wire):
    """LastLayerAtWindowEnd's wire: its per-bucket decisions."""

    def __init__(self, policy: LastLayerAtWindowEnd):
        self.policy = policy

    def sync_bucket(self, params: list[str]) -> bool:
        from fnmatch import fnmatchcase

        return self.policy.last or not any(fnmatchcase(p, self.policy.params) for p in params)


class NotAnException(BaseException):
    """What torch's CheckpointException is: a BaseException that `except Exception` misses."""


class RaisesBaseException:
    """accumulate, until rank 1 raises NotAnException after window 2 (in its averager, which
    the loop calls after each window)."""

    def __init__(self) -> None:
        self.averager = RaisesAfterWindow2()

    def should_sync(self, micro_index: int, window_size: int) -> bool:
        return micro_index == window_size - 1


class RaisesAfterWindow2(Averager):
    def after_window(self, model: nn.Module, windows_done: int) -> None:
        if windows_done == 2 and torch.distributed.get_rank() == 1:
            raise NotAnException("raised on rank 1 after window 2")


# --- the models people train (issue 30): BatchNorm, a branch some micro-batches skip ----------

class BatchNormMLP(nn.Module):
    """Linear, BatchNorm1d, ReLU, Linear: running statistics each rank updates from its own
    micro-batches (data=synthetic gives in_dim, out_dim)."""

    def __init__(self, in_dim: int, out_dim: int, hidden: int = 16):
        super().__init__()
        self.inp = nn.Linear(in_dim, hidden)
        self.norm = nn.BatchNorm1d(hidden)
        self.out = nn.Linear(hidden, out_dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(torch.relu(self.norm(self.inp(x))))


class SometimesUnusedBranch(nn.Module):
    """An MLP with an auxiliary branch that the training forward skips on every `every`-th
    call (the 2nd, 4th... by default), so that the synchronising backward of such a call leaves
    aux's parameters without a gradient. by_rank: rank r skips every (every + r)-th call (the
    ranks skip it on different calls: on the 2nd, rank 0 alone)."""

    def __init__(self, in_dim: int, out_dim: int, hidden: int = 16, every: int = 2,
                 by_rank: bool = False):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(in_dim, hidden), nn.Tanh(), nn.Linear(hidden, out_dim))
        self.aux = nn.Linear(in_dim, out_dim)
        self.every, self.by_rank = every, by_rank
        self.calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.body(x)
        if self.training:
            self.calls += 1
            every = self.every + (torch.distributed.get_rank() if self.by_rank else 0)
            if self.calls % every:
                out = out + self.aux(x)
        return out
