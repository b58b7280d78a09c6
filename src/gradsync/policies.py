"""Sync policies: asked for every micro-batch whether its forward+backward synchronises gradients
(all-reduce) or runs inside ``ddp.no_sync()`` so they accumulate locally; a policy also chooses
the all-reduce DDP runs and may take part in the overflow handling of fp16 training."""

from __future__ import annotations

from contextlib import nullcontext
from dataclasses import dataclass
from typing import Any, Protocol

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel
from torch.nn.utils import get_total_norm

from gradsync.comm import CommCounts, InnerHook, allreduce_in
from gradsync.powersgd import PowerSGD, build_powersgd, powersgd_hook, sent_bytes
from gradsync.precision import DTYPES


@dataclass
class OverflowCounts:
    aborted_windows: int = 0  # windows whose remaining compute was skipped: doomed by an overflow
    allreduce_skipped: int = 0  # full-gradient all-reduces (syncing backwards) those skipped
    flag_allreduces: int = 0  # one-element all-reduces: overflow consensus, found_inf agreement


class SyncPolicy(Protocol):
    name: str
    overflow: OverflowCounts
    # True: the policy synchronises the parameters itself (local SGD): its windows may step
    # without a synchronising backward, and each rank's fp16 steps are its own
    syncs_parameters: bool
    # what after_window measured when it averaged: this rank's ||theta_r - theta_mean|| /
    # ||theta_mean|| just before (None: it did not average)
    replica_drift: float | None

    def should_sync(self, micro_index: int, window_size: int) -> bool:
        """micro_index counts from 0 inside the current window of window_size micro-batches."""
        ...

    def comm_hook(self) -> InnerHook:
        """The all-reduce DDP runs on a syncing backward (the counting hook wraps it)."""
        ...

    def window_doomed(self, ddp: DistributedDataParallel, micro_index: int,
                      window_size: int) -> bool:
        """Asked after each micro-batch's backward: True (on every rank alike) when the window
        can no longer step, so its remaining micro-batches are not computed."""
        ...

    def agree_on_overflow(self, found_inf: list[torch.Tensor]) -> None:
        """At the window's end, after unscaling: may make the scaler's inf/nan flags (changed in
        place) identical on every rank."""
        ...

    def after_step(self, stepped: bool) -> None:
        """After the optimizer step of a window (stepped: False when fp16 skipped it)."""
        ...

    def start(self, model: torch.nn.Module, windows_done: int) -> None:
        """On every rank before the first window of a fresh or resumed run (after restore)."""
        ...

    def after_window(self, model: torch.nn.Module, windows_done: int) -> None:
        """On every rank after each window's optimizer step, applied or skipped; windows_done
        counts the windows run so far (the same on every rank)."""
        ...

    def finish(self, model: torch.nn.Module) -> None:
        """On every rank when training is done (not when stopped): the replicas become the
        consensus model before the last checkpoint, the final evaluation and summary."""
        ...

    def replicas_in_sync(self) -> bool:
        """True when every rank holds the same parameters (right after an averaging)."""
        ...


class PlainSync:
    """What a policy that neither changes the all-reduce nor looks at overflows answers."""

    syncs_parameters: bool = False
    replica_drift: float | None = None

    def __init__(self) -> None:
        self.overflow = OverflowCounts()

    def start(self, model: torch.nn.Module, windows_done: int) -> None:
        pass

    def after_window(self, model: torch.nn.Module, windows_done: int) -> None:
        pass

    def finish(self, model: torch.nn.Module) -> None:
        pass

    def replicas_in_sync(self) -> bool:
        return True  # gradients are all-reduced before every step

    def comm_hook(self) -> InnerHook:
        return allreduce_in(None)

    def window_doomed(self, ddp: DistributedDataParallel, micro_index: int,
                      window_size: int) -> bool:
        return False

    def agree_on_overflow(self, found_inf: list[torch.Tensor]) -> None:
        """Nothing to do: after a full all-reduce every rank holds the same gradients, so the
        scaler finds the same inf/nan everywhere."""

    def after_step(self, stepped: bool) -> None:
        pass


class AlwaysSync(PlainSync):
    """Every backward all-reduces; the baseline that accumulation saves against."""

    name = "always"

    def should_sync(self, micro_index: int, window_size: int) -> bool:
        return True


class AccumulateSync(PlainSync):
    """Only the last micro-batch of each window (a short last window included) all-reduces;
    with powersgd, rank-r factors of the gradients instead of the gradients (approximate)."""

    name = "accumulate"

    def __init__(self, powersgd: PowerSGD | None = None):
        super().__init__()
        self.powersgd = powersgd

    def comm_hook(self) -> InnerHook:
        if self.powersgd is None:
            return allreduce_in(None)
        return InnerHook(powersgd_hook, self.powersgd, None, sent_bytes)

    def after_step(self, stepped: bool) -> None:
        if self.powersgd is not None and not stepped:
            self.powersgd.forget()  # its memory of the skipped window holds inf/nan

    def should_sync(self, micro_index: int, window_size: int) -> bool:
        return micro_index == window_size - 1


class AmpAwareSync(AccumulateSync):
    """accumulate's window boundaries, with the gradients all-reduced in bf16 (or fp16) and,
    when the fp16 GradScaler runs, overflow consensus.

    Consensus: after every no_sync backward each rank checks its accumulated gradients for
    inf/nan and one MAX all-reduce of that flag tells every rank whether any rank has one. Such
    a window cannot step (the scaler would skip it), so the rest of its compute and its
    full-gradient all-reduce are skipped. At the window's end the scaler's own inf/nan flags are
    MAX all-reduced too, so every rank skips (and backs off the scale) or steps alike, aborted
    windows included, where only some ranks hold the overflow locally."""

    name = "amp_aware"

    def __init__(self, comm_dtype: str = "bf16", overflow_consensus: bool = True,
                 uses_scaler: bool = False, powersgd: PowerSGD | None = None):
        super().__init__(powersgd)
        self.wire_dtype = DTYPES[comm_dtype]
        self.consensus = overflow_consensus and uses_scaler

    def comm_hook(self) -> InnerHook:
        return super().comm_hook() if self.powersgd else allreduce_in(self.wire_dtype)

    def window_doomed(self, ddp: DistributedDataParallel, micro_index: int,
                      window_size: int) -> bool:
        if not self.consensus or micro_index == window_size - 1:
            return False  # the last backward synced: agree_on_overflow settles that window
        grads = [p.grad for p in ddp.parameters() if p.grad is not None]
        local_bad = ~torch.isfinite(get_total_norm(grads, norm_type=float("inf")))
        flag = local_bad.float()
        self._max_over_ranks(flag)
        if not flag.item():
            return False
        self.overflow.aborted_windows += 1
        self.overflow.allreduce_skipped += sum(
            self.should_sync(j, window_size) for j in range(micro_index + 1, window_size))
        return True

    def agree_on_overflow(self, found_inf: list[torch.Tensor]) -> None:
        if self.consensus:
            for flag in found_inf:
                self._max_over_ranks(flag)

    def _max_over_ranks(self, flag: torch.Tensor) -> None:
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        self.overflow.flag_allreduces += 1


POLICIES: dict[str, type] = {"always": AlwaysSync, "accumulate": AccumulateSync,
                             "amp_aware": AmpAwareSync}


def build_policy(cfg: dict[str, Any], uses_scaler: bool = False,
                 counts: CommCounts | None = None) -> SyncPolicy:
    """uses_scaler: the run trains in fp16 with a GradScaler (amp_aware then checks overflows);
    counts: the run's communication counters (policies that all-reduce outside DDP add to them)."""
    if cfg["name"] in ("local_sgd", "diloco"):
        from gradsync.local_sgd import DiLoCo, LocalSGD  # it imports OverflowCounts from here

        options = {k: v for k, v in cfg.items() if k != "name"}
        return (LocalSGD if cfg["name"] == "local_sgd" else DiLoCo)(**options, counts=counts)
    psgd = (build_powersgd(cfg["powersgd_rank"], cfg["powersgd_start_step"])
            if cfg.get("compression", "none") == "powersgd" else None)
    if cfg["name"] == "amp_aware":
        return AmpAwareSync(cfg["comm_dtype"], cfg["overflow_consensus"], uses_scaler, psgd)
    if cfg["name"] == "accumulate":
        return AccumulateSync(psgd)
    return POLICIES[cfg["name"]]()


def sync_context(ddp: DistributedDataParallel, sync: bool):
    """The context the forward *and* backward of one micro-batch run in: DDP decides in the
    forward whether the next backward reduces, so a forward outside no_sync() syncs anyway."""
    return nullcontext() if sync else ddp.no_sync()
