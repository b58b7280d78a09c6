"""User-style components the tests name as `_target_`s (importable from the tests directory)."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from gradsync.components import CheckContext, checks


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


class CorruptRank1After:
    """accumulate, except that rank 1 nudges one parameter after window `window`: a replica
    gone wrong, for trainer.check_replicas to catch."""

    def __init__(self, window: int = 3):
        self.window = window

    def should_sync(self, micro_index: int, window_size: int) -> bool:
        return micro_index == window_size - 1

    def after_window(self, model: nn.Module, windows_done: int) -> None:
        if windows_done == self.window and torch.distributed.get_rank() == 1:
            with torch.no_grad():
                next(iter(model.parameters()))[0].add_(1e-3)


def data_that_fails(seed: int, num_samples: int = 2048, eval_samples: int = 512,
                    in_dim: int = 32, out_dim: int = 8, noise: float = 0.05):
    """data=synthetic's keys, but building it fails in every worker (after the config was
    checked)."""
    raise ValueError("the data cannot be loaded (a test aid)")
