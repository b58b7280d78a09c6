"""The training loop: micro-batches grouped into windows, one optimizer step per window.

For every micro-batch the sync policy decides whether its forward+backward runs inside
``no_sync()``. Each micro-batch's summed loss is divided by the number of real samples its
window holds over all ranks, over the world size, and DDP averages over ranks, so each step
applies the gradient of the mean loss over every real sample of the window on every rank, a
short last window included. The samples the sampler repeats to give every rank the same number
of micro-batches (data not a multiple of the world size) still run forward and backward (DDP's
collectives must match) but are left out of the loss (windows.Shard says which they are).
Token-normalised losses, whose count is only known at the window's end, are rescaled once
before the step (normalize.py).

Two counters: ``windows`` counts optimizer-step attempts (one per window: the log cadence and the
x-axis of TensorBoard); ``step`` counts optimizer steps applied. With fp16 the GradScaler skips
the step of a window whose gradients hold inf/nan: such a window advances ``windows`` but neither
``step`` nor the LR scheduler, so the LR schedule, ``max_steps`` and ``eval_every_steps`` count only
real updates (Lightning #5558 stepped the scheduler anyway).

Windows are cut one at a time from where the epoch stands (windows.py), so the window size may
change inside an epoch (schedule=adaptive, following the noise scale measured by
train/noise_scale.py); with a fixed schedule they are the epoch's plan, window for window.

``train()`` is gradsync's own loop, written with the pieces an own loop uses too
(docs/own-loop.md): the windows of a loader, each micro-batch under the policy's decision
(run_window), the optimizer step; then each feature, called by name where it runs. Every
rank runs the same collectives in the same order; those of one step,
in order (tests/test_loop.py holds it):

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
8. ``evaluation``: trainer.eval_every_steps, every K steps
9. ``stop``: the stop agreement (async, on the control group)
10. ``checkpoint``: at a cadence, a stop, or the end: the rows flushed (the loss), the finite
    check (fp32), the buffers aligned, the checkpoint's gather
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from typing import Any, Protocol

import torch
import torch.distributed as dist
from torch.nn.utils import clip_grad_norm_, get_total_norm
from torch.utils.data import DataLoader, DistributedSampler

from gradsync.config.schema import TrainerConfig
from gradsync.engines.base import Engine
from gradsync.models import PLAIN_CALL, ModelCall
from gradsync.sync.averaging import Averager
from gradsync.sync.comm import CommCounts
from gradsync.sync.policy import SyncPolicy
from gradsync.train.checks import check_replicas, require_finite_parameters
from gradsync.train.lr_scaling import ScaledLR
from gradsync.train.metrics import RunLog
from gradsync.train.noise_scale import NoiseScale
from gradsync.train.normalize import Normalizer
from gradsync.train.precision import Precision
from gradsync.train.schedules import Schedule
from gradsync.train.steplog import StepLog, spent
from gradsync.train.windows import Window, windows


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
    # what this rank computes with (core/numerics.py fingerprint): checkpoints and the summary
    numerics: dict[str, Any] = field(default_factory=dict)
    call: ModelCall = PLAIN_CALL  # how the model is called, where its logits are (_forward_)
    # --- the worker's hooks (the defaults train without them)
    checkpoint: Callable[[Parts, Progress], None] = lambda p, state: None  # collective
    stop: Stop | None = None  # None: signals are not watched

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
    epoch_windows: int = 0  # windows of the current epoch done
    epoch_micro: int = 0  # micro-batches of the current epoch done: where a resumed epoch starts

    @property
    def skipped_steps(self) -> int:
        return self.windows - self.step

    def advance(self, window: Window, stepped: bool) -> None:
        """Count one window run (stepped: its optimizer step was taken)."""
        self.windows += 1
        self.step += stepped
        self.samples_seen += window.global_real
        self.epoch += window.ends_epoch  # counts completed epochs
        self.epoch_windows = 0 if window.ends_epoch else self.epoch_windows + 1
        self.epoch_micro = 0 if window.ends_epoch else window.stop

    def finished(self, tr: TrainerConfig) -> bool:
        """max_epochs or max_steps reached."""
        return self.epoch >= tr.max_epochs or (tr.max_steps >= 0 and self.step >= tr.max_steps)


def due(step: int, every: int) -> bool:
    """A cadence in optimizer steps (every 0: never)."""
    return every > 0 and step % every == 0


def train(p: Parts, state: Progress, log: RunLog) -> Progress:
    """Train from `state` (fresh, or restored from a checkpoint: a resumed epoch starts at its
    next window, skipping the samples already used) until finished or until the ranks agree to
    stop. The collectives of one step run in the order of the module's docstring."""
    tr, model = p.trainer, p.engine.module
    averager = p.policy.averager or Averager()  # the base: averages nothing
    rows = StepLog(p, log, state)
    averager.start(model, state.windows)
    stop = 0
    while not (state.finished(tr) or stop):
        epoch = state.epoch
        for window in windows(p.loader, epoch, partial(p.schedule.window_size, epoch),
                              state.epoch_micro, p.device):
            t0 = time.perf_counter()
            loss = run_window(p.engine, window, p.policy, p.loss, p.normalizer,  # 1, 2
                              p.precision, p.noise, p.call)
            lr_factor = before_step(p, state, window)  # the noise scale's norms, LR scaling
            lr = p.optimizer.param_groups[0]["lr"]
            log_now = (state.windows + 1) % tr.log_every_windows == 0
            stepped, norm = optimizer_step(  # 3
                p.engine, p.optimizer, p.policy, p.normalizer, precision=p.precision,
                clip_grad_norm=tr.clip_grad_norm, lr_scheduler=p.lr_scheduler,
                want_norm=log_now)
            state.advance(window, stepped)
            finished = state.finished(tr)
            if stepped:
                p.schedule.after_step(state.step, p.noise)  # 4
            drift = average(averager, model, state.windows, finished)  # 5
            # training seconds: the window, the step and the averaging (local SGD's, DiLoCo's
            # rounds are what those policies pay instead of syncs: over a slow link, seconds)
            state.train_s += time.perf_counter() - t0
            rows.add(state, window, epoch, lr, stepped, loss, lr_factor, drift)
            if log_now:
                rows.flush(state, norm)  # 6
            fail_if_asked(tr, state.step, stepped, p.world_size)
            if stepped and due(state.step, p.replica_check_every) and averager.in_sync():
                check_replicas(model, state.step)  # 7
            if stepped and due(state.step, tr.eval_every_steps):
                evaluate(p, state, log)  # 8
            stop = p.stop.poll() if p.stop is not None else 0  # 9
            if stop or finished or (stepped and due(state.step, tr.checkpoint_every_steps)):
                save_checkpoint(p, state, rows)  # 10
            if stop or finished:
                break
    return finish(p, state, rows, log, stop)


def run_window(engine: Engine, window: Window, policy: SyncPolicy, loss: Callable[..., Any],
               normalizer: Normalizer, precision: Precision | None = None,
               meter: NoiseScale | None = None, call: ModelCall = PLAIN_CALL) -> torch.Tensor:
    """Forward+backward every micro-batch of one window, each under the policy's decision;
    returns this rank's share of the window's loss (NaN for a window aborted by overflow
    consensus: its loss was never computed in full). `loss(outputs, targets)` gives the
    micro-batch's per-sample loss sums and unit counts (the data contract, data/contract.py).
    After each backward the precision may find the window doomed (an overflow on some rank;
    every rank agrees): its remaining micro-batches are then drawn from the data stream without
    compute, so the data order never depends on overflows. The sampler's repeats still run
    forward and backward (a micro-batch of repeats only, too: DDP's collectives must match)
    with no loss. The noise scale's `meter` is told each micro-batch's real units before its
    backward. `call`: how the model is called (its targets given where it takes them) and where
    its output holds the logits (models.ModelCall; plain: ``engine(x)``)."""
    precision = precision or Precision("fp32", "cpu")  # fp32: no autocast, no scaler
    total = torch.zeros((), device=window.device)
    if meter is not None:
        meter.start_window()
    doomed = False
    for micro in window:
        if doomed:
            continue
        with engine.micro_batch(window.should_sync(policy, micro)):
            with precision.autocast():
                out = call(engine, micro.x, micro.targets)  # every sample's targets
                sums, counts = loss(micro.real(out), micro.y)
                micro_loss = normalizer.micro_loss(window, micro.index, sums, counts)
            if meter is not None:
                meter.before_backward(micro.index, len(micro.y), counts, engine.parameters())
            precision.backward(micro_loss)
        total += micro_loss.detach()
        doomed = precision.window_doomed(engine.module, micro.index, window.size)
    if doomed:
        return torch.full((), float("nan"), device=window.device)
    return normalizer.window_loss(total)


def optimizer_step(engine: Engine, optimizer: torch.optim.Optimizer, policy: SyncPolicy,
                   normalizer: Normalizer, *, precision: Precision | None = None,
                   clip_grad_norm: float = 0.0, lr_scheduler: Any = None,
                   want_norm: bool = False) -> tuple[bool, torch.Tensor | None]:
    """The window's optimizer step, once per window: unscale (fp16), the loss normaliser's
    rescale, clip, step, the policy's roles told, gradients zeroed, the LR scheduler stepped
    when the step was taken. Returns (stepped, the gradient norm when clipped or
    `want_norm`); the norm stays a tensor (on a GPU: no wait for it) until it is read."""
    if precision is not None:
        precision.unscale(optimizer)  # the scaler's flags agreed over ranks where needed
    normalizer.before_step(engine.parameters())
    norm = None
    if clip_grad_norm > 0:
        norm = clip_grad_norm_(engine.parameters(), clip_grad_norm)
    elif want_norm:
        norm = get_total_norm([q.grad for q in engine.parameters() if q.grad is not None])
    if precision is not None:
        stepped = precision.step(optimizer)
    else:
        optimizer.step()
        stepped = True
    if policy.wire is not None:
        policy.wire.after_step(stepped)
    if policy.averager is not None:
        policy.averager.after_step(stepped)
        # an averager of the whole model lets each rank's GradScaler skip its own step: the
        # window counts as a step everywhere (counters, LR schedule, cadences stay the same on
        # every rank)
        stepped = stepped or policy.averager.whole_model
    engine.zero_grad(optimizer)
    if stepped and lr_scheduler is not None:
        lr_scheduler.step()
    return stepped, norm


def before_step(p: Parts, state: Progress, window: Window) -> float | None:
    """Between the window's last backward and its step: the noise scale's norms of the window
    (noise_scale.enabled), and LR scaling's factor for its size (lr_scaling: returned)."""
    if p.noise is not None:
        p.noise.end_window(state.windows + 1, window, p.normalizer,  # type: ignore[arg-type]
                           p.precision, p.engine.parameters())
    if isinstance(p.lr_scheduler, ScaledLR):
        return p.lr_scheduler.before_step(window, p.noise)
    return None


def average(averager: Averager, model: torch.nn.Module, windows_done: int,
            finished: bool) -> float | None:
    """The policy's averager after a window (local SGD's and DiLoCo's averaging, sync.groups
    with `every`), and its last averaging when the run finishes; the replicas' drift when it
    averaged."""
    averager.after_window(model, windows_done)
    if finished:
        averager.finish(model)  # e.g. local SGD ends with an averaging
    return averager.drift


def fail_if_asked(tr: TrainerConfig, step: int, stepped: bool, world_size: int) -> None:
    """trainer.fail_at_step, a test aid: the last rank raises after that optimizer step."""
    last_rank = (dist.get_rank() if world_size > 1 else 0) == world_size - 1
    if stepped and step == tr.fail_at_step and last_rank:
        raise RuntimeError(f"injected failure after optimizer step {step} "
                           "(trainer.fail_at_step, a test aid)")


def evaluate(p: Parts, state: Progress, log: RunLog) -> None:
    p.engine.align_buffers()  # each rank scores its shard with the buffers that are saved
    state.last_eval = p.evaluate()
    log.scalars(state.windows, {f"eval/{k}": v for k, v in state.last_eval.items()})
    log.evals({"window": state.windows, "step": state.step, "samples": state.samples_seen,
               **spent(p, state), **state.last_eval})


def save_checkpoint(p: Parts, state: Progress, rows: StepLog) -> None:
    """Every row up to the step written first, the parameters checked finite (fp32), the
    buffers aligned, then the worker's checkpoint (collective)."""
    rows.flush(state, None)  # a checkpoint covers every row up to its step
    if p.check_finite:
        require_finite_parameters(p.engine.module, state.step)
    p.engine.align_buffers()  # the saved buffers are the ones every rank holds
    p.checkpoint(p, state)


def finish(p: Parts, state: Progress, rows: StepLog, log: RunLog, stop: int) -> Progress:
    """When training ends: the last rows, the stop agreement's collective in flight closed, the
    final evaluation (unless the last step was just evaluated, or the run stopped on a
    signal)."""
    rows.flush(state, None)
    if p.stop is not None:
        p.stop.close()
    if not stop and not (state.step and due(state.step, p.trainer.eval_every_steps)):
        evaluate(p, state, log)
    return state
