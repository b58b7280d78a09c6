"""Sync policies: asked for every micro-batch whether its forward+backward synchronises gradients
(all-reduce) or runs inside ``ddp.no_sync()`` so they accumulate locally."""

from __future__ import annotations

from contextlib import nullcontext
from typing import Any, Protocol

from torch.nn.parallel import DistributedDataParallel


class SyncPolicy(Protocol):
    name: str

    def should_sync(self, micro_index: int, window_size: int) -> bool:
        """micro_index counts from 0 inside the current window of window_size micro-batches."""
        ...


class AlwaysSync:
    """Every backward all-reduces; the baseline that accumulation saves against."""

    name = "always"

    def should_sync(self, micro_index: int, window_size: int) -> bool:
        return True


class AccumulateSync:
    """Only the last micro-batch of each window (a short last window included) all-reduces."""

    name = "accumulate"

    def should_sync(self, micro_index: int, window_size: int) -> bool:
        return micro_index == window_size - 1


POLICIES: dict[str, type] = {"always": AlwaysSync, "accumulate": AccumulateSync}


def build_policy(cfg: dict[str, Any]) -> SyncPolicy:
    return POLICIES[cfg["name"]]()


def sync_context(ddp: DistributedDataParallel, sync: bool):
    """The context the forward *and* backward of one micro-batch run in: DDP decides in the
    forward whether the next backward reduces, so a forward outside no_sync() syncs anyway."""
    return nullcontext() if sync else ddp.no_sync()
