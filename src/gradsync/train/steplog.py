"""The rows of metrics.jsonl: one per window, kept until the next log point
(trainer.log_every_windows), when their losses (and the replicas' drifts, and the noise
scale's rows) are reduced over the ranks in one all-reduce and written, with TensorBoard's
scalars."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from gradsync.train.metrics import RunLog

if TYPE_CHECKING:
    from gradsync.train.loop import Parts, Progress
    from gradsync.train.windows import Window


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

    def add(self, state: Progress, window: Window, epoch: int, lr: float, stepped: bool,
            local_loss: torch.Tensor, lr_factor: float | None, drift: float | None) -> None:
        """The row of the window just stepped: where the run stands, the step's LR (and LR
        scaling's factor), the replicas' drift when it averaged, the sync trace's numbers;
        its loss (this rank's share, a tensor: no host read) is reduced at the log point."""
        row: dict[str, Any] = {"window": state.windows, "step": state.step, "epoch": epoch,
                               "window_size": window.size, "samples": state.samples_seen,
                               "lr": lr, "stepped": stepped}
        if lr_factor is not None:
            row["lr_factor"] = lr_factor
        if drift is not None:
            row["replica_drift"] = drift
        trace = self.p.engine.trace
        if trace is not None:  # this step's wait for all-reduces, overlap (trace_sync)
            row |= {f"sync_{k}": v for k, v in trace.last.items()}
            if drift is not None:
                trace.mark("models averaged", {"replica_drift": drift})
        row |= spent(self.p, state)  # where the run stands on the sweep summary's axes
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
            "train/window_size": last["window_size"], "comm/sync_backwards": c.sync_backwards,
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


def spent(p: Parts, state: Progress) -> dict[str, Any]:
    """Cumulative bytes (this rank's: all-reduce, and every collective) and loop seconds: the
    x-axes, besides samples, on which the sweep summary compares runs."""
    return {"allreduce_bytes": p.counts.allreduce_bytes, "sent_bytes": p.counts.sent_bytes,
            "train_s": state.train_s}
