"""summary.json, the run's record of what it did, and its one writer.

Every rank computes its part at the end of training (``summarize``: the per-rank counters are
gathered to every rank); the job process writes the file once (``write``), adding what only it
knows (the whole job's wall time, the signal that stopped it): the launcher of spawned ranks
gets rank 0's summary through a pipe of its own, a torchrun rank 0 has it in hand. A job that
fails writes ``failed`` instead. Rank 0 of the job is the writer (ranks.is_rank0).
"""

from __future__ import annotations

import re
import shlex
import signal
import sys
from dataclasses import asdict
from pathlib import Path
from typing import Any, NoReturn

import torch
import torch.distributed as dist

from gradsync.core import numerics
from gradsync.core.devices import device_name
from gradsync.core.files import write_json_atomic
from gradsync.core.memory import peak_memory_mb, peak_rss_mb
from gradsync.run import slurm
from gradsync.train.loop import Parts, Progress

SUMMARY = "summary.json"


def samples_per_s(state: Progress, compiled: dict[str, Any] | None) -> float:
    seconds = state.train_s - (compiled["compile_s"] if compiled else 0.0)
    return state.samples_seen / seconds if seconds > 0 else 0.0


def summarize(p: Parts, state: Progress, seed: int) -> dict[str, Any]:
    """Collective: the run's summary, on every rank. Per-rank counters are gathered from every
    rank; the largest worker's peak RSS."""
    c = p.counts
    o = p.precision.overflow
    trace = getattr(p.engine, "trace", None)  # engine.trace_sync
    averager = p.policy.averager
    a = averager.counters if averager is not None else None  # AveragingCounts: local SGD, DiLoCo
    memory = p.engine.memory.summary()  # its peak read before the lifetime peak: never above it
    mine: dict[str, Any] = {
            "sync_backwards": c.sync_backwards, "allreduce_calls": c.allreduce_calls,
            "allreduce_bytes": c.allreduce_bytes, "peak_rss_mb": peak_rss_mb(),
            "amp_aborted_windows": o.aborted_windows, "allreduce_skipped": o.allreduce_skipped,
            "overflow_flag_allreduces": o.flag_allreduces, "threads": torch.get_num_threads(),
            "peak_gpu_mem_mb": peak_memory_mb(p.device), "device": device_name(p.device),
            "averaging": None if a is None else asdict(a), "groups": c.groups,
            "trace": trace.summary() if trace else None,
            "sharded": {k: getattr(c, k) for k in SHARDED_COUNTS} | {
                "groups": c.sharded_groups},
            "memory": memory,
            "compile": p.engine.compiled.report() if p.engine.compiled else None,
            "numerics": numerics.key(p.numerics)}
    gathered: list[Any] = [None] * p.world_size
    dist.all_gather_object(gathered, mine)

    def per_rank(key: str) -> list[Any]:
        return [g[key] for g in gathered]

    sizes = p.schedule.sizes(p.trainer.max_epochs)
    return {
        "optimizer_steps": state.step,
        "epochs_completed": state.epoch,
        "samples_seen": state.samples_seen,
        "final_train_loss": state.last_loss,
        "eval": state.last_eval,
        # compile.enabled: the seconds dynamo spent compiling left out (summary's "compile")
        "samples_per_s": samples_per_s(state, mine["compile"]),
        "train_s": state.train_s,
        "sync_backwards": per_rank("sync_backwards"),
        "allreduce_calls": per_rank("allreduce_calls"),
        "allreduce_bytes": per_rank("allreduce_bytes"),
        "peak_rss_mb": max(per_rank("peak_rss_mb")),
        "peak_gpu_mem_mb": per_rank("peak_gpu_mem_mb") if p.device.type == "cuda" else None,
        "threads": per_rank("threads"),
        "device": gathered[0]["device"],
        "windows": state.windows,
        "amp_skipped_steps": state.skipped_steps,
        "amp_final_scale": p.precision.scale,
        "amp_aborted_windows": per_rank("amp_aborted_windows"),
        "allreduce_skipped": per_rank("allreduce_skipped"),
        "overflow_flag_allreduces": per_rank("overflow_flag_allreduces"),
        "world_size": p.world_size,
        "window_size": sizes[0] if len(sizes) == 1 else sizes,
        "micro_batch_size": p.micro_batch_size,
        "sync_policy": p.policy.name,
        "loss_normalize": p.normalizer.name,
        "precision": p.precision.name,
        "backend": dist.get_backend(),
        "engine": p.engine.describe(),
        "allreduce": p.engine.transport,
        "seed": seed,
        # what rank 0 computed with; ranks that computed otherwise (another CPU kind, say)
        "numerics": p.numerics,
        "numerics_ranks_differ": [r for r, k in enumerate(per_rank("numerics"))
                                  if k != per_rank("numerics")[0]],
    } | (averaging_summary(per_rank("averaging")) if a is not None else {}) \
      | group_summary(per_rank("groups")) | trace_summary(per_rank("trace")) \
      | sharded_summary(per_rank("sharded")) | memory_summary(per_rank("memory")) \
      | compile_summary(per_rank("compile")) \
      | (p.noise.summary() if p.noise is not None else {})



def compile_summary(per_rank: list[dict[str, Any] | None]) -> dict[str, Any]:
    """compile.enabled: how (rank 0's settings), each rank's graphs and compile seconds."""
    if per_rank[0] is None:
        return {}
    ranks = [r for r in per_rank if r is not None]
    return {"compile": {k: v for k, v in ranks[0].items() if k not in ("graphs", "compile_s")}
            | {"graphs": [r["graphs"] for r in ranks],
               "compile_s": [r["compile_s"] for r in ranks]}}


def trace_summary(per_rank: list[dict[str, Any] | None]) -> dict[str, Any]:
    """engine.trace_sync: each rank's mean wait for all-reduces per step (ms) and the fraction
    of its all-reduce time that overlapped the backward (engines/trace.py)."""
    if per_rank[0] is None:
        return {}
    return {"sync_trace": {k: [r[k] for r in per_rank if r is not None] for k in per_rank[0]}}



# a sharded engine's collectives besides all-reduces (sync/comm.py CommCounts)
SHARDED_COUNTS = ("reduce_scatter_calls", "reduce_scatter_bytes", "all_gather_calls",
                  "all_gather_bytes")


def sharded_summary(per_rank: list[dict[str, Any]]) -> dict[str, Any]:
    """A sharded engine's reduce-scatters and all-gathers: calls and bytes per rank, and per
    sync.groups group (`rest`: the parameters no rule matched); nothing for other engines."""
    if not any(r["reduce_scatter_calls"] or r["all_gather_calls"] for r in per_rank):
        return {}
    out: dict[str, Any] = {k: [r[k] for r in per_rank] for k in SHARDED_COUNTS}
    out["sharded_groups"] = {
        kind: {g: {"calls": [r["groups"].get(kind, {}).get(g, [0, 0])[0] for r in per_rank],
                   "bytes": [r["groups"].get(kind, {}).get(g, [0, 0])[1] for r in per_rank]}
               for g in groups}
        for kind, groups in per_rank[0]["groups"].items()}
    return out


def memory_summary(per_rank: list[dict[str, Any]]) -> dict[str, Any]:
    """Per rank: the gradient bytes held after a backward (whole and sharded, maxima over the
    run) and the peak memory during training, with what measured it (core/memory.py)."""
    keys = ("grad_unsharded_bytes", "grad_sharded_bytes", "grad_held_bytes", "peak_mb")
    return {"memory": {k: [r[k] for r in per_rank] for k in keys}
            | {"peak_measure": per_rank[0]["peak_measure"]}}


def group_summary(per_rank: list[dict[str, list[int]]]) -> dict[str, Any]:
    """sync.groups: each group's all-reduce calls and bytes per rank (`rest`: the parameters
    no rule matched)."""
    if not per_rank[0]:
        return {}
    return {"allreduce_groups": {g: {"calls": [r[g][0] for r in per_rank],
                                     "bytes": [r[g][1] for r in per_rank]}
                                 for g in per_rank[0]}}


def averaging_summary(per_rank: list[dict[str, Any]]) -> dict[str, Any]:
    """Local SGD / DiLoCo: averaging rounds, each rank's own skipped fp16 steps, and the largest
    replica drift measured before an averaging on any rank."""
    return {"averagings": per_rank[0]["averagings"],
            "local_skipped_steps": [r["local_skipped_steps"] for r in per_rank],
            "max_replica_drift": max(r["max_replica_drift"] for r in per_rank)}


def write(run_dir: Path, summary: dict[str, Any]) -> None:
    write_json_atomic(run_dir / SUMMARY, summary)


def failed(run_dir: Path, error: str) -> dict[str, Any]:
    """A failed job's summary (written where the run dir exists; a full disk is left to the
    error line the caller prints)."""
    out = {"status": "failed", "error": error}
    if run_dir.is_dir():
        try:
            write(run_dir, out)
        except OSError:
            pass
    return out


def _size(nbytes: float) -> str:
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if nbytes >= scale:
            return f"{nbytes / scale:.2f} {unit}"
    return f"{nbytes:.0f} B"


def wire(s: dict[str, Any]) -> str:
    """What crossed the wire, rank 0's (every rank joins every collective): the synchronising
    backwards (or local SGD's / DiLoCo's averagings) and the bytes of each kind of collective;
    and the final gradient noise scale where it was measured."""
    parts = [f"sync_backwards={s['sync_backwards'][0]}"]
    if "averagings" in s:
        parts.append(f"averagings={s['averagings']}")
    parts.append(f"allreduce={_size(s['allreduce_bytes'][0])}")
    parts += [f"{k.removesuffix('_bytes')}={_size(s[k][0])}"
              for k in ("reduce_scatter_bytes", "all_gather_bytes") if k in s]
    line = "sent (rank 0): " + " ".join(parts)
    if "noise_scale_windows" in s:
        b = s["noise_scale"]
        line += (f"  noise_scale={b:,.0f} {s['noise_scale_unit']}" if b is not None
                 else "  noise_scale=n/a")
    return line


def report(run_dir: Path, s: dict[str, Any]) -> None:
    """The lines a completed run prints (a noise scale with no value: why, one line)."""
    # the loss first, then the data's other metrics by name (summary.json's keys come sorted)
    order = sorted(s["eval"], key=lambda k: (k != "loss", k))
    evals = " ".join(f"eval_{k}={s['eval'][k]:.4f}" for k in order)
    if s.get("noise_scale_note"):
        print(f"gradsync: warning: no gradient noise scale at the end of the run: "
              f"{s['noise_scale_note']} (summary.json: noise_scale null)", file=sys.stderr,
              flush=True)
    print(f"\ngradsync: outputs in {run_dir}\n"
          f"  steps={s['optimizer_steps']} samples={s['samples_seen']} "
          f"final_train_loss={s['final_train_loss']:.4f} {evals} "
          f"samples/s={s['samples_per_s']:.0f} wall_s={s['wall_s']:.1f}\n"
          f"  {wire(s)}", flush=True)
    if (run_dir / "tb").is_dir():  # logger=tensorboard
        print(f"  TensorBoard: tensorboard --logdir {run_dir / 'tb'}", flush=True)
    for name, made in (s.get("trackers") or {}).items():  # logger=mlflow, wandb: their runs
        if made.get("run_id"):
            print(f"  {name}: run {made['run_id']} at {made['uri']}", flush=True)


def run_dir_override(run_dir: Path) -> str:
    """``hydra.run.dir=<run_dir>`` as Hydra's override parser and OmegaConf read it back: the
    path as it is where Hydra's grammar takes it unquoted, else a quoted value (a quote, and
    backslashes before it or at the end, escaped for Hydra; ``${`` escaped for OmegaConf)."""
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.errors import HydraException

    value = str(run_dir)
    plain = f"hydra.run.dir={value}"
    if not re.search(r"[\\$']", value):
        try:
            if OverridesParser.create().parse_override(plain).value() == value:
                return plain
        except HydraException:  # Hydra's grammar refuses it unquoted
            pass
    text = re.sub(r"(\\*)\$\{", lambda m: m[1] * 2 + "\\${", value)  # OmegaConf
    text = re.sub(r"(\\*)('|$)", lambda m: m[1] * 2 + ("\\'" if m[2] else ""), text)  # Hydra
    return f"hydra.run.dir='{text}'"


def stopped(run_dir: Path, s: dict[str, Any], requeue: bool) -> NoReturn:
    """A run stopped by a signal after checkpointing: say where, and how to go on, and exit with
    128 + the signal; under SLURM a preemption warning (SIGUSR1/SIGUSR2) requeues the job (the
    checkpoint is durable now)."""
    signum = signal.Signals[s["stopped_by"]]
    job = slurm.job_id()
    how = (f"continue with: gradsync-train resume=auto {shlex.quote(run_dir_override(run_dir))} "
           "(and the same overrides)")
    if job and signum in slurm.PREEMPT_SIGNALS and requeue:
        how = slurm.requeue(job)
    print(f"gradsync: stopped by {s['stopped_by']} after optimizer step "
          f"{s['optimizer_steps']}; checkpoint {s['checkpoint']}\n  {how}", file=sys.stderr,
          flush=True)
    sys.exit(128 + signum)
