"""The training loop: micro-batches grouped into windows, one optimizer step per window.

For every micro-batch the sync policy decides whether its forward+backward runs inside
``no_sync()``. Each micro-batch's summed loss is divided by the number of real samples its
window holds over all ranks, over the world size, and DDP averages over ranks, so each step
applies the gradient of the mean loss over every real sample of the window on every rank, a
short last window included. The samples the sampler repeats to give every rank the same number
of micro-batches (data not a multiple of the world size) still run forward and backward (DDP's
collectives must match) but are left out of the loss (schedules.Shard says which they are).
Token-normalised losses, whose count is only known at the window's end, are rescaled once
before the step (normalize.py).

Two counters: ``windows`` counts optimizer-step attempts (one per window: the log cadence and the
x-axis of TensorBoard); ``step`` counts optimizer steps applied. With fp16 the GradScaler skips
the step of a window whose gradients hold inf/nan: such a window advances ``windows`` but neither
``step`` nor the LR scheduler, so the LR schedule, ``max_steps`` and ``eval_every`` count only
real updates (Lightning #5558 stepped the scheduler anyway).

Windows are cut one at a time from where the epoch stands (schedules.cut_window), so the window
size may change inside an epoch (schedule=adaptive, following the noise scale measured by
train/noise_scale.py); with a fixed schedule they are the epoch's plan, window for window.

One step, as ``train()`` runs it: cut a window, run its micro-batches (``run_window``: the
policy's ``should_sync`` for each), step (``optimizer_step``), then hand the window to the
run's callbacks (train/callbacks.py), each owning one feature. Every rank runs the same
collectives in the same order; those of one step, in order (tests/test_loop.py holds it):

1. ``token_count``: loss.normalize=tokens, the window's token count (async, launched before the
   last backward, waited for before the step); inside the window, with the gradient
   all-reduces of the synchronising backwards (the engine's comm hook, which also carries the
   noise scale's big-batch probe)
2. ``doomed_window``: fp16 overflow consensus after each no_sync backward (amp_aware; the
   precision's, train/precision.py)
3. ``overflow_agreement``: fp16, the scaler's found_inf flags after unscaling (the precision's)
4. ``schedule``: schedule=adaptive choosing the next window's size after a step (it flushes
   the noise scale's pending rows when it needs the newest)
5. ``averaging``: the policy's averager (local SGD, DiLoCo, sync.groups with `every`) every H
   windows
6. ``loss``: at a log point, the windows' losses over ranks (the noise scale's rows ride on
   it, and so do the replicas' drifts when the logged windows averaged: a slot per rank, the
   max taken after)
7. ``replica_check``: trainer.check_replicas, every K steps
8. ``evaluation``: trainer.eval_every, every K steps
9. ``stop``: the stop agreement (async, on the control group)
10. ``checkpoint``: at a cadence, a stop, or the end: the rows flushed (the loss), the finite
    check (fp32), the buffers aligned, the checkpoint's gather
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Protocol

import torch
from torch.nn.utils import clip_grad_norm_, get_total_norm
from torch.utils.data import DataLoader, DistributedSampler

from gradsync.config.schema import TrainerConfig
from gradsync.data.loader import epoch_batches
from gradsync.engines.base import Engine
from gradsync.models import PLAIN_CALL, ModelCall
from gradsync.sync.averaging import whole_model
from gradsync.sync.comm import CommCounts
from gradsync.sync.policy import SyncPolicy, last_micro_batch
from gradsync.train.callbacks import Done, callbacks
from gradsync.train.lr_scaling import ScaledLR
from gradsync.train.metrics import RunLog
from gradsync.train.noise_scale import NoiseScale
from gradsync.train.normalize import Normalizer
from gradsync.train.precision import Precision
from gradsync.train.schedules import Schedule, Shard, Window, cut_window, micro_batches


class Stop(Protocol):
    """The ranks' agreement to stop after a signal (run/faults.py StopAgreement)."""

    agreed: int

    def poll(self) -> int: ...

    def close(self) -> None: ...


@dataclass
class Parts:
    """The built objects the loop asks questions of (the worker builds them from the run's
    config), the numbers it runs by, and the worker's hooks."""

    engine: Engine
    optimizer: torch.optim.Optimizer
    # stepped once per optimizer step taken; a ScaledLR when lr_scaling (train/lr_scaling.py)
    lr_scheduler: torch.optim.lr_scheduler.LRScheduler | ScaledLR
    loader: DataLoader
    sampler: DistributedSampler
    schedule: Schedule
    policy: SyncPolicy
    precision: Precision
    loss: Callable[[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]
    evaluate: Callable[[], dict[str, float]]
    normalizer: Normalizer  # what each micro-batch's loss is divided by
    device: torch.device
    trainer: TrainerConfig  # max_epochs, max_steps, cadences, clipping
    world_size: int
    micro_batch_size: int
    total_steps: int  # what max_epochs and max_steps allow: LR horizon, progress bar
    noise: NoiseScale | None = None  # the gradient noise scale's meter, when measured
    call: ModelCall = PLAIN_CALL  # how the model is called, where its logits are (_forward_)
    # --- the worker's hooks (the defaults train without them)
    checkpoint: Callable[[Parts, Progress], None] = lambda p, state: None  # collective
    stop: Stop | None = None  # None: signals are not watched
    after_window: list[Callable[[Parts, Progress, bool], None]] = field(default_factory=list)

    @property
    def counts(self) -> CommCounts:
        return self.engine.counts

    @property
    def check_finite(self) -> bool:
        """A non-finite loss or parameter stops the run (fp32, where nothing should overflow)."""
        return self.precision.name == "fp32"

    @property
    def replica_check_every(self) -> int:
        """Optimizer steps between replica checks (trainer.check_replicas), 0: none (one rank)."""
        return self.trainer.check_replicas if self.world_size > 1 else 0


@dataclass
class Progress:
    step: int = 0  # optimizer steps applied (an AMP-skipped step is not one)
    windows: int = 0  # windows run = optimizer-step attempts, skipped ones included
    epoch: int = 0
    samples_seen: int = 0  # over all ranks, the sampler's repeats not counted
    train_s: float = 0.0  # loop time without evaluation
    last_loss: float = float("nan")
    last_eval: dict[str, float] = field(default_factory=dict)
    epoch_step: int = 0  # windows of the current epoch done
    epoch_micro: int = 0  # micro-batches of the current epoch done: where a resumed epoch starts

    @property
    def skipped_steps(self) -> int:
        return self.windows - self.step

    def advance(self, window: Window, stepped: bool, epoch_end: int) -> bool:
        """Count one window run (stepped: its optimizer step was taken); True when it ended
        the epoch (epoch_end: the epoch's micro-batches)."""
        self.windows += 1
        self.step += stepped
        self.samples_seen += window.global_real
        end = window.stop == epoch_end
        self.epoch += end  # counts completed epochs
        self.epoch_step = 0 if end else self.epoch_step + 1
        self.epoch_micro = 0 if end else window.stop
        return end

    def done(self, tr: TrainerConfig) -> bool:
        return self.epoch >= tr.max_epochs or (tr.max_steps >= 0 and self.step >= tr.max_steps)


class UnsyncedWindow(RuntimeError):
    """A window reached its optimizer step without a synchronising backward: every rank would
    step on its own gradients and the replicas would drift apart silently."""


def unsynced(policy: str, window: Window, last_synced: int) -> str:
    """What went wrong in a window whose last micro-batch ran inside no_sync()."""
    first_local = window.start + last_synced + 1  # the first micro-batch kept local since
    what = ("no micro-batch of the window synchronised: no gradient was all-reduced"
            if last_synced < 0 else
            f"micro-batch {first_local - 1} synchronised, but "
            + ("the last" if first_local == window.stop - 1 else
               f"micro-batches {first_local}-{window.stop - 1} (the last included)")
            + " did not: the gradients accumulated after it were never all-reduced")
    return (f"sync policy {policy!r} ends a window of {window.size} micro-batches "
            f"(micro-batches {window.start}-{window.stop - 1} of the epoch) inside no_sync(): "
            f"{what}, so every rank would step on gradients of its own and the replicas drift "
            "apart (docs/debugging.md). The last micro-batch of a window must synchronise (the "
            "all-reduce of the accumulated gradients is what keeps the replicas equal), or the "
            "policy's averager must keep the whole model consistent itself (whole_model = "
            "True: it averages the parameters)")


def run_window(engine: Engine, batches: Iterator, window: Window,
               policy: SyncPolicy, precision: Precision, loss: Callable,
               device: torch.device, norm: Normalizer,
               meter: NoiseScale | None = None, call: ModelCall = PLAIN_CALL) -> torch.Tensor:
    """Forward+backward every micro-batch of one window; returns this rank's share of the
    window's loss (NaN for a window aborted by overflow consensus: its loss was never computed
    in full). After each backward the precision may find the window doomed (an overflow on some
    rank; every rank agrees): its remaining micro-batches are then drawn from the data stream
    without compute, so the data order never depends on overflows. Only the window's first
    ``window.real`` samples count: the rest are the sampler's repeats, which still run forward
    and backward (a micro-batch of repeats only, too: DDP's collectives must match) with no
    loss. A window whose last micro-batch ran inside no_sync() is refused (UnsyncedWindow)
    unless the policy's averager keeps the whole model consistent (whole_model). `meter`: the
    noise scale's, told each micro-batch's real units before its backward. `call`: how the
    model is called and where its output holds the logits (models.ModelCall)."""
    total = torch.zeros((), device=device)
    if meter is not None:
        meter.start_window()
    size, real_left = window.size, window.real
    should_sync, doomed_after = policy.should_sync, precision.window_doomed
    averaged = whole_model(policy.averager)
    doomed = False
    last_synced = -1  # the window's last micro-batch so far that synchronised
    for i in range(size):
        x, y = next(batches)
        keep = min(real_left, len(y))
        real_left -= keep
        if doomed:
            continue
        x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
        sync = should_sync(i, size)
        if sync:
            last_synced = i
        elif last_micro_batch(i, size) and not averaged:
            raise UnsyncedWindow(unsynced(policy.name, window, last_synced))
        with engine.micro_batch(sync):
            with precision.autocast():
                out = call(engine, x, y)  # the whole micro-batch's targets (_forward_)
                if keep < len(y):
                    out, y = out[:keep], y[:keep]
                sums, counts = loss(out, y)
                micro = norm.micro_loss(window, i, sums, counts)
            if meter is not None:
                meter.before_backward(i, keep, counts, engine.parameters())
            precision.backward(micro)
        total += micro.detach()
        doomed = doomed_after(engine.module, i, size)
    if doomed:
        return torch.full((), float("nan"), device=device)
    return norm.window_loss(total)


def optimizer_step(p: Parts, want_norm: bool) -> tuple[bool, torch.Tensor | None]:
    """Unscale, clip, step, update the scale, zero: once per window. Returns (stepped, norm);
    the norm stays a tensor (on a GPU: no wait for it) until a logging step reads it."""
    p.precision.unscale(p.optimizer)  # the scaler's flags agreed over ranks where needed
    p.normalizer.before_step(p.engine.parameters())
    norm = None
    if p.trainer.clip_grad_norm > 0:
        norm = clip_grad_norm_(p.engine.parameters(), p.trainer.clip_grad_norm)
    elif want_norm:
        norm = get_total_norm([q.grad for q in p.engine.parameters() if q.grad is not None])
    stepped = p.precision.step(p.optimizer)
    policy = p.policy
    if policy.wire is not None:
        policy.wire.after_step(stepped)
    if policy.averager is not None:
        policy.averager.after_step(stepped)
        # an averager of the whole model lets each rank's GradScaler skip its own step: the
        # window counts as a step everywhere (counters, LR schedule, cadences stay the same on
        # every rank)
        stepped = stepped or policy.averager.whole_model
    p.engine.zero_grad(p.optimizer)
    if stepped:
        p.lr_scheduler.step()
    return stepped, norm


def train(p: Parts, state: Progress, log: RunLog) -> Progress:
    """Train from `state` (fresh, or restored from a checkpoint: a resumed epoch starts at its
    next window, skipping the samples already used) until done or until the ranks agree to
    stop (p.stop.agreed). The collectives of one step run in the order of the module's
    docstring."""
    tr, cbs = p.trainer, callbacks(p, log, state)
    done: Done | None = None
    if p.policy.averager is not None:
        p.policy.averager.start(p.engine.module, state.windows)
    while not state.done(tr) and not (done and done.stop):
        epoch, sampler = state.epoch, p.sampler
        shard = Shard(len(sampler.dataset), sampler.rank, sampler.num_replicas)  # type: ignore
        epoch_end = micro_batches(shard, p.micro_batch_size)
        batches = epoch_batches(p.loader, epoch, state.epoch_micro * p.micro_batch_size)
        end_of_epoch = False
        while not end_of_epoch:
            window = cut_window(shard, p.micro_batch_size, state.epoch_micro,
                                p.schedule.accum_steps(epoch))
            t0 = time.perf_counter()
            loss = run_window(p.engine, batches, window, p.policy, p.precision, p.loss,
                              p.device, p.normalizer, p.noise, p.call)
            done = Done(window, epoch, loss, 0.0, (state.windows + 1) % tr.log_every == 0)
            for cb in cbs.before_step:  # the noise scale's window, LR scaling
                cb.before_step(p, state, done)
            done.lr = p.optimizer.param_groups[0]["lr"]
            done.stepped, done.norm = optimizer_step(p, want_norm=done.log_now)
            state.train_s += time.perf_counter() - t0
            end_of_epoch = state.advance(window, done.stepped, epoch_end)
            done.finished = state.done(tr)
            for cb in cbs.after_window:  # averaging, logging, checks, evaluation, stop, ckpt
                cb.after_window(p, state, done)
            if done.stop or done.finished:
                break
    for cb in cbs.end:  # the last rows, the stop's collective in flight, the final evaluation
        cb.end(p, state, done)
    return state
