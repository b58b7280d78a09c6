"""Policies that skip gradient synchronisation for whole optimizer steps and synchronise the
models instead: local SGD (Lin et al. 2020, with post-local SGD warm-up) and DiLoCo (Douillard
et al. 2023).

Every forward+backward runs inside ``no_sync()`` (after ``warmup_windows`` windows of exact
``accumulate``), so each rank steps its own optimizer on its own window gradient. Every
``every`` windows (H) the replicas meet in ONE all-reduce over their parameters and
floating-point buffers. Local SGD on an fp32 wire averages the replicas themselves
(averaging.average_replicas: no consensus copy kept). DiLoCo, and local SGD on a bf16 wire, go
through the fp32 anchor (averaging.Anchor): each rank's pseudo-gradient ``global - local`` is
averaged in ``comm_dtype`` (a bf16 wire rounds the updates, never the weights); local SGD sets the
global weights to the mean model, DiLoCo lets an outer SGD (Nesterov momentum) step them. Every
rank continues from the new weights, bitwise the same everywhere. The schedule counts windows,
never a rank's applied steps: with fp16 each rank has its own GradScaler and skips its own
overflowing steps, and the averaging still happens at the same window on every rank. Optimizer
state stays per rank (as in torch's PostLocalSGDOptimizer, Accelerate's LocalSGD and torchft),
which the checkpoint keeps per rank (train/state.py).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from gradsync.components import CheckContext, ConfigError, checks, require
from gradsync.core.dtypes import DTYPES
from gradsync.sync.averaging import Anchor, Averager, average_replicas, float_state, plain_average
from gradsync.sync.comm import CommCounts
from gradsync.sync.policy import SyncPolicy, last_micro_batch, renamed_keys
from gradsync.sync.shm_allreduce import SharedSlots

COMM_DTYPES = ("fp32", "bf16")


def _check_local_sgd(a: dict[str, Any], ctx: CheckContext) -> None:
    """The gradient all-reduce's options (PowerSGD, amp_aware's overflow consensus) are not
    parameters of these policies: the signature check refuses them as unknown keys."""
    require(isinstance(a["every"], int) and a["every"] >= 1, "sync.every",
            "an integer >= 1 (windows between averagings)", a["every"])
    warmup = a["warmup_windows"]
    require(isinstance(warmup, int) and warmup >= 0, "sync.warmup_windows",
            "an integer >= 0 (exact accumulate windows first)", warmup)
    require(a["comm_dtype"] in COMM_DTYPES, "sync.comm_dtype", f"one of {', '.join(COMM_DTYPES)}",
            a["comm_dtype"])


def _check_diloco(a: dict[str, Any], ctx: CheckContext) -> None:
    _check_local_sgd(a, ctx)
    require(0 < a["outer_lr"] < math.inf, "sync.outer_lr", "a number > 0 (finite)",
            a["outer_lr"])
    require(0 <= a["outer_momentum"] < 1, "sync.outer_momentum", "a number in [0, 1)",
            a["outer_momentum"])
    if a["outer_nesterov"] and a["outer_momentum"] == 0:
        raise ConfigError("sync.outer_nesterov=true needs sync.outer_momentum > 0: set "
                          "sync.outer_nesterov=false")


@dataclass
class AveragingCounts:
    """Per rank, reported in summary.json and kept by checkpoints."""

    averagings: int = 0  # averaging rounds (each one all-reduce, counted in CommCounts too)
    local_skipped_steps: int = 0  # fp16: this rank's own GradScaler skipped its step
    max_replica_drift: float = 0.0  # the largest drift this rank measured before an averaging


class MeanModel:
    """Local SGD's outer update: the global weights become the mean of the replicas."""

    def step(self, global_: list[torch.Tensor], pseudo: list[torch.Tensor]) -> None:
        plain_average(global_, pseudo)

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: dict[str, Any], global_: list[torch.Tensor]) -> None:
        pass


class OuterSGD:
    """DiLoCo's outer optimizer: torch's SGD on the fp32 global weights, the mean pseudo-gradient
    as their gradient (lr 1, no momentum: exactly MeanModel)."""

    def __init__(self, lr: float, momentum: float, nesterov: bool):
        self.lr, self.momentum, self.nesterov = lr, momentum, nesterov
        self.opt: torch.optim.SGD | None = None

    def _build(self, global_: list[torch.Tensor]) -> torch.optim.SGD:
        if self.opt is None:
            # fused: one kernel over each tensor, the for-loop step's bits in under half its
            # time (the global weights are fp32, on CPU or CUDA)
            self.opt = torch.optim.SGD(global_, lr=self.lr, momentum=self.momentum,
                                       nesterov=self.nesterov, fused=True)
        return self.opt

    def step(self, global_: list[torch.Tensor], pseudo: list[torch.Tensor]) -> None:
        opt = self._build(global_)
        for g, d in zip(global_, pseudo, strict=True):
            g.grad = d
        opt.step()
        for g in global_:
            g.grad = None

    def state_dict(self) -> dict[str, Any]:
        return self.opt.state_dict() if self.opt is not None else {}

    def load_state_dict(self, state: dict[str, Any], global_: list[torch.Tensor]) -> None:
        self.opt = None
        if state:
            self._build(global_).load_state_dict(state)


class ModelAveraging(SyncPolicy, Averager):
    """The policy: exact accumulate for `warmup_windows` windows, then local steps, and every
    `every` windows one averaging round with `outer` as the update of the global weights (the
    replicas averaged directly when that is the plain mean on their own dtype: direct()).
    local_sgd() and diloco() below build it; they only choose the outer update. It is its own
    averager (the loop's role); its wire is the plain all-reduce (warm-up)."""

    whole_model = True  # no gradient all-reduce after warm-up: the averager syncs the models

    def __init__(self, name: str, every: int, warmup_windows: int, comm_dtype: str,
                 outer: MeanModel | OuterSGD, counts: CommCounts | None = None):
        self.name = name
        self.every, self.warmup = every, warmup_windows
        self.comm_dtype = DTYPES[comm_dtype]  # the averaging all-reduce's
        self.outer = outer
        self.counts = counts if counts is not None else CommCounts()
        self.averager = self
        self.counters = AveragingCounts()
        self.windows = 0
        self.anchor: Anchor | None = None  # the global weights; None in warm-up and if direct
        self.synced = True  # the replicas are the same now (in_sync)
        self.drift: float | None = None  # measured by the last after_window, if it averaged
        self.restored: dict[str, Any] | None = None  # a checkpoint's anchor, until start()
        self.slots: SharedSlots | None = None  # the run's shared-memory all-reduce, if it has one

    def use_shared_memory(self, slots: SharedSlots) -> None:
        """The averaging all-reduces through the slots DDP's hook uses (idle after warm-up)."""
        self.slots = slots

    # --- the loop's questions (the warm-up all-reduces with DDP's exact default hook; no
    # overflow consensus: each rank's GradScaler skips its own overflowing steps, as after
    # warm-up no all-reduce makes the gradients, hence the flags, agree) ------------------------
    def should_sync(self, micro_index: int, window_size: int) -> bool:
        return self.windows < self.warmup and last_micro_batch(micro_index, window_size)

    def after_step(self, stepped: bool) -> None:
        self.counters.local_skipped_steps += not stepped

    def start(self, model: torch.nn.Module, windows_done: int) -> None:
        """Before the first window of a (fresh or resumed) run. A resumed run's anchor (and the
        outer optimizer's state on it) is placed here, on the model's device: the checkpoint
        was loaded on the CPU."""
        self.windows = windows_done
        restored, self.restored = self.restored, None
        if restored is not None:
            device = next(model.parameters()).device
            self.anchor = Anchor.from_state(restored["anchor"], device) if restored["anchor"] \
                else None
            self.outer.load_state_dict(restored["outer"], self.anchor.params if self.anchor else [])
        if self.direct(model):
            self.anchor = None  # an earlier checkpoint's anchor has nothing left to do
        elif self.anchor is None and windows_done >= self.warmup:
            self.anchor = Anchor.of(model)  # a fresh run: the replicas start identical

    def after_window(self, model: torch.nn.Module, windows_done: int) -> None:
        self.windows = windows_done
        self.drift = None
        if windows_done < self.warmup:
            return
        if windows_done == self.warmup:  # warm-up over: its exact steps kept replicas equal
            if not self.direct(model):
                self.anchor = Anchor.of(model)
            return
        self.synced = False
        if (windows_done - self.warmup) % self.every == 0:
            self._sync(model)

    def finish(self, model: torch.nn.Module) -> None:
        """The run ends with an averaging round unless its last window had one."""
        if not self.synced:
            self._sync(model)

    def in_sync(self) -> bool:
        return self.synced

    def local_step(self) -> bool:
        """The window now running (self.windows done before it) steps this rank alone, and
        more such steps follow before the next averaging: after the warm-up, with H > 1. With
        H = 1 every step is averaged at once, so the mean of the ranks' steps must be the step
        of the global mean: the shared divisor (docs/local-sgd.md)."""
        return self.every > 1 and self.windows >= self.warmup

    def direct(self, model: torch.nn.Module) -> bool:
        """Whether a round averages the replicas themselves (averaging.average_replicas): the
        outer update is the plain mean and the wire is the tensors' one dtype, so nothing is
        rounded that the replicas would not round. Otherwise (DiLoCo's outer step, a bf16 wire)
        the round goes through the fp32 anchor and averages the small differences."""
        dtypes = {t.dtype for group in float_state(model) for t in group}
        return isinstance(self.outer, MeanModel) and len(dtypes) == 1 and \
            self.comm_dtype in (None, *dtypes)

    def _sync(self, model: torch.nn.Module) -> None:
        if self.anchor is None:
            self.drift = average_replicas(model, self.counts, self.slots)
        else:
            self.drift = self.anchor.sync(model, self.outer.step, self.comm_dtype, self.counts,
                                          self.slots)
        self.counters.averagings += 1
        self.counters.max_replica_drift = max(self.counters.max_replica_drift, self.drift)
        self.synced = True

    # --- checkpoints (the same on every rank; per-rank counters live in `counters`) ----------
    def state_dict(self) -> dict[str, Any]:
        if self.restored is not None:  # loaded, not started yet: as it was loaded
            return self.restored | {"windows": self.windows, "in_sync": self.synced}
        return {"windows": self.windows, "in_sync": self.synced,
                "anchor": self.anchor.state_dict() if self.anchor else None,
                "outer": self.outer.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """The anchor and the outer optimizer's state wait for start(), which knows the
        model's device."""
        self.windows, self.synced = state["windows"], state["in_sync"]
        self.anchor, self.restored = None, state


# The components (`_target_`s of conf/sync/local_sgd.yaml and diloco.yaml): each chooses the
# outer update and its defaults for the one policy class, ModelAveraging.
@checks(_check_local_sgd)
def local_sgd(every: int = 8, warmup_windows: int = 0, comm_dtype: str = "fp32",
             counts: CommCounts | None = None) -> ModelAveraging:
    """sync=local_sgd: every `every` windows the replicas are replaced by their mean."""
    return ModelAveraging("local_sgd", every, warmup_windows, comm_dtype, MeanModel(), counts)


local_sgd.renamed = renamed_keys("sync.warmup_steps")  # type: ignore[attr-defined]


@checks(_check_diloco)
def diloco(every: int = 32, warmup_windows: int = 0, comm_dtype: str = "fp32",
           outer_lr: float = 0.7, outer_momentum: float = 0.9, outer_nesterov: bool = True,
           counts: CommCounts | None = None) -> ModelAveraging:
    """sync=diloco: the configured optimizer is the inner one; every `every` windows an outer SGD
    (Nesterov momentum by default, as in the paper) steps the global weights on the mean
    pseudo-gradient and every rank continues from them."""
    # lr 1 without momentum is the plain mean: local SGD's update (and its direct round)
    outer = MeanModel() if outer_lr == 1 and outer_momentum == 0 else \
        OuterSGD(outer_lr, outer_momentum, outer_nesterov)
    return ModelAveraging("diloco", every, warmup_windows, comm_dtype, outer, counts)


diloco.renamed = local_sgd.renamed  # type: ignore[attr-defined]
