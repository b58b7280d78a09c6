"""Sync policies: asked for every micro-batch whether its forward+backward synchronises gradients
(all-reduce) or runs inside ``ddp.no_sync()`` so they accumulate locally; a policy may also
choose the all-reduce DDP runs, take part in fp16's overflow handling, or keep the replicas
consistent itself by averaging parameters (local SGD).

A policy is an ordinary ``_target_`` component (conf/sync/): any class with ``should_sync``.
Every other member of the ``SyncPolicy`` protocol is optional; ``Policy`` wraps the object and
answers for what it leaves out. The built-ins are composed from small parts (the boundary rule,
the wire, overflow consensus), not from one another.
"""

from __future__ import annotations

from contextlib import nullcontext
from dataclasses import dataclass
from typing import Any, Protocol

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.nn.utils import get_total_norm

from gradsync.components import CheckContext, ConfigError, checks, require
from gradsync.sync.comm import CommCounts, InnerHook, allreduce_in
from gradsync.sync.layer_sync import LayerSync, Rules, check_groups
from gradsync.sync.powersgd import PowerSGD, build_powersgd, powersgd_hook, sent_bytes
from gradsync.sync.shm_allreduce import SharedSlots
from gradsync.train.precision import DTYPES


@dataclass
class OverflowCounts:
    aborted_windows: int = 0  # windows whose remaining compute was skipped: doomed by an overflow
    allreduce_skipped: int = 0  # full-gradient all-reduces (syncing backwards) those skipped
    flag_allreduces: int = 0  # one-element all-reduces: overflow consensus, found_inf agreement


class SyncPolicy(Protocol):
    """The contract. Only ``should_sync`` is required; ``Policy`` supplies the rest."""

    def should_sync(self, micro_index: int, window_size: int) -> bool:
        """micro_index counts from 0 inside the current window of window_size micro-batches.
        The last micro-batch of a window must synchronise (the all-reduce of the accumulated
        gradients is what keeps the replicas equal), unless ``syncs_parameters``."""
        ...

    # --- optional ---------------------------------------------------------------------------
    # name: str                      shown in summary.json (default: the class name)
    # syncs_parameters: bool         True: the policy keeps the replicas consistent itself
    #                                (averaging parameters); windows may then end unsynchronised
    # overflow: OverflowCounts       counters of the overflow handling
    # averaging: a dataclass         counters of a policy that averages the models (local SGD's
    #                                AveragingCounts), in summary.json and checkpoints
    # own_replicas: bool             True: some parameters (and their optimizer state) differ
    #                                across ranks between averagings: checkpoints keep every
    #                                rank's model and optimizer (sync.groups with `every`;
    #                                implied by syncs_parameters)
    # replica_drift: float | None    set by after_window/finish when they averaged: this rank's
    #                                ||theta_r - theta_mean|| / ||theta_mean|| just before

    def bind(self, model: nn.Module) -> list[str]:
        """Before DDP wraps the model: the names of parameters DDP must leave alone (neither
        broadcast nor all-reduce them): the policy keeps them consistent itself."""
        ...

    def comm_hook(self) -> InnerHook:
        """The all-reduce DDP runs on a syncing backward (the counting hook wraps it)."""
        ...

    def use_shared_memory(self, slots: SharedSlots) -> None:
        """The run's CPU ranks all-reduce through shared memory (shm_allreduce): a policy that
        averages by itself may do so through the same slots (averaging.mean_over_ranks)."""
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

    def start(self, model: nn.Module, windows_done: int) -> None:
        """On every rank before the first window of a fresh or resumed run (after restore)."""
        ...

    def after_window(self, model: nn.Module, windows_done: int) -> None:
        """On every rank after each window's optimizer step (taken or skipped); windows_done
        counts the windows completed so far, the same on every rank."""
        ...

    def finish(self, model: nn.Module) -> None:
        """At the end of training, before the final evaluation and checkpoint."""
        ...

    def replicas_in_sync(self) -> bool:
        """Whether every rank holds the same parameters now (trainer.check_replicas asks)."""
        ...


class Policy:
    """A policy object seen through the whole protocol: what it implements is called, what it
    leaves out gets the answer of a policy that neither changes the all-reduce, looks at
    overflows, nor averages parameters."""

    def __init__(self, impl: Any):
        self.impl = impl
        self.name: str = getattr(impl, "name", type(impl).__name__)
        self.syncs_parameters = bool(getattr(impl, "syncs_parameters", False))
        self.overflow: OverflowCounts = getattr(impl, "overflow", None) or OverflowCounts()
        self.averaging: Any = getattr(impl, "averaging", None)
        self.own_replicas = self.syncs_parameters or bool(getattr(impl, "own_replicas", False))

    def bind(self, model: nn.Module) -> list[str]:
        bind = getattr(self.impl, "bind", None)
        return list(bind(model)) if bind else []

    def should_sync(self, micro_index: int, window_size: int) -> bool:
        return bool(self.impl.should_sync(micro_index, window_size))

    def comm_hook(self) -> InnerHook:
        hook = getattr(self.impl, "comm_hook", None)
        return hook() if hook else allreduce_in(None)

    def use_shared_memory(self, slots: SharedSlots) -> None:
        """The run all-reduces through shared memory: a policy that averages by itself may too."""
        use = getattr(self.impl, "use_shared_memory", None)
        if use:
            use(slots)

    def window_doomed(self, ddp: DistributedDataParallel, micro_index: int,
                      window_size: int) -> bool:
        doomed = getattr(self.impl, "window_doomed", None)
        return bool(doomed(ddp, micro_index, window_size)) if doomed else False

    def agree_on_overflow(self, found_inf: list[torch.Tensor]) -> None:
        """Default: nothing. After a full all-reduce every rank holds the same gradients, so the
        scaler finds the same inf/nan everywhere."""
        agree = getattr(self.impl, "agree_on_overflow", None)
        if agree:
            agree(found_inf)

    def after_step(self, stepped: bool) -> None:
        if hasattr(self.impl, "after_step"):
            self.impl.after_step(stepped)

    def start(self, model: nn.Module, windows_done: int) -> None:
        if hasattr(self.impl, "start"):
            self.impl.start(model, windows_done)

    @property
    def replica_drift(self) -> float | None:
        return getattr(self.impl, "replica_drift", None)

    def after_window(self, model: nn.Module, windows_done: int) -> None:
        if hasattr(self.impl, "after_window"):
            self.impl.after_window(model, windows_done)

    def finish(self, model: nn.Module) -> None:
        if hasattr(self.impl, "finish"):
            self.impl.finish(model)

    def replicas_in_sync(self) -> bool:
        in_sync = getattr(self.impl, "replicas_in_sync", None)
        return bool(in_sync()) if in_sync else not self.syncs_parameters


def last_micro_batch(micro_index: int, window_size: int) -> bool:
    """The boundary of accumulation: only a window's last micro-batch (a short last window
    included) synchronises."""
    return micro_index == window_size - 1


class Compression:
    """What a policy's all-reduce sends: the bucket (in its dtype or a wire dtype), PowerSGD
    factors, or each parameter group's gradients in its own wire dtype (sync.groups, whose
    groups with `every` are averaged instead: layer_sync.py). One place answers which dtype goes
    on the wire and what the policy syncs itself."""

    def __init__(self, wire_dtype: torch.dtype | None = None, powersgd: PowerSGD | None = None,
                 groups: Rules = (), counts: CommCounts | None = None):
        self.wire_dtype, self.powersgd = wire_dtype, powersgd
        counts = counts if counts is not None else CommCounts()
        self.layers = LayerSync(groups, wire_dtype, counts) if groups else None
        self.own_replicas = self.layers is not None and self.layers.averages

    def bind(self, model: nn.Module) -> list[str]:
        return self.layers.bind(model) if self.layers else []

    def after_window(self, model: nn.Module, windows_done: int) -> None:
        if self.layers:
            self.layers.after_window(windows_done)

    def finish(self, model: nn.Module) -> None:
        if self.layers:
            self.layers.finish()

    def replicas_in_sync(self) -> bool:
        return self.layers.in_sync if self.layers else True

    def comm_hook(self) -> InnerHook:
        if self.layers is not None:
            return self.layers.comm_hook()
        if self.powersgd is None:
            return allreduce_in(self.wire_dtype)
        return InnerHook(powersgd_hook, self.powersgd, None, sent_bytes)

    def after_step(self, stepped: bool) -> None:
        if self.powersgd is not None and not stepped:
            self.powersgd.forget()  # its memory of the skipped window holds inf/nan


def make_wire(name: str, rank: int, start_step: int, wire_dtype: torch.dtype | None = None,
              groups: Rules = (),
              counts: CommCounts | None = None) -> Compression:
    return Compression(wire_dtype, build_powersgd(rank, start_step) if name == "powersgd"
                       else None, groups, counts)


# The protocol members the wire answers for in accumulate and amp_aware (bound in __init__).
WIRE_MEMBERS = ("comm_hook", "after_step", "bind", "after_window", "finish", "replicas_in_sync")


def answer_with(policy: Any, part: Any, members: tuple[str, ...]) -> None:
    """Composition without a delegating method per member: the policy's members are the
    part's bound methods."""
    for member in members:
        setattr(policy, member, getattr(part, member))


def flag_agreement(wire: Compression, uses_scaler: bool) -> OverflowConsensus | None:
    """fp16 with groups that are averaged instead of all-reduced: their gradients are each
    rank's own, so the scaler's inf/nan flags must be made the same on every rank (MAX
    all-reduce) or one rank would skip a step the others take."""
    return OverflowConsensus() if uses_scaler and wire.own_replicas else None


def agree_through(policy: Any, agreement: OverflowConsensus | None) -> OverflowCounts:
    """The policy's agree_on_overflow is the agreement's (none: Policy's default, nothing);
    returns the counters the policy reports as its `overflow`."""
    if agreement is None:
        return OverflowCounts()
    answer_with(policy, agreement, ("agree_on_overflow",))
    return agreement.overflow


class OverflowConsensus:
    """fp16 with a GradScaler: after every no_sync backward each rank checks its accumulated
    gradients for inf/nan and one MAX all-reduce of that flag tells every rank whether any rank
    has one. Such a window cannot step (the scaler would skip it), so the rest of its compute
    and its full-gradient all-reduce are skipped. At the window's end the scaler's own inf/nan
    flags are MAX all-reduced too, so every rank skips (and backs off the scale) or steps alike,
    aborted windows included, where only some ranks hold the overflow locally."""

    def __init__(self) -> None:
        self.overflow = OverflowCounts()

    def window_doomed(self, ddp: DistributedDataParallel, micro_index: int,
                      window_size: int) -> bool:
        if last_micro_batch(micro_index, window_size):
            return False  # the last backward synced: agree_on_overflow settles that window
        grads = [p.grad for p in ddp.parameters() if p.grad is not None]
        flag = (~torch.isfinite(get_total_norm(grads, norm_type=float("inf")))).float()
        self._max_over_ranks(flag)
        if not flag.item():
            return False
        self.overflow.aborted_windows += 1
        self.overflow.allreduce_skipped += 1  # the window's last, synchronising backward
        return True

    def agree_on_overflow(self, found_inf: list[torch.Tensor]) -> None:
        for flag in found_inf:
            self._max_over_ranks(flag)

    def _max_over_ranks(self, flag: torch.Tensor) -> None:
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        self.overflow.flag_allreduces += 1


class AlwaysSync:
    """Every backward all-reduces; the baseline that accumulation saves against."""

    name = "always"

    def should_sync(self, micro_index: int, window_size: int) -> bool:
        return True


def _check_compression(a: dict[str, Any], ctx: CheckContext) -> None:
    require(a["compression"] in ("none", "powersgd"), "sync.compression", "none or powersgd",
            a["compression"])
    require(a["powersgd_rank"] >= 1, "sync.powersgd_rank", "an integer >= 1",
            a["powersgd_rank"])
    require(a["powersgd_start_step"] >= 2, "sync.powersgd_start_step",
            "an integer >= 2 (torch's PowerSGD with error feedback)", a["powersgd_start_step"])
    if a["compression"] == "powersgd" and ctx.provided.get("allreduce") == "shared_memory":
        raise ConfigError("sync.compression=powersgd all-reduces through the process group: "
                          "use trainer.allreduce=auto or process_group")


def _check_accumulate(a: dict[str, Any], ctx: CheckContext) -> None:
    _check_compression(a, ctx)
    check_groups(a, ctx, "fp32")


@checks(_check_accumulate)
class AccumulateSync:
    """Only the last micro-batch of each window (a short last window included) all-reduces;
    with compression=powersgd, rank-r factors of the gradients instead of the gradients
    (approximate); with groups, per-layer rules (layer_sync.py)."""

    name = "accumulate"

    def __init__(self, compression: str = "none", powersgd_rank: int = 4,
                 powersgd_start_step: int = 10, groups: Rules = (),
                 uses_scaler: bool = False, counts: CommCounts | None = None):
        self.wire = make_wire(compression, powersgd_rank, powersgd_start_step, None, groups,
                              counts)
        answer_with(self, self.wire, WIRE_MEMBERS)
        self.own_replicas = self.wire.own_replicas
        self.agreement = flag_agreement(self.wire, uses_scaler)
        self.overflow = agree_through(self, self.agreement)

    def should_sync(self, micro_index: int, window_size: int) -> bool:
        return last_micro_batch(micro_index, window_size)


def _check_amp_aware(a: dict[str, Any], ctx: CheckContext) -> None:
    require(a["comm_dtype"] in DTYPES, "sync.comm_dtype", f"one of {', '.join(DTYPES)}",
            a["comm_dtype"])
    if a["comm_dtype"] == "fp16" and ctx.precision != "fp16":
        raise ConfigError(f"sync.comm_dtype='fp16' needs precision=fp16, not "
                          f"{ctx.precision!r}: only its GradScaler catches an overflow of the "
                          "fp16 all-reduce; use bf16 or fp32")
    _check_compression(a, ctx)
    if a["compression"] == "powersgd" and a["comm_dtype"] != "fp32":
        raise ConfigError("sync.compression=powersgd sends its own fp32 factors: set "
                          f"sync.comm_dtype=fp32 (not {a['comm_dtype']!r})")
    check_groups(a, ctx, a["comm_dtype"])


@checks(_check_amp_aware)
class AmpAwareSync:
    """accumulate's window boundaries, with the gradients all-reduced in bf16 (or fp16) and,
    when the fp16 GradScaler runs, overflow consensus (OverflowConsensus)."""

    name = "amp_aware"

    def __init__(self, comm_dtype: str = "bf16", overflow_consensus: bool = True,
                 compression: str = "none", powersgd_rank: int = 4,
                 powersgd_start_step: int = 10, groups: Rules = (),
                 uses_scaler: bool = False, counts: CommCounts | None = None):
        self.wire = make_wire(compression, powersgd_rank, powersgd_start_step,
                              DTYPES[comm_dtype], groups, counts)
        answer_with(self, self.wire, WIRE_MEMBERS)
        self.own_replicas = self.wire.own_replicas
        self.consensus = OverflowConsensus() if overflow_consensus and uses_scaler else None
        self.agreement = self.consensus or flag_agreement(self.wire, uses_scaler)
        self.overflow = agree_through(self, self.agreement)

    def should_sync(self, micro_index: int, window_size: int) -> bool:
        return last_micro_batch(micro_index, window_size)

    def window_doomed(self, ddp: DistributedDataParallel, micro_index: int,
                      window_size: int) -> bool:
        return self.consensus is not None and self.consensus.window_doomed(ddp, micro_index,
                                                                           window_size)


def sync_context(ddp: DistributedDataParallel, sync: bool):
    """The context the forward *and* backward of one micro-batch run in: DDP decides in the
    forward whether the next backward reduces, so a forward outside no_sync() syncs anyway."""
    return nullcontext() if sync else ddp.no_sync()
