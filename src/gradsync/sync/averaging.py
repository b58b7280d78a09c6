"""Averaging tensors over ranks outside DDP's gradient all-reduce: the mechanism behind the
policies that synchronise parameters themselves (local SGD, DiLoCo) and per-layer rules, and
``Averager``, the role such a policy hands the loop (``policy.averager``).

``mean_over_ranks`` is the mean over ranks of a flat buffer in a chosen wire dtype (through the
run's shared-memory slots when it has them, else one all-reduce) and adds that all-reduce to the
run's ``CommCounts`` (the same counters DDP's counting comm hook fills); ``average_`` applies it
to a list of tensors in place. ``average_replicas`` averages a model's replicas themselves in
place (local SGD on a wire of the model's own dtype: two passes over the model and the drift's
three). ``Anchor`` keeps the fp32 consensus ("global") copy of a set of tensors and averages each
rank's distance from it (the pseudo-gradient ``global - local``), which is what DiLoCo's outer
optimizer steps on; an outer step of ``global -= mean pseudo-gradient`` is plain model
averaging, done on the small differences so that a bf16 wire rounds the updates, never the
weights themselves.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch.nn.utils import get_total_norm

from gradsync.sync.comm import CommCounts
from gradsync.sync.shm_allreduce import (
    SharedSlots,
    average_through_slots,
    mean_through_slots,
    views,
)


class Averager:
    """A policy's averager (``policy.averager``): the role the loop is given when the replicas
    do not stay equal through the gradient all-reduce alone, because the averager keeps some
    parameters (sync.groups with `every`) or the whole model (local SGD, DiLoCo) consistent by
    averaging them after windows. Between averagings each rank trains a replica of its own
    (checkpoints keep every rank's, train/state.py). A policy without one (None) has replicas
    that every step's gradient all-reduce keeps equal. The loop calls it
    (train/loop.py ``average``); the engine asks ``whole_model`` and hands it the
    shared-memory slots."""

    # True: the averager keeps the whole model consistent (no gradient all-reduce needed: a
    # window may end without one; each rank's GradScaler skips its own steps, and the engine
    # leaves the buffers to it); False: some parameter groups only (the engine leaves those
    # alone: Wire.bind)
    whole_model: bool = False
    drift: float | None = None  # set by after_window / finish when they averaged: this rank's
    # ||theta_r - theta_mean|| / ||theta_mean|| just before
    counters: Any = None  # per-rank counters (a dataclass of numbers): summary.json, checkpoints

    def use_shared_memory(self, slots: SharedSlots) -> None:
        """The engine: the run's CPU ranks all-reduce through shared memory
        (sync/shm_allreduce.py); the averaging may go through the same slots."""

    def start(self, model: torch.nn.Module, windows_done: int) -> None:
        """On every rank before the first window of a fresh or resumed run (after restore)."""

    def after_step(self, stepped: bool) -> None:
        """After each window's optimizer step (stepped: False when this rank's fp16 GradScaler
        skipped it)."""

    def after_window(self, model: torch.nn.Module, windows_done: int) -> None:
        """On every rank after each window's optimizer step (taken or skipped); windows_done
        counts the windows completed so far, the same on every rank."""

    def finish(self, model: torch.nn.Module) -> None:
        """At the end of training, before the final evaluation and checkpoint."""

    def in_sync(self) -> bool:
        """Whether every rank holds the same parameters now (trainer.check_replicas asks, and a
        checkpoint saves the replicas' mean when not)."""
        return True

    def local_step(self) -> bool:
        """Asked at each window's first micro-batch (by the loss normaliser): True when the
        window's optimizer step is this rank's own (no gradient all-reduce) and more local steps
        follow before the replicas are averaged (local SGD with H > 1 after its warm-up): the
        loss is then divided by this rank's own count, and a rank without a real sample in the
        window does not step (train/normalize.py)."""
        return False


def whole_model(averager: Averager | None) -> bool:
    """A policy's averager keeps the whole model (local SGD, DiLoCo): a window may end without
    a gradient all-reduce, and each rank keeps its own buffers until it averages them."""
    return averager is not None and averager.whole_model


def average_(tensors: list[torch.Tensor], wire_dtype: torch.dtype | None,
             counts: CommCounts) -> None:
    """In place: every tensor becomes its mean over ranks, in ONE all-reduce of
    the tensors flattened into one buffer (mean_over_ranks; their dtype must be shared)."""
    if not tensors:
        return
    flat = torch.cat([t.detach().reshape(-1) for t in tensors])
    mean = mean_over_ranks(flat, wire_dtype, counts)
    for t, m in zip(tensors, views(mean, tensors), strict=True):
        t.copy_(m)


def mean_over_ranks(src: torch.Tensor, wire_dtype: torch.dtype | None, counts: CommCounts,
                    slots: SharedSlots | None = None) -> torch.Tensor:
    """The mean over ranks of a flat tensor, summed in wire_dtype (None: src's
    dtype), divided before the sum as DDP's hooks do: through the run's shared-memory slots
    when it has them (CPU ranks of one host; the same bits) and the tensor fits, else one
    all-reduce. Counted as one call of numel x wire itemsize bytes."""
    dtype = wire_dtype or src.dtype
    counts.allreduce_calls += 1
    counts.allreduce_bytes += src.numel() * dtype.itemsize
    mean = mean_through_slots(slots, src, wire_dtype) if slots is not None else None
    if mean is None:
        world = dist.get_world_size()
        wire = torch.div(src, world) if dtype == src.dtype else src.to(dtype).div_(world)
        dist.all_reduce(wire)
        mean = wire if wire.dtype == src.dtype else wire.to(src.dtype)
    return mean


def float_state(model: torch.nn.Module) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """What a replica's state is made of: its parameters, and its floating-point buffers
    (running statistics; integer buffers such as BatchNorm's step counter are left alone)."""
    params: list[torch.Tensor] = list(model.parameters())
    buffers = [b for b in model.buffers() if b.is_floating_point()]
    return params, buffers


# An outer update: (global tensors, their mean pseudo-gradients) -> None, in place on global.
OuterStep = Callable[[list[torch.Tensor], list[torch.Tensor]], None]


def plain_average(global_: list[torch.Tensor], pseudo: list[torch.Tensor]) -> None:
    """global - mean(global - local) = mean(local): model averaging."""
    if global_:
        torch._foreach_sub_(global_, pseudo)


def average_replicas(model: torch.nn.Module, counts: CommCounts,
                     slots: SharedSlots | None = None) -> float:
    """Model averaging in place when the wire is the replica's own dtype (local SGD's fp32
    round, collective): every parameter and float buffer becomes its mean over ranks, divided
    before the sum as DDP's hooks do, in ONE all-reduce (through the run's shared-memory slots
    when it has them, with the bits of the process-group all-reduce: 2 passes and 2 barriers;
    else a flat copy and one all-reduce). No consensus copy is kept. Returns this rank's drift
    before the round, ||theta_r - theta_mean|| / ||theta_mean||, read from the same buffers."""
    params, buffers = float_state(model)
    replica = [t.detach() for t in params + buffers]
    numel = sum(t.numel() for t in replica)
    dtype, world = replica[0].dtype, dist.get_world_size()
    counts.allreduce_calls += 1
    counts.allreduce_bytes += numel * dtype.itemsize
    scaled = average_through_slots(slots, replica) if slots is not None else None
    if scaled is None:  # no slots, or the replica does not fit one
        scaled = torch.cat([t.reshape(-1) for t in replica]).div_(world)
        mean = scaled.clone()
        dist.all_reduce(mean)
        with torch.no_grad():
            for t, m in zip(replica, views(mean, replica), strict=True):
                t.copy_(m)
    # theta_r - theta_mean, written over the scaled copy (world * (theta_r / world) is theta_r
    # for a power-of-two world size: no rounding), then the drift's one host read
    diff = views(scaled, replica)
    for d, t in zip(diff, replica, strict=True):
        torch.add(t, d, alpha=-world, out=d)
    num, den = get_total_norm(diff), get_total_norm(replica)
    return float(torch.where(den > 0, num / den, num))


class Anchor:
    """The fp32 consensus copy of a replica's parameters and float buffers (the same on every
    rank), and the round that moves it: average the pseudo-gradients, let an outer step move the
    parameters' copy (the buffers' copy is always plainly averaged), copy the result into the
    replica. Also measures how far the replicas had drifted apart.

    The copy lives in one flat buffer (``params`` and ``buffers`` are views into it), and so do
    the round's pseudo-gradients: a round is seven passes over the model and one all-reduce."""

    def __init__(self, params: list[torch.Tensor], buffers: list[torch.Tensor],
                 device: torch.device | None = None):
        """A copy of `params` and `buffers` on `device` (default: where they are)."""
        tensors = [t.detach() for t in params + buffers]
        if device is None and tensors:
            device = tensors[0].device
        self.flat = torch.empty(sum(t.numel() for t in tensors), dtype=torch.float32,
                                device=device)
        cut = views(self.flat, tensors)
        for v, t in zip(cut, tensors, strict=True):
            v.copy_(t)
        self.params, self.buffers = cut[:len(params)], cut[len(params):]
        self.local = torch.empty_like(self.flat)  # this rank's pseudo-gradient of a round

    @classmethod
    def of(cls, model: torch.nn.Module) -> Anchor:
        return cls(*float_state(model))

    def sync(self, model: torch.nn.Module, outer: OuterStep, wire_dtype: torch.dtype | None,
             counts: CommCounts, slots: SharedSlots | None = None) -> float:
        """One averaging round (collective). Returns this rank's drift before it:
        ||theta_r - theta_mean|| / ||theta_mean|| over parameters and float buffers."""
        params, buffers = float_state(model)
        replica = [t.detach() for t in params + buffers]
        mine = self.params + self.buffers
        for d, g, t in zip(views(self.local, replica), mine, replica, strict=True):
            torch.sub(g, t, out=d)  # this rank's pseudo-gradient global - local
        mean = mean_over_ranks(self.local, wire_dtype, counts, slots)  # pseudo-gradient
        # theta_r - theta_mean = (g - local_pseudo_r) - (g - mean_pseudo) = mean - local
        norm = torch.linalg.vector_norm  # of a difference written over `local`: no temporaries
        num = norm(torch.sub(mean, self.local, out=self.local))
        den = norm(torch.sub(self.flat, mean, out=self.local))  # the mean replica's norm
        # the one host read of a round (docs/gpus-and-slurm.md): the drift, for the counters
        drift = float(torch.where(den > 0, num / den, num))
        n = len(self.params)
        pseudo = views(mean, replica)
        outer(self.params, pseudo[:n])
        plain_average(self.buffers, pseudo[n:])
        with torch.no_grad():
            for t, g in zip(replica, mine, strict=True):
                t.copy_(g)
        return drift

    def state_dict(self) -> dict[str, list[torch.Tensor]]:
        return {"params": self.params, "buffers": self.buffers}

    @classmethod
    def from_state(cls, state: dict[str, list[torch.Tensor]], device: torch.device) -> Anchor:
        """The anchor a checkpoint kept (loaded on the CPU), on the model's `device`."""
        return cls(state["params"], state["buffers"], device)
