"""The loop's callbacks: what happens around a window besides its micro-batches and its step.

``train()`` (train/loop.py) cuts a window, runs its micro-batches, steps, and hands the window
to the callbacks that ``callbacks(p, log, state)`` chose for the run, in that order. Each owns
one feature: the noise scale, LR scaling, the adaptive schedule, the policy's averaging,
logging, the worker's hooks, replica checks, evaluation, the stop agreement, checkpoints. A
callback the run does not need is not in the list (no per-window test of a feature that is
off). The order is the order of their collectives, which every rank must run alike
(train/loop.py's docstring lists them).

A callback has up to four methods, each optional: ``before_step(p, state, done)`` (between the
window's last backward and the optimizer step), ``after_window(p, state, done)`` (after the
step and the counters), ``end(p, state, done)`` (once, when training ends: ``done`` is the last
window, or None when none ran).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from gradsync.core.devices import on_device
from gradsync.train.lr_scaling import ScaledLR
from gradsync.train.memory import local
from gradsync.train.metrics import RunLog
from gradsync.train.schedules import AdaptiveSchedule as Adaptive

if TYPE_CHECKING:
    from gradsync.sync.averaging import Averager
    from gradsync.train.loop import Parts, Progress
    from gradsync.train.schedules import Window


@dataclass(slots=True)
class Done:
    """One window, as the callbacks see it after its optimizer step."""

    window: Window
    epoch: int  # the epoch the window belongs to
    loss: torch.Tensor  # this rank's share of the window's loss (a tensor: no host read)
    lr: float  # the learning rate the step used
    log_now: bool  # a log point: the rows so far are written after this window
    stepped: bool = False  # False: fp16 skipped the step
    norm: torch.Tensor | None = None  # the gradient norm, when clipped or logged
    finished: bool = False  # the run is done after this window (max_steps, max_epochs)
    stop: int = 0  # the signal the ranks agreed to stop on, 0: none
    row: dict[str, Any] | None = None  # what the callbacks add to its row (lr_factor, drift)

    def add(self, key: str, value: Any) -> None:
        if self.row is None:
            self.row = {}
        self.row[key] = value


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

    def _drift_slots(self, rows: list[dict[str, Any]]) -> torch.Tensor:
        """Rows of windows that averaged hold this rank's drift: put in this rank's slot of a
        [rows, world] block of zeros, float64 on the model's device (nccl serves no CPU
        tensor), it rides on the losses' all-reduce, after which each row of the block holds
        every rank's drift (every rank averaged at the same windows: the same block shape)."""
        device, rank = self.p.device, dist.get_rank() if self.p.world_size > 1 else 0
        mine = torch.tensor([[r["replica_drift"]] for r in rows], dtype=torch.float64,
                            device=device)
        return torch.where(torch.arange(self.p.world_size, device=device) == rank, mine,
                           0.0).flatten()

    def add(self, row: dict[str, Any], local_loss: torch.Tensor) -> None:
        row |= _spent(self.p, self.state)  # where the run stands on the sweep summary's axes
        self.rows.append(row)
        self.losses.append(local_loss)

    def flush(self, state: Progress, norm: torch.Tensor | None) -> None:
        if not self.rows:
            return
        grad_norm = None if norm is None else float(norm)
        n, world = len(self.losses), self.p.world_size
        averaged = [r for r in self.rows if "replica_drift" in r]
        carry = torch.stack(self.losses).double()
        if averaged:  # the drifts ride on the losses' all-reduce: one collective
            carry = torch.cat([carry, self._drift_slots(averaged)])
        noise = self.p.noise
        if noise is not None:  # the windows' noise-scale rows ride on the same all-reduce
            carry = noise.flush(carry)  # type: ignore[assignment]
        elif world > 1:
            dist.all_reduce(carry)
        # the mean loss over ranks, and each averaging's max drift over ranks: one host read
        read = torch.cat([carry[:n] / world, carry[n:].view(-1, world).amax(1)]).tolist()
        for row, loss in zip(self.rows, read[:n], strict=True):
            row["loss"] = loss
            if noise is not None:
                row |= noise.take(row["window"])
        for row, drift in zip(averaged, read[n:], strict=True):
            row["replica_drift"] = drift
            self.log.scalars(row["window"], {"sync/replica_drift": drift})
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
        scalars |= {f"noise/{k}": v for k, v in last.items()
                    if k in NOISE_SCALARS and v is not None}  # None: B_simple has no value
        if self.p.device.type == "cuda":  # rank 0's (mem/peak_mb's reading of torch's
            # counter); every rank's is in summary.json
            scalars["perf/peak_gpu_mem_mb"] = scalars["mem/peak_mb"]
        if self.p.precision.scaler is not None:
            scalars["amp/scale"] = self.p.precision.scale
            scalars["amp/skipped_steps"] = state.skipped_steps
            scalars["amp/aborted_windows"] = self.p.precision.overflow.aborted_windows
            scalars["comm/allreduce_skipped"] = self.p.precision.overflow.allreduce_skipped
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
    """Cumulative bytes (this rank's: all-reduce, and every collective) and loop seconds: the
    x-axes, besides samples, on which the sweep summary compares runs."""
    return {"allreduce_bytes": p.counts.allreduce_bytes, "sent_bytes": p.counts.sent_bytes,
            "train_s": state.train_s}


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


class NoiseWindow:
    """The gradient noise scale's window end (train/noise_scale.py), before the step."""

    def before_step(self, p: Parts, state: Progress, done: Done) -> None:
        p.noise.end_window(state.windows + 1, done.window, p.normalizer,  # type: ignore[union-attr,arg-type]
                           p.precision, p.engine.parameters())


class LRScaling:
    """lr_scaling: the LR of this window's step, from its size (train/lr_scaling.py)."""

    def before_step(self, p: Parts, state: Progress, done: Done) -> None:
        done.add("lr_factor", p.lr_scheduler.before_step(  # type: ignore[union-attr]
            done.window, p.noise))


class AdaptiveSchedule:
    """schedule=adaptive may choose the next window's size after a step (collective)."""

    def after_window(self, p: Parts, state: Progress, done: Done) -> None:
        if done.stepped:
            p.schedule.after_step(state.step, p.noise)


class Averaging:
    """The policy's averager after windows (local SGD's and DiLoCo's averaging, sync.groups
    with `every`), and its last averaging when the run finishes."""

    def __init__(self, averager: Averager):
        self.averager = averager

    def after_window(self, p: Parts, state: Progress, done: Done) -> None:
        averager = self.averager
        averager.after_window(p.engine.module, state.windows)
        if done.finished:
            averager.finish(p.engine.module)  # e.g. local SGD ends with an averaging
        drift = averager.drift
        if drift is not None:
            done.add("replica_drift", drift)


class Logging:
    """The window's row of metrics.jsonl, written with the others at each log point."""

    def __init__(self, p: Parts, log: RunLog, state: Progress):
        self.steps = StepLog(p, log, state)
        self.trace = p.engine.trace

    def after_window(self, p: Parts, state: Progress, done: Done) -> None:
        window = done.window
        row: dict[str, Any] = {"window": state.windows, "step": state.step, "epoch": done.epoch,
               "accum_steps": window.size, "samples": state.samples_seen, "lr": done.lr,
               "stepped": done.stepped}
        if done.row:
            row |= done.row
        trace = self.trace
        if trace is not None:  # this step's wait for all-reduces, overlap (trace_sync)
            row |= {f"sync_{k}": v for k, v in trace.last.items()}
            if "replica_drift" in row:
                trace.mark("models averaged", {"replica_drift": row["replica_drift"]})
        self.steps.add(row, done.loss)
        if done.log_now:
            self.steps.flush(state, done.norm)

    def end(self, p: Parts, state: Progress, done: Done | None) -> None:
        self.steps.flush(state, None)


class Hooks:
    """The worker's hooks (Parts.after_window: an injected failure, trainer.fail_at_step)."""

    def __init__(self, hooks: list[Callable[[Parts, Progress, bool], None]]):
        self.hooks = hooks

    def after_window(self, p: Parts, state: Progress, done: Done) -> None:
        for hook in self.hooks:
            hook(p, state, done.stepped)


class ReplicaCheck:
    """trainer.check_replicas: every K steps, the replicas' checksums compared (collective)."""

    def __init__(self, every: int):
        self.every = every

    def after_window(self, p: Parts, state: Progress, done: Done) -> None:
        averager = p.policy.averager
        if (done.stepped and state.step % self.every == 0
                and (averager is None or averager.in_sync())):
            check_replicas(p.engine.module, state.step)


class Evaluation:
    """trainer.eval_every (in optimizer steps), and once at the end unless the last step was
    just evaluated or the run stopped on a signal."""

    def __init__(self, log: RunLog):
        self.log = log

    def after_window(self, p: Parts, state: Progress, done: Done) -> None:
        every = p.trainer.eval_every
        if every and done.stepped and state.step % every == 0:
            evaluate(p, state, self.log)

    def end(self, p: Parts, state: Progress, done: Done | None) -> None:
        every = p.trainer.eval_every
        if (done is None or not done.stop) and not (every and state.step
                                                     and state.step % every == 0):
            evaluate(p, state, self.log)


class StopPoll:
    """The ranks' agreement to stop after a signal (collective: run/faults.py)."""

    def after_window(self, p: Parts, state: Progress, done: Done) -> None:
        done.stop = p.stop.poll()  # type: ignore[union-attr]

    def end(self, p: Parts, state: Progress, done: Done | None) -> None:
        p.stop.close()  # type: ignore[union-attr]


class Checkpoint:
    """trainer.checkpoint_every (in optimizer steps), at a stop and at the end: every row up to
    the step written first, the parameters checked finite (fp32), the buffers aligned."""

    def __init__(self, logging: Logging):
        self.logging = logging

    def after_window(self, p: Parts, state: Progress, done: Done) -> None:
        every = p.trainer.checkpoint_every
        if done.stop or done.finished or (every and done.stepped and state.step % every == 0):
            self.logging.steps.flush(state, None)  # a checkpoint covers every row up to its step
            if p.check_finite:
                require_finite_parameters(p.engine.module, state.step)
            p.engine.align_buffers()  # the saved buffers are the ones every rank holds
            p.checkpoint(p, state)


@dataclass
class Callbacks:
    """The run's callbacks by phase, each list in the order its collectives run."""

    before_step: list[Any]
    after_window: list[Any]
    end: list[Any]


def callbacks(p: Parts, log: RunLog, state: Progress) -> Callbacks:
    """The run's callbacks: only those of features the run uses (train/loop.py's docstring
    lists the order of their collectives)."""
    logging = Logging(p, log, state)
    before: list[Any] = []
    if p.noise is not None:
        before.append(NoiseWindow())
    if isinstance(p.lr_scheduler, ScaledLR):
        before.append(LRScaling())
    after: list[Any] = [AdaptiveSchedule()] if isinstance(p.schedule, Adaptive) else []
    if p.policy.averager is not None:
        after.append(Averaging(p.policy.averager))
    after.append(logging)
    if p.after_window:
        after.append(Hooks(p.after_window))
    if p.replica_check_every:
        after.append(ReplicaCheck(p.replica_check_every))
    evaluation = Evaluation(log)
    after.append(evaluation)
    end: list[Any] = [logging]
    if p.stop is not None:
        after.append(StopPoll())
        end.append(after[-1])
    after.append(Checkpoint(logging))
    return Callbacks(before, after, end + [evaluation])
