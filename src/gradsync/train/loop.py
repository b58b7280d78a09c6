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
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
import torch.distributed as dist
from torch.nn.utils import clip_grad_norm_, get_total_norm
from torch.utils.data import DataLoader, DistributedSampler

from gradsync.config.schema import TrainerConfig
from gradsync.core.devices import on_device
from gradsync.data.loader import epoch_batches
from gradsync.engines.base import Engine
from gradsync.sync.comm import CommCounts
from gradsync.sync.policy import SyncPolicy
from gradsync.train.lr_scaling import ScaledLR
from gradsync.train.memory import local
from gradsync.train.metrics import RunLog, peak_memory_mb
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
    def check_replicas(self) -> int:
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
            "policy must set syncs_parameters = True and average the parameters itself")


def run_window(engine: Engine, batches: Iterator, window: Window,
               policy: SyncPolicy, precision: Precision, loss: Callable,
               device: torch.device, norm: Normalizer,
               meter: NoiseScale | None = None) -> torch.Tensor:
    """Forward+backward every micro-batch of one window; returns this rank's share of the
    window's loss (NaN for a window aborted by overflow consensus: its loss was never computed
    in full). After each backward the policy may find the window doomed (an overflow on some
    rank; every rank agrees): its remaining micro-batches are then drawn from the data stream
    without compute, so the data order never depends on overflows. Only the window's first
    ``window.real`` samples count: the rest are the sampler's repeats, which still run forward
    and backward (a micro-batch of repeats only, too: DDP's collectives must match) with no
    loss. A window whose last micro-batch ran inside no_sync() is refused (UnsyncedWindow)
    unless the policy keeps the replicas consistent itself (syncs_parameters). `meter`: the
    noise scale's, told each micro-batch's real units before its backward."""
    total = torch.zeros((), device=device)
    if meter is not None:
        meter.start_window()
    doomed = False
    real_left = window.real
    last_synced = -1  # the window's last micro-batch so far that synchronised
    for i in range(window.size):
        x, y = next(batches)
        keep = min(real_left, len(y))
        real_left -= keep
        if doomed:
            continue
        x, y = x.to(device, non_blocking=True), y[:keep].to(device, non_blocking=True)
        sync = policy.should_sync(i, window.size)
        if sync:
            last_synced = i
        elif i == window.size - 1 and not policy.syncs_parameters:
            raise UnsyncedWindow(unsynced(policy.name, window, last_synced))
        with engine.micro_batch(sync):
            with precision.autocast():
                out = engine(x)
                sums, counts = loss(out if keep == len(out) else out[:keep], y)
                micro = norm.micro_loss(window, i, sums, counts)
            if meter is not None:
                meter.before_backward(i, keep, counts, engine.parameters())
            precision.backward(micro)
        total += micro.detach()
        doomed = policy.window_doomed(engine.module, i, window.size)
    if doomed:
        return torch.full((), float("nan"), device=device)
    return norm.window_loss(total)


def optimizer_step(p: Parts, want_norm: bool) -> tuple[bool, torch.Tensor | None]:
    """Unscale, clip, step, update the scale, zero: once per window. Returns (stepped, norm);
    the norm stays a tensor (on a GPU: no wait for it) until a logging step reads it."""
    p.policy.agree_on_overflow(p.precision.unscale(p.optimizer))
    p.normalizer.before_step(p.engine.parameters())
    norm = None
    if p.trainer.clip_grad_norm > 0:
        norm = clip_grad_norm_(p.engine.parameters(), p.trainer.clip_grad_norm)
    elif want_norm:
        norm = get_total_norm([q.grad for q in p.engine.parameters() if q.grad is not None])
    stepped = p.precision.step(p.optimizer)
    p.policy.after_step(stepped)
    # a policy that syncs parameters lets each rank's GradScaler skip its own step: the window
    # counts as a step everywhere (counters, LR schedule, cadences stay the same on every rank)
    stepped = stepped or p.policy.syncs_parameters
    p.engine.zero_grad(p.optimizer)
    if stepped:
        p.lr_scheduler.step()
    return stepped, norm


# the noise scale's fields of a metrics row that TensorBoard gets (of the log point's window)
NOISE_SCALARS = ("grad_sq_small", "grad_sq_big", "grad_norm_sq_window", "grad_trace_cov_window",
                 "grad_norm_sq", "grad_trace_cov", "noise_scale")


class StepLog:
    """Per-step rows kept until the next log point, then their losses are averaged over ranks
    in one all-reduce (not one per step) and written."""

    def __init__(self, p: Parts, log: RunLog, state: Progress):
        self.p, self.log, self.state = p, log, state
        self.rows: list[dict[str, Any]] = []
        self.losses: list[torch.Tensor] = []
        self.mark_t, self.mark_samples = state.train_s, state.samples_seen

    def _max_drift_over_ranks(self) -> None:
        """Rows of windows that averaged hold this rank's drift: the max over ranks replaces
        it (every rank averaged at the same windows, so all join this all-reduce or none)."""
        rows = [r for r in self.rows if "replica_drift" in r]
        if not rows:
            return
        # on the model's device: nccl (or a cuda:gloo group) serves no CPU tensor
        drifts = torch.tensor([r["replica_drift"] for r in rows], dtype=torch.float64,
                              device=self.p.device)
        if self.p.world_size > 1:
            dist.all_reduce(drifts, op=dist.ReduceOp.MAX)
        for row, drift in zip(rows, drifts.tolist(), strict=True):
            row["replica_drift"] = drift
            self.log.scalars(row["window"], {"sync/replica_drift": drift})

    def add(self, row: dict[str, Any], local_loss: torch.Tensor) -> None:
        # where the run stands on the sweep summary's other axes (rank 0's bytes, loop time)
        row |= _spent(self.p, self.state)
        self.rows.append(row)
        self.losses.append(local_loss)

    def flush(self, state: Progress, norm: torch.Tensor | None) -> None:
        if not self.rows:
            return
        grad_norm = None if norm is None else float(norm)
        losses = torch.stack(self.losses).double()
        noise = self.p.noise
        if noise is not None:  # the windows' noise-scale rows ride on the same all-reduce
            losses = noise.flush(losses)  # type: ignore[assignment]
        elif self.p.world_size > 1:
            dist.all_reduce(losses)
        if self.p.world_size > 1:
            losses /= self.p.world_size
        for row, loss in zip(self.rows, losses.tolist(), strict=True):
            row["loss"] = loss
            if noise is not None:
                row |= noise.take(row["window"])
        self._max_drift_over_ranks()
        for row in self.rows:  # rank 0's, every step (engine.trace_sync; None on CUDA: n/a)
            traced = {f"sync/{k[5:]}": row[k] for k in ("sync_wait_ms", "sync_overlap")
                      if row.get(k) is not None}
            if traced:
                self.log.scalars(row["window"], traced)
        bad = next((r for r in self.rows if not math.isfinite(r["loss"])), None)
        state.last_loss = self.rows[-1]["loss"]
        elapsed = state.train_s - self.mark_t
        sps = (state.samples_seen - self.mark_samples) / elapsed if elapsed > 0 else 0.0
        self.mark_t, self.mark_samples = state.train_s, state.samples_seen
        last = self.rows[-1]
        last["samples_per_s"] = sps
        if grad_norm is not None:
            last["grad_norm"] = grad_norm
        self.log.steps(self.rows)
        c = self.p.counts
        scalars = {
            "train/loss": last["loss"], "train/lr": last["lr"], "perf/samples_per_s": sps,
            "train/accum_steps": last["accum_steps"], "comm/sync_backwards": c.sync_backwards,
            "comm/allreduce_calls": c.allreduce_calls, "comm/allreduce_bytes": c.allreduce_bytes,
        } | {f"comm/bytes/{g}": nbytes for g, (_, nbytes) in c.groups.items()} \
          | c.sharded_scalars() | self.p.engine.memory.scalars()
        if grad_norm is not None:
            scalars["train/grad_norm"] = grad_norm
        if "lr_factor" in last:
            scalars["train/lr_factor"] = last["lr_factor"]
        scalars |= {f"noise/{k}": v for k, v in last.items() if k in NOISE_SCALARS}
        if self.p.device.type == "cuda":  # rank 0's; every rank's is in summary.json
            scalars["perf/peak_gpu_mem_mb"] = peak_memory_mb(self.p.device)
        if self.p.precision.scaler is not None:
            scalars["amp/scale"] = self.p.precision.scale
            scalars["amp/skipped_steps"] = state.skipped_steps
            scalars["amp/aborted_windows"] = self.p.policy.overflow.aborted_windows
            scalars["comm/allreduce_skipped"] = self.p.policy.overflow.allreduce_skipped
        self.log.scalars(state.windows, scalars)
        self.rows, self.losses = [], []
        if bad is not None and self.p.check_finite:
            raise FloatingPointError(
                f"non-finite training loss ({bad['loss']}) at optimizer step {bad['step']} "
                "(fp32); stopped, the last good checkpoint stays in checkpoints/")


def require_finite_parameters(model: torch.nn.Module, step: int) -> None:
    """No checkpoint of a diverged model: the step's loss may still have been finite. Collective
    where a process group is up: replicas that train apart (local SGD, DiLoCo, `every` groups)
    differ between averagings, so one rank's parameters may go non-finite alone; every rank's
    verdict goes into one all-reduce (a slot per rank: who diverged), so all ranks stop together
    with the same line instead of the others waiting in the checkpoint's gather. A sharded
    engine's rank checks its shards."""
    finite = torch.stack([torch.isfinite(t).all() for q in model.parameters()
                          if (t := local(q)) is not None]).all()
    world = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
    bad = torch.zeros(world, dtype=torch.int32, device=finite.device)
    bad[dist.get_rank() if world > 1 else 0] = ~finite
    if world > 1:
        dist.all_reduce(bad)
    ranks = [r for r, b in enumerate(bad.tolist()) if b]  # one read of the GPU
    if ranks:
        where = f" on rank {', '.join(map(str, ranks))}" if world > 1 else ""
        raise FloatingPointError(f"non-finite parameters{where} after optimizer step {step} "
                                 "(fp32); stopped, the last good checkpoint stays in "
                                 "checkpoints/")


def _spent(p: Parts, state: Progress) -> dict[str, Any]:
    """Cumulative all-reduce bytes (this rank's) and loop seconds: the x-axes, besides samples,
    on which the sweep summary compares runs."""
    return {"allreduce_bytes": p.counts.allreduce_bytes, "train_s": state.train_s}


def evaluate(p: Parts, state: Progress, log: RunLog) -> None:
    p.engine.align_buffers()  # each rank scores its shard with the buffers that are saved
    state.last_eval = p.evaluate()
    log.scalars(state.windows, {f"eval/{k}": v for k, v in state.last_eval.items()})
    log.evals({"window": state.windows, "step": state.step, "samples": state.samples_seen,
               **_spent(p, state), **state.last_eval})


def check_replicas(model: torch.nn.Module, step: int) -> None:
    """A cheap cross-rank checksum of every parameter (its sum and sum of squares in float64,
    gathered from every rank): replicas that should be equal are bitwise equal, so any
    difference names a parameter that drifted (trainer.check_replicas). Gathered on the
    parameters' device (nccl serves no CPU tensor), read on the host once."""
    named = list(model.named_parameters())
    mine = torch.stack([torch.stack([q.detach().double().sum(), q.detach().double().square().sum()])
                        for _, q in named])
    world = dist.get_world_size()
    every = [torch.empty_like(mine) for _ in range(world)]
    dist.all_gather(every, on_device(mine, named[0][1].device))
    every = list(torch.stack(every).cpu())
    for rank in range(1, world):
        differs = (every[rank] != every[0]).any(dim=1).nonzero()
        if len(differs):
            name = named[int(differs[0])][0]
            raise RuntimeError(f"replicas differ after optimizer step {step}: parameter {name!r} "
                               f"on rank {rank} is not rank 0's (trainer.check_replicas)")


def train(p: Parts, state: Progress, log: RunLog) -> Progress:
    """Train from `state` (fresh, or restored from a checkpoint: a resumed epoch starts at its
    next window, skipping the samples already used) until done or until the ranks agree to
    stop (p.stop.agreed)."""
    tr = p.trainer
    steps = StepLog(p, log, state)
    stop = 0
    p.policy.start(p.engine.module, state.windows)
    while not state.done(tr) and not stop:
        epoch = state.epoch
        shard = Shard(len(p.sampler.dataset), p.sampler.rank,  # type: ignore[arg-type]
                      p.sampler.num_replicas)
        epoch_end = micro_batches(shard, p.micro_batch_size)
        batches = epoch_batches(p.loader, epoch, state.epoch_micro * p.micro_batch_size)
        end_of_epoch = False
        while not end_of_epoch:
            window = cut_window(shard, p.micro_batch_size, state.epoch_micro,
                                p.schedule.accum_steps(epoch))
            t0 = time.perf_counter()
            local_loss = run_window(p.engine, batches, window, p.policy, p.precision, p.loss,
                                    p.device, p.normalizer, p.noise)
            if p.noise is not None:
                p.noise.end_window(state.windows + 1, window, p.normalizer,  # type: ignore[arg-type]
                                   p.precision, p.engine.parameters())
            factor = None
            if isinstance(p.lr_scheduler, ScaledLR):
                factor = p.lr_scheduler.before_step(window, p.noise)
            lr = p.optimizer.param_groups[0]["lr"]
            log_now = (state.windows + 1) % tr.log_every == 0
            stepped, norm = optimizer_step(p, want_norm=log_now)
            state.train_s += time.perf_counter() - t0
            state.windows += 1
            state.step += stepped
            state.samples_seen += window.global_real
            end_of_epoch = window.stop == epoch_end
            state.epoch = epoch + end_of_epoch  # counts completed epochs
            state.epoch_step = 0 if end_of_epoch else state.epoch_step + 1
            state.epoch_micro = 0 if end_of_epoch else window.stop
            if stepped:  # schedule=adaptive may choose the next window's size (collective)
                p.schedule.after_step(state.step, p.noise)
            finished = state.done(tr)
            p.policy.after_window(p.engine.module, state.windows)
            if finished:
                p.policy.finish(p.engine.module)  # e.g. local SGD ends with an averaging
            row = {"window": state.windows, "step": state.step, "epoch": epoch,
                   "accum_steps": window.size, "samples": state.samples_seen, "lr": lr,
                   "stepped": stepped}
            if factor is not None:
                row["lr_factor"] = factor
            if p.policy.replica_drift is not None:
                row["replica_drift"] = p.policy.replica_drift
            trace = getattr(p.engine, "trace", None)
            if trace is not None:  # this step's wait for all-reduces, overlap (trace_sync)
                row |= {f"sync_{k}": v for k, v in trace.last.items()}
                if p.policy.replica_drift is not None:
                    trace.mark("models averaged", {"replica_drift": p.policy.replica_drift})
            steps.add(row, local_loss)
            if log_now:
                steps.flush(state, norm)
            for hook in p.after_window:
                hook(p, state, stepped)
            if (p.check_replicas and stepped and state.step % p.check_replicas == 0
                    and p.policy.replicas_in_sync()):
                check_replicas(p.engine.module, state.step)
            if tr.eval_every and stepped and state.step % tr.eval_every == 0:
                evaluate(p, state, log)
            stop = p.stop.poll() if p.stop else 0
            if stop or finished or (tr.checkpoint_every and stepped
                                    and state.step % tr.checkpoint_every == 0):
                steps.flush(state, None)  # a checkpoint covers every row up to its step
                if p.check_finite:
                    require_finite_parameters(p.engine.module, state.step)
                p.engine.align_buffers()  # the saved buffers are the ones every rank holds
                p.checkpoint(p, state)
            if stop or finished:
                break
    steps.flush(state, None)
    if p.stop:
        p.stop.close()
    if not stop and not (tr.eval_every and state.step and state.step % tr.eval_every == 0):
        evaluate(p, state, log)
    return state
