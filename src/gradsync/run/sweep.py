"""The summary of a multirun sweep, read back from its job dirs: sweep_summary.csv,
sweep_summary.md and sweep.png in the sweep dir.

Everything comes from files (each job's .hydra/, summary.json, metrics.jsonl and evals.jsonl),
never from in-process job results: Hydra hands its multirun-end callback none, and jobs may have
run in other processes (joblib launcher). `python -m gradsync.run.sweep <sweep dir> [target loss]`
writes the summary of an interrupted sweep by hand. When its jobs hold different gradient
memory (engines, sharding: docs/sharded.md), memory.png puts each job's memory against the
bytes it moved per optimizer step.

Where the jobs measured the gradient noise scale (noise_scale.enabled), noise_scale.png shows
B_simple and the window size over training, and the table its final value.

A sweep owns its sweep dir: it holds a lock there from before its first job until its summary is
written (`claim`), so a second sweep into the same dir is refused at once, before it runs
anything. It notes there how many jobs it plans and when it started (`plan`): each job starts
with a line "job k of N" and, once a job is done, an ETA (`progress_line`). A signal that stops a
job run in the sweep's own process (Ctrl-C, SIGTERM) ends the whole sweep: its lock goes and a
line says how far it got and how to go on (`interrupted`). Every job it launches records itself
in the sweep dir when it starts and again with its outcome when it ends (`job_started`,
`job_ended`, in whichever process runs the job): the summary has one row per job this sweep
launched, so a job refused before it could write into its own dir (that dir in use by another
job) or lost without an outcome (its process killed) is a failed row, and the sweep exits
non-zero naming it.

Which job is best is a question of cost: each job's eval (and train) loss is read against three
axes, samples seen, bytes sent (rank 0's, every collective: a sharded engine's reduce-scatters
and all-gathers too) and training seconds (the loop's, evaluation left out), and the columns
samples_to_target, bytes_to_target and seconds_to_target say where its eval loss first reached
the target loss (linear interpolation between the two evaluations around the crossing; empty
when it never did). The target defaults to the worst final eval loss among the completed jobs,
so each of them reaches it. The to-target columns exist only where they mean something: some
job evaluated more than once (trainer.eval_every_steps); with one evaluation at the end they would
repeat each job's totals.

The markdown table is the short one (TABLE_COLUMNS columns in all: the job, its swept values,
its status and the most telling of COMPACT, leaving out set-up values every job shares and
columns that repeat another); sweep_summary.csv has every column.
"""

from __future__ import annotations

import csv
import json
import math
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from gradsync.components import ConfigError, require_extra
from gradsync.config.renames import renamed_record
from gradsync.core import numerics
from gradsync.core.files import write_json_atomic
from gradsync.core.progress import progress
from gradsync.run.rundir import let_go, take
from gradsync.train.metrics import final_metrics

# The axes a loss is read against: a Point's attribute, the label on the plot.
AXES = {"samples": "samples seen",
        "bytes": "bytes sent (rank 0: all-reduce + reduce-scatter + all-gather)",
        "seconds": "training seconds"}
TO_TARGET = (*AXES, "step")  # what to_target reads off where a loss reached its target


@dataclass(frozen=True)
class Point:
    """Where a job stood when a loss was measured (NaN: the row did not record that axis)."""

    samples: float
    bytes: float
    seconds: float
    loss: float
    step: float = math.nan  # the optimizer step it was measured after


def _points(rows: list[dict[str, Any]], loss_key: str) -> list[Point]:
    """The rows' losses with their axes: the bytes of every collective (a run's rows written
    before they were recorded: its all-reduce bytes)."""
    nan = math.nan
    return [Point(r["samples"], r.get("sent_bytes", r.get("allreduce_bytes", nan)),
                  r.get("train_s", nan), r[loss_key], r.get("step", nan))
            for r in rows if loss_key in r]


def _rows(path: Path) -> list[dict[str, Any]]:
    """A job's JSON lines; a last line torn by a job killed as it wrote it is left out."""
    lines = path.read_text().splitlines() if path.exists() else []
    rows = []
    for i, line in enumerate(lines):
        try:
            rows.append(json.loads(line))
        except ValueError:
            if i < len(lines) - 1:
                raise
    return rows


@dataclass
class Job:
    num: int
    dir: Path
    overrides: dict[str, str]  # key -> value, as given on the command line / by the sweeper
    summary: dict[str, Any]  # summary.json; {"status": "failed", "error": ...} when it failed
    losses: list[Point]  # train loss (mean over ranks) per optimizer step
    evals: list[Point] = field(default_factory=list)  # eval loss per evaluation
    # (samples, B_simple, window size) per optimizer step, where the noise scale was measured
    noise: list[tuple[float, float, int]] = field(default_factory=list)

    @property
    def completed(self) -> bool:
        return self.summary.get("status") == "completed"


HYDRA_RECORD = Path(".hydra") / "hydra.yaml"  # in a job's dir: its number and overrides


def read_job(job_dir: Path, summary: dict[str, Any] | None = None) -> Job:
    """A job's row from its dir (a sweep's job, or a run's dir); summary: its summary.json when
    the caller has read it."""
    hydra_cfg = yaml.safe_load((job_dir / HYDRA_RECORD).read_text())["hydra"]
    overrides = {k: v for k, _, v in (o.partition("=") for o in hydra_cfg["overrides"]["task"])}
    if summary is None:
        summary_path = job_dir / "summary.json"
        summary = (json.loads(summary_path.read_text()) if summary_path.exists() else
                   {"status": "failed", "error": "no summary.json: the job did not finish"})
    # an older sweep's jobs wrote accum_steps: read under today's names
    summary = renamed_record(summary)
    rows = [renamed_record(r) for r in _rows(job_dir / "metrics.jsonl")]
    return Job(int(hydra_cfg["job"]["num"]), job_dir, overrides, summary,
               _points(rows, "loss"), _points(_rows(job_dir / "evals.jsonl"), "loss"),
               [(r["samples"], math.nan if r["noise_scale"] is None else r["noise_scale"],
                 r["window_size"]) for r in rows if "noise_scale" in r])


SWEEP_LOCK = ".gradsync-sweep.lock"  # held by the sweep's process while it runs
JOBS = ".gradsync-jobs"  # <num>.json: each job this sweep launched, and how it ended
LOST = ("lost: the job started but never reported an outcome (its process was killed, or the "
        "sweep was interrupted)")
_held: dict[Path, int] = {}  # sweep dir -> this process's lock on it


def claim(sweep_dir: Path, keep_jobs: bool = False) -> None:
    """Before a sweep runs anything: lock its sweep dir (RunDirBusy when another sweep holds
    it) and forget the job records of an earlier sweep there, unless keep_jobs (a search
    that may continue its study: run/search.py forgets them for a new one). Held until
    `release`, or the end of this process."""
    sweep_dir.mkdir(parents=True, exist_ok=True)
    _held[sweep_dir] = take(sweep_dir / SWEEP_LOCK, "sweep", "hydra.sweep.dir")
    if not keep_jobs:
        forget_jobs(sweep_dir)


def forget_jobs(sweep_dir: Path) -> None:
    for old in (sweep_dir / JOBS).glob("*.json"):
        old.unlink()
    (sweep_dir / STUDY).unlink(missing_ok=True)


PLAN = ".gradsync-sweep.json"  # {"jobs": N or null, "started": epoch seconds}


def plan(sweep_dir: Path, jobs: int | None) -> None:
    """Note the jobs the sweep plans (None: not known in advance) and when it starts."""
    write_json_atomic(sweep_dir / PLAN, {"jobs": jobs, "started": time.time()})


def _plan(sweep_dir: Path) -> dict[str, Any]:
    try:
        return json.loads((sweep_dir / PLAN).read_text())
    except (OSError, ValueError):
        return {}


def _records(sweep_dir: Path) -> list[dict[str, Any]]:
    out = []
    for path in (sweep_dir / JOBS).glob("*.json"):
        try:
            out.append(json.loads(path.read_text()))
        except (OSError, ValueError):  # a record being replaced, or gone
            continue
    return out


def progress_line(sweep_dir: Path, num: int) -> str:
    """What job `num` of the sweep starts with: "job k of N (d done in T, ETA E)"."""
    info = _plan(sweep_dir)
    done = sum(r["status"] != "started" for r in _records(sweep_dir))
    elapsed = time.time() - info.get("started", time.time())
    return f"gradsync: sweep: job {progress(num + 1, info.get('jobs'), done, elapsed)}"


def interrupted(signal_name: str) -> list[str]:
    """A signal stopped a job that runs in the sweep's own process (Hydra's basic launcher):
    the sweep ends with it. Each sweep dir this process holds is let go; the lines say how far
    it got and how to go on."""
    lines = []
    for sweep_dir in list(_held):
        release(sweep_dir)
        done = sum(r["status"] == "completed" for r in _records(sweep_dir))
        jobs = _plan(sweep_dir).get("jobs")
        lines.append(f"gradsync: sweep interrupted by {signal_name} with {done} of "
                     f"{jobs or '?'} jobs completed; their summary: python -m gradsync.run.sweep "
                     f"{sweep_dir}; to go on, run the sweep again with "
                     f"hydra.sweep.dir={sweep_dir} resume=auto")
    return lines


# A search's study (run/search.py): storage, study_name, objectives, directions, and
# jobs: {trial number: job number}.
STUDY = "optuna.json"


def write_study(sweep_dir: Path, info: dict[str, Any]) -> None:
    write_json_atomic(sweep_dir / STUDY, info)


def read_study(sweep_dir: Path) -> dict[str, Any]:
    path = sweep_dir / STUDY
    return json.loads(path.read_text()) if path.exists() else {}


@dataclass
class Study:
    """A search's study as the summary shows it: its settings and, per job, its trial."""

    name: str
    storage: str
    objectives: list[str]
    directions: list[str]
    trials: dict[int, Any]  # job number -> optuna FrozenTrial
    best: list[int]  # job numbers: the best trial, or the Pareto front of several objectives


def import_optuna() -> Any:
    """optuna (a search's: gradsync[search], or one line naming it), without its INFO lines."""
    optuna = require_extra("optuna", "search", "hydra/sweeper=optuna (a search)")
    require_extra("sqlalchemy", "search", "hydra/sweeper=optuna (a search)")
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    return optuna


def load_study(sweep_dir: Path) -> Study | None:
    """The study of a search's sweep dir, read with Optuna's own API (None for a grid)."""
    info = read_study(sweep_dir)
    if not info:
        return None
    optuna = import_optuna()
    study = optuna.load_study(study_name=info["study_name"], storage=info["storage"])
    by_number = {t.number: t for t in study.get_trials(deepcopy=False)}
    trials = {int(job): by_number[int(n)] for n, job in info["jobs"].items()
              if int(n) in by_number}
    done = {job: t for job, t in trials.items() if t.state.name == "COMPLETE"}
    signs = [1 if d == "minimize" else -1 for d in info["directions"]]

    def dominated(a: Any) -> bool:
        return any(all(s * x <= s * y for s, x, y in zip(signs, b.values, a.values, strict=True))
                   and b.values != a.values for b in done.values())

    if len(signs) == 1:
        best = [min(done, key=lambda j: signs[0] * done[j].values[0])] if done else []
    else:
        best = sorted(j for j, t in done.items() if not dominated(t))
    return Study(info["study_name"], info["storage"], info["objectives"], info["directions"],
                 trials, best)


def release(sweep_dir: Path) -> None:
    fd = _held.pop(sweep_dir, None)
    if fd is not None:
        let_go(sweep_dir / SWEEP_LOCK, fd)


def _record(sweep_dir: Path, num: int, job_dir: Path, overrides: list[str],
            outcome: dict[str, Any]) -> None:
    """<sweep dir>/.gradsync-jobs/<num>.json; the job's dir relative to the sweep dir (a copied
    sweep dir reads its own job dirs)."""
    try:
        where = str(job_dir.absolute().relative_to(sweep_dir.absolute()))
    except ValueError:  # a hydra.sweep.subdir outside the sweep dir
        where = str(job_dir.absolute())
    (sweep_dir / JOBS).mkdir(exist_ok=True)
    write_json_atomic(sweep_dir / JOBS / f"{num}.json", {
        "num": num, "dir": where, "overrides": overrides, **outcome})


def job_value(ret: Any) -> Any:
    """What a job returned (its summary), or the exception it raised: a Hydra JobReturn's
    outcome through its public return_value (which raises a failed job's exception)."""
    try:
        return ret.return_value
    except BaseException as e:  # the job's own exception, kept as its outcome
        return e


def job_started(sweep_dir: Path, num: int, job_dir: Path, overrides: list[str]) -> None:
    """A job of the sweep begins (before it claims its own dir)."""
    _record(sweep_dir, num, job_dir, overrides, {"status": "started"})


def job_ended(sweep_dir: Path, num: int, job_dir: Path, overrides: list[str],
              result: Any) -> None:
    """How a job of the sweep ended: `result` is what the job returned (its summary, or
    {"status": "failed", "error": ...}), or the exception it raised."""
    if isinstance(result, BaseException):
        outcome = {"status": "failed", "error": f"{type(result).__name__}: {result}"}
    elif isinstance(result, dict) and result.get("status"):
        outcome = {"status": result["status"], "error": result.get("error", "")}
    else:
        outcome = {"status": "failed", "error": f"the job returned {result!r}"}
    _record(sweep_dir, num, job_dir, overrides, outcome)


def _from_record(sweep_dir: Path, record: dict[str, Any]) -> Job:
    """The row of a job this sweep launched: its own dir's files when they are its own (the
    outcome it recorded is what its summary.json says), else the outcome alone (a job refused
    before it could write there, or one lost without an outcome)."""
    job_dir = sweep_dir / record["dir"]
    if record["status"] == "started":
        outcome = {"status": "failed", "error": LOST}
    elif record["status"] == "completed":
        outcome = {"status": "completed"}
    else:
        outcome = {"status": record["status"], "error": record.get("error", "")}
    summary_path = job_dir / "summary.json"
    try:
        written = json.loads(summary_path.read_text())
    except (OSError, ValueError):
        written = None
    if (job_dir / HYDRA_RECORD).is_file() and isinstance(written, dict) and \
            {k: written.get(k) for k in outcome} == outcome:
        return read_job(job_dir, written)
    overrides = {k: v for k, _, v in (o.partition("=") for o in record["overrides"])}
    return Job(int(record["num"]), job_dir, overrides, outcome, [])


def read_jobs(sweep_dir: Path) -> list[Job]:
    """The jobs this sweep launched, in job order, from their records; for a sweep dir without
    records (written before gradsync kept them), every job dir under it (any
    hydra.sweep.subdir)."""
    records = _records(sweep_dir)
    if records:
        return sorted((_from_record(sweep_dir, r) for r in records), key=lambda j: j.num)
    dirs = {p.parent.parent for p in sweep_dir.glob(f"**/{HYDRA_RECORD}")}
    return sorted((read_job(d) for d in dirs), key=lambda j: j.num)


def swept_keys(jobs: list[Job]) -> list[str]:
    """The override keys whose values differ between jobs (all of them for a lone job)."""
    keys = list(dict.fromkeys(k for j in jobs for k in j.overrides))
    varying = [k for k in keys if len({j.overrides.get(k) for j in jobs}) > 1]
    return varying if varying or len(jobs) != 1 else keys


def _global_batch(s: dict[str, Any]) -> int | str:
    n = s.get("window_size")
    return s["world_size"] * s["micro_batch_size"] * n if isinstance(n, int) else ""


def default_target(jobs: list[Job]) -> float | None:
    """The worst final eval loss among the completed jobs: every one of them reaches it."""
    finals = [j.summary["eval"]["loss"] for j in jobs
              if j.completed and math.isfinite(j.summary.get("eval", {}).get("loss", math.nan))]
    return max(finals) if finals else None


def evaluated_often(jobs: list[Job]) -> bool:
    """Whether to-target numbers mean something: some completed job has more than one finite
    eval loss (with one, at the end, they are its totals)."""
    return any(sum(math.isfinite(p.loss) for p in j.evals) > 1 for j in jobs if j.completed)


def to_target(points: list[Point], target: float) -> dict[str, float] | None:
    """Samples, bytes, seconds (and optimizer steps) at which the loss first reached target
    (<=): linearly interpolated between the last point above it and the first at or below it
    (the first point itself when that already is). None: never reached."""
    before = None
    for point in points:
        if not math.isfinite(point.loss):
            continue
        if point.loss <= target:
            if before is None:
                return {axis: getattr(point, axis) for axis in TO_TARGET}
            f = (before.loss - target) / (before.loss - point.loss)
            return {axis: getattr(before, axis) + f * (getattr(point, axis)
                                                       - getattr(before, axis))
                    for axis in TO_TARGET}
        before = point
    return None


def table(jobs: list[Job], target: float | None = None,
          study: Study | None = None) -> tuple[list[str], list[dict[str, Any]]]:
    """One row per job: its overrides, swept values, status, final numbers (raw values) and,
    given a target eval loss, where the job reached it (empty cells where it never did); for a
    search, each job's trial and its state (a completed run whose objective Optuna could not
    use is a failed row)."""
    keys = swept_keys(jobs)
    often = evaluated_often(jobs)
    rows = []
    for job in jobs:
        s = job.summary
        row: dict[str, Any] = {"job": job.num,
                               "overrides": " ".join(f"{k}={v}" for k, v in job.overrides.items())}
        row |= {k: job.overrides.get(k, "") for k in keys}
        row["status"] = s.get("status", "failed")
        trial = study.trials.get(job.num) if study else None
        if study:
            row |= {"trial": "" if trial is None else trial.number,
                    "trial_state": "" if trial is None else trial.state.name}
        if trial is not None and trial.state.name == "FAIL" and job.completed:
            s = {**s, "error": trial.user_attrs.get("gradsync_error", "the trial failed")}
            row["status"] = "failed"
        if job.completed:  # (a failed trial's numbers too: they say why)
            row |= {k: s[k] for k in ("world_size", "micro_batch_size", "window_size")}
            row |= {"global_batch": _global_batch(s), "optimizer_steps": s["optimizer_steps"]}
            row |= final_metrics(s)
        if target is not None and often:
            row["target_loss"] = target
            reached = to_target(job.evals, target)
            row |= {f"{axis}_to_target": "" if reached is None or not math.isfinite(reached[axis])
                    else reached[axis] for axis in AXES}
        if s.get("numerics"):  # what the job computed with (core/numerics.py)
            row["numerics"] = numerics.key(s["numerics"])
        row["error"] = s.get("error", "")
        row["dir"] = str(job.dir)
        rows.append(row)
    columns = list(dict.fromkeys(c for row in rows for c in row))
    columns.remove("error")
    columns.remove("dir")
    return columns + ["error", "dir"], rows


# Markdown headers and formats; columns not listed here (the swept keys) show as they are.
MARKDOWN: dict[str, tuple[str, Callable[[Any], str]]] = {
    "trial": ("trial", str),  # a search's (run/search.py)
    "trial_state": ("trial state", str),
    "world_size": ("ranks", str),
    "micro_batch_size": ("micro", str),
    "window_size": ("N", str),
    "global_batch": ("global batch", str),
    "optimizer_steps": ("steps", str),
    "final_train_loss": ("final train loss", lambda v: f"{v:.6g}"),
    "eval_loss": ("eval loss", lambda v: f"{v:.6g}"),
    "eval_accuracy": ("eval accuracy", lambda v: f"{v:.4f}"),
    "samples_per_s": ("samples/s", lambda v: f"{v:,.0f}"),
    "sync_backwards": ("sync backwards/rank", str),
    "allreduce_calls": ("all-reduce calls/rank", str),
    "allreduce_bytes": ("all-reduce MB/rank", lambda v: f"{v / 1e6:.2f}"),
    "sent_bytes": ("MB sent/rank", lambda v: f"{v / 1e6:.2f}"),
    "peak_rss_mb": ("peak RSS MB", lambda v: f"{v:.0f}"),
    "reduce_scatter_bytes": ("reduce-scatter MB/rank", lambda v: f"{v / 1e6:.2f}"),  # fsdp, hsdp
    "all_gather_bytes": ("all-gather MB/rank", lambda v: f"{v / 1e6:.2f}"),
    "comm_bytes_per_step": ("MB/step (rank 0)", lambda v: f"{v / 1e6:.3f}"),
    "grad_held_bytes": ("grad MB held", lambda v: f"{v / 1e6:.2f}"),
    "peak_mem_mb": ("peak MB", lambda v: f"{v:.0f}"),
    "wall_s": ("wall s", lambda v: f"{v:.1f}"),
    "max_replica_drift": ("max replica drift", lambda v: f"{v:.3g}"),  # local SGD, DiLoCo
    "noise_scale": ("final B_simple", lambda v: f"{v:,.0f}"),  # noise_scale.enabled
    "samples_to_target": ("samples to target", lambda v: f"{v:,.0f}"),
    "bytes_to_target": ("MB sent to target", lambda v: f"{v / 1e6:.2f}"),
    "seconds_to_target": ("train s to target", lambda v: f"{v:.1f}"),
}
# Set-up columns that move out of the table into one line when every completed job agrees.
SETUP = ("world_size", "micro_batch_size", "window_size", "global_batch", "optimizer_steps",
         "grad_held_bytes")
# The markdown table's candidates, in the order shown, and which to keep first when more than
# TABLE_COLUMNS remain (sweep_summary.csv has every column; peak RSS where no peak memory was
# measured: the same number on the CPU).
COMPACT = ("trial_state", "world_size", "micro_batch_size", "window_size", "global_batch",
           "optimizer_steps", "final_train_loss", "eval_loss", "eval_accuracy", "samples_per_s",
           "sync_backwards", "sent_bytes", "grad_held_bytes", "peak_mem_mb", "peak_rss_mb",
           "max_replica_drift", "noise_scale", "samples_to_target", "bytes_to_target",
           "seconds_to_target", "wall_s")
PRIORITY = ("eval_loss", "final_train_loss", "sent_bytes", "samples_to_target",
            "bytes_to_target", "seconds_to_target", "world_size", "window_size", "global_batch",
            "optimizer_steps", "micro_batch_size", "samples_per_s", "max_replica_drift",
            "noise_scale", "grad_held_bytes", "peak_mem_mb", "peak_rss_mb", "eval_accuracy",
            "sync_backwards", "wall_s", "trial_state")
TABLE_COLUMNS = 12  # in all, the job, its swept values and status included


def _cell(column: str, value: Any) -> str:
    return "" if value == "" else MARKDOWN.get(column, (column, str))[1](value)


def _loss_spread(rows: list[dict[str, Any]]) -> str:
    losses = [r["final_train_loss"] for r in rows
              if r["status"] == "completed" and math.isfinite(r["final_train_loss"])]
    if len(losses) < 2:
        return ""
    lo, hi = min(losses), max(losses)
    rel = (hi - lo) / abs(lo) if lo else math.inf
    return (f"Final train loss over {len(losses)} completed jobs: min {lo:.8g}, max {hi:.8g}, "
            f"spread {hi - lo:.3g} (relative {rel:.3g}).")


def _against_first(rows: list[dict[str, Any]]) -> list[str]:
    """When the jobs move different all-reduce bytes (per-layer rules, wire dtypes, local SGD;
    with sharded engines: the bytes of every collective): each job's bytes and final losses
    against the first completed job's: what it saves and what that costs."""
    done = [r for r in rows if r["status"] == "completed"]
    # with sharded engines among the jobs: every collective's bytes, not only the all-reduce's
    sharded = any(r.get("reduce_scatter_bytes", "") != "" for r in done)
    kinds = ("allreduce_bytes", "reduce_scatter_bytes", "all_gather_bytes") if sharded else \
        ("allreduce_bytes",)
    what = "bytes sent (all-reduce + reduce-scatter + all-gather)" if sharded else \
        "all-reduce bytes"

    def sent(r: dict[str, Any]) -> float:
        return sum(r.get(k) or 0 for k in kinds)

    if len(done) < 2 or len({sent(r) for r in done}) < 2:
        return []
    first = done[0]
    lines = [f"Against job {first['job']} ({first['overrides'] or 'no overrides'}):"]
    for r in done[1:]:
        ratio = sent(r) / sent(first) if sent(first) else math.inf
        change = f"{(1 - ratio) * 100:.1f} % saved" if ratio <= 1 else \
            f"{(ratio - 1) * 100:.1f} % more"
        parts = [f"{what} x{ratio:.3f} ({change})"]
        for key in ("final_train_loss", "eval_loss"):
            if key in r and key in first:
                delta = r[key] - first[key]
                rel = delta / abs(first[key]) * 100 if first[key] else math.inf
                parts.append(f"{key.replace('_', ' ')} {delta:+.4g} ({rel:+.2f} %)")
        lines.append(f"- job {r['job']}: " + ", ".join(parts))
    return lines


def _numerics_line(jobs: list[Job], rows: list[dict[str, Any]]) -> str:
    """When the jobs computed with different numerics (another CPU kind, torch, thread count or
    trainer.bits: core/numerics.py), their numbers differ by more than what was swept: say
    which jobs computed with what."""
    by_key: dict[str, list[int]] = {}
    for row in rows:
        if row.get("numerics"):
            by_key.setdefault(row["numerics"], []).append(row["job"])
    if len(by_key) < 2:
        return ""
    fps = {job.num: job.summary["numerics"] for job in jobs if job.summary.get("numerics")}

    def what(fp: dict[str, Any]) -> str:
        return (f"{fp['cpu']['model']}, {fp['cpu']['capability']}, bits={fp['bits']}, "
                f"torch {fp['torch']}, {fp['threads']} threads")

    groups = "; ".join(f"job{'s' if len(nums) > 1 else ''} {', '.join(map(str, nums))}: "
                       f"{what(fps[nums[0]])}" for nums in by_key.values())
    return (f"The jobs computed with {len(by_key)} different numerics (their bits differ by "
            f"more than what was swept; the CSV's numerics column): {groups}.")


def _study_lines(study: Study, rows: list[dict[str, Any]]) -> list[str]:
    """A search's study, and its best trial (the Pareto front of several objectives)."""
    states = [r["trial_state"] for r in rows if r["trial_state"]]
    counts = ", ".join(f"{states.count(s)} {s}" for s in dict.fromkeys(states))
    lines = [f"Optuna study {study.name} ({study.storage}): "
             + ", ".join(f"{o} ({d})" for o, d in zip(study.objectives, study.directions,
                                                      strict=True))
             + f"; {len(states)} trials: {counts or 'none'}."]
    by_job = {r["job"]: r for r in rows}
    for job in study.best:
        trial = study.trials[job]
        params = " ".join(f"{k}={v}" for k, v in trial.params.items())
        values = ", ".join(f"{o} {v:.6g}" for o, v in zip(study.objectives, trial.values,
                                                          strict=True))
        what = "Best trial" if len(study.objectives) == 1 else "On the Pareto front: trial"
        where = by_job[job]["dir"] if job in by_job else "no record of its job"
        lines.append(f"{what} {trial.number} (job {job}, {where}): {params}: {values}.")
    if not study.best:
        lines.append("No trial completed: no best trial.")
    return lines


def markdown(sweep_dir: Path, jobs: list[Job], columns: list[str],
             rows: list[dict[str, Any]], target: float | None = None,
             target_given: bool = False, study: Study | None = None) -> str:
    """The table a person reads: the swept values, what differs, and the final numbers."""
    failed = sum(r["status"] != "completed" for r in rows)
    done = [r for r in rows if r["status"] == "completed"]
    # set-up values every completed job shares, and with 2 jobs or more any other value
    same = [c for c in (*SETUP, *COMPACT) if done and c in columns
            and (c in SETUP or len(done) > 1) and len({str(r.get(c, "")) for r in done}) == 1]
    same = list(dict.fromkeys(c for c in same if c not in ("trial_state", "peak_rss_mb")))
    common = [f"{k}={v}" for k, v in jobs[0].overrides.items()
              if k not in columns and all(j.overrides.get(k) == v for j in jobs)] if jobs else []
    shown = _shown(columns, rows, swept_keys(jobs), same, failed > 0)
    headers = [MARKDOWN.get(c, (c, str))[0] for c in shown]
    lines = [f"# Sweep {sweep_dir}", "",
             f"{len(rows)} jobs: {len(done)} completed, {failed} failed. "
             f"Common overrides: {' '.join(common) or 'none'}."]
    if same:
        lines.append("Same in every completed job: " + ", ".join(
            f"{MARKDOWN[c][0]} {_cell(c, done[0][c])}" for c in same) + ".")
    if target is not None and any("samples_to_target" in r for r in rows):
        how = "given" if target_given else "the worst final eval loss among completed jobs"
        lines.append(f"Target eval loss {target:.6g} ({how}): the to-target columns are where "
                     "each job's eval loss first reached it (interpolated between evaluations; "
                     "empty: never).")
    elif done:
        lines.append("Each job evaluated once, at its end: no to-target columns (they would "
                     "repeat its totals; trainer.eval_every_steps=K evaluates along the way).")
    if study is not None:
        lines += _study_lines(study, rows)
    mixed = _numerics_line(jobs, rows)
    if mixed:
        lines.append(mixed)
    lines += ["", "| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    for row in rows:
        cells = [_cell(c, row.get(c, "")).replace("|", "\\|") for c in shown]
        lines.append("| " + " | ".join(cells) + " |")
    spread = _loss_spread(rows)
    against = _against_first(rows)
    lines += ["", *([spread, ""] if spread else []), *([*against, ""] if against else []),
              "Per-rank counters are rank 0's; peak memory is the largest rank's. Loss against "
              "samples, bytes sent and seconds: sweep.png. Every column (all-reduce calls and "
              "bytes, reduce-scatter and all-gather bytes, peak RSS, training seconds...): "
              "sweep_summary.csv."
              + (f" HParams: `tensorboard --logdir {sweep_dir}`."  # logger=tensorboard's
                 if any((job.dir / "tb").is_dir() for job in jobs) else ""), ""]
    return "\n".join(lines)


def _shown(columns: list[str], rows: list[dict[str, Any]], swept: list[str], same: list[str],
           failed: bool) -> list[str]:
    """The markdown table's columns: the job, its swept values, its status (and error), then
    COMPACT's by PRIORITY up to TABLE_COLUMNS in all (5 at least), leaving out the set-up
    values every completed job shares (`same`), peak RSS where peak memory was measured, and
    any column whose cells repeat a column already kept (N beside a swept
    schedule.window_size; sync backwards beside steps, one per step)."""
    def cells(c: str) -> tuple[str, ...]:
        return tuple(str(r.get(c, "")) for r in rows)

    fixed = ["job", *[c for c in swept if c in columns], "status"]
    kept: list[str] = []
    room = max(5, TABLE_COLUMNS - len(fixed) - failed)
    seen = {cells(c) for c in fixed}
    for c in sorted((c for c in COMPACT if c in columns and c not in same), key=PRIORITY.index):
        if c == "peak_rss_mb" and "peak_mem_mb" in kept or cells(c) in seen:
            continue
        if len(kept) < room:
            kept.append(c)
            seen.add(cells(c))
    return fixed + [c for c in COMPACT if c in kept] + (["error"] if failed else [])


def job_label(job: Job, keys: list[str]) -> str:
    """A job's name on a plot: its values of the swept keys."""
    return " ".join(f"{k}={job.overrides.get(k, '')}" for k in keys) or f"job {job.num}"


def plot(jobs: list[Job], path: Path, target: float | None = None):
    """Three panels, one colour per job: eval loss (markers) and train loss (thin) against
    samples seen, bytes sent (log axis; symlog from 0 where a job sent nothing at all, so it
    stays on the plot) and training seconds; the whole of every curve (a log loss axis where
    the losses span more than 10x), the target as a dashed line. Returns the figure
    (closed)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    keys = swept_keys(jobs)

    def label(job: Job) -> str:
        text = job_label(job, keys)
        return text if job.completed else f"{text} (failed)"

    fig, axes = plt.subplots(1, len(AXES), figsize=(16, 4.8))
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    # NaN marks a window aborted by fp16 overflow: a gap in the curve, not a scale
    every = [p.loss for job in jobs for p in job.losses + job.evals if math.isfinite(p.loss)]
    log_loss = bool(every) and min(every) > 0 and max(every) > 10 * min(every)
    sent = [p.bytes for job in jobs for p in job.losses + job.evals if math.isfinite(p.bytes)]
    # a job that sent nothing at all (one rank) would vanish from a log axis: symlog keeps it
    silent = any(job.losses + job.evals and not any(p.bytes > 0 for p in job.losses + job.evals)
                 for job in jobs)
    for ax, (axis, xlabel) in zip(axes, AXES.items(), strict=True):
        for i, job in enumerate(jobs):
            color = colors[i % len(colors)]
            if job.losses:
                ax.plot([getattr(p, axis) for p in job.losses], [p.loss for p in job.losses],
                        color=color, linewidth=0.8, alpha=0.35)
            if job.evals:
                ax.plot([getattr(p, axis) for p in job.evals], [p.loss for p in job.evals],
                        "o-", color=color, linewidth=1.6, markersize=3, label=label(job))
        if target is not None:
            ax.axhline(target, color="black", linestyle="--", linewidth=0.8,
                       label=f"target {target:.4g}" if axis == "samples" else None)
        if axis == "samples":
            _note_coinciding(ax, jobs)
        if axis == "bytes":
            positive = [b for b in sent if b > 0]
            if silent:
                ax.set_xscale("symlog", linthresh=min(positive, default=1.0))
                ax.set_xlim(left=0)
            elif positive:
                ax.set_xscale("log")
        if log_loss:
            ax.set_yscale("log")
        ax.set(xlabel=xlabel, ylabel="loss" if axis == "samples" else None,
               title=f"Loss vs {xlabel.split(' (')[0]}")
        ax.grid(True, alpha=0.3)
    if any(job.evals for job in jobs):
        axes[0].legend(fontsize="small", title="eval (dots); train: thin",
                       title_fontsize="small")
    elif target is not None:
        axes[0].legend(fontsize="small")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return fig


def _note_coinciding(ax: Any, jobs: list[Job]) -> None:
    """Jobs that train the same model draw one curve against samples, the last drawn hiding the
    others: say so on the panel, so that no job seems missing."""
    curves: dict[tuple, list[int]] = {}
    for job in jobs:
        if job.losses:
            key = tuple((p.samples, round(p.loss, 5)) for p in job.losses)
            curves.setdefault(key, []).append(job.num)
    shared = [nums for nums in curves.values() if len(nums) > 1]
    if shared:
        text = "; ".join(f"jobs {', '.join(map(str, nums))}" for nums in shared)
        ax.text(0.02, 0.02, f"one curve: {text} (the same updates)", transform=ax.transAxes,
                fontsize="small", va="bottom")


def plot_memory(rows: list[dict[str, Any]], path: Path, swept: list[str]) -> bool:
    """When the completed jobs hold different gradient memory (engines, sharding flavours): one
    point per job, gradient memory held (left) and peak memory (right) against the bytes it
    moved per optimizer step (rank 0's all-reduce, reduce-scatter and all-gather bytes).
    Returns whether it wrote the plot."""
    import matplotlib.pyplot as plt

    done = [r for r in rows if r["status"] == "completed" and "grad_held_bytes" in r]
    if len(done) < 2 or len({r["grad_held_bytes"] for r in done}) < 2:
        return False
    peaks = all(r.get("peak_mem_mb", "") != "" for r in done)
    fig, axes = plt.subplots(1, 2 if peaks else 1, figsize=(13 if peaks else 7, 4.8),
                             squeeze=False)
    panels = [("grad_held_bytes", 1e-6, "gradient memory held after a backward (MB)")]
    if peaks:
        panels.append(("peak_mem_mb", 1.0, "peak memory during training (MB)"))
    for ax, (key, scale, ylabel) in zip(axes[0], panels, strict=True):
        xs, ys = [], []
        for r in done:
            x, y = r["comm_bytes_per_step"] / 1e6, r[key] * scale
            xs.append(x)
            ys.append(y)
            ax.plot(x, y, "o", markersize=8)
            label = " ".join(str(r[k]) for k in swept) or f"job {r['job']}"
            ax.annotate(label, (x, y), textcoords="offset points", xytext=(6, 4),
                        fontsize="small")
        ax.set(xlabel="MB sent per optimizer step (rank 0: all-reduce + reduce-scatter + "
                      "all-gather)", ylabel=ylabel)
        # from 0, with room for the labels of the outermost points
        ax.set_xlim(0, max(xs) * 1.15 or 1)
        ax.set_ylim(0, max(ys) * 1.12 or 1)
        ax.grid(True, alpha=0.3)
    fig.suptitle("Memory (the largest rank's) against bytes sent, one point per job")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return True


def plot_noise(jobs: list[Job], path: Path):
    """Where the jobs measured the gradient noise scale (docs/noise-scale.md): B_simple (log
    axis) and the window size N against samples seen, one colour per job. Returns the figure
    (closed)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    keys = swept_keys(jobs)
    fig, (ax_b, ax_n) = plt.subplots(1, 2, figsize=(12, 4.5))
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for i, job in enumerate(jobs):
        if not job.noise:
            continue
        samples = [x for x, _, _ in job.noise]
        color = colors[i % len(colors)]
        ax_b.plot(samples, [b for _, b, _ in job.noise], color=color, linewidth=1.2,
                  label=job_label(job, keys))
        ax_n.step(samples, [n for _, _, n in job.noise], where="post", color=color,
                  linewidth=1.2)
    ax_b.set(xlabel="samples seen", ylabel="B_simple (the loss's unit)", yscale="log",
             title="Gradient noise scale B_simple (moving averages)")
    ax_n.set(xlabel="samples seen", ylabel="micro-batches per optimizer step (N)",
             title="Window size")
    for ax in (ax_b, ax_n):
        ax.grid(True, alpha=0.3)
    ax_b.legend(fontsize="small")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return fig


@dataclass
class SweepResult:
    """What write_summary found: the jobs, how many failed (or were lost), the markdown."""

    jobs: int
    failed: int
    markdown: str
    failed_jobs: list[int] = field(default_factory=list)  # their job numbers

    def failure_line(self, sweep_dir: Path) -> str:
        """What the sweep says when it ends with failed (or lost) jobs, naming them."""
        nums = ", ".join(map(str, self.failed_jobs))
        return (f"gradsync: sweep: {self.failed} of {self.jobs} jobs failed "
                f"(job{'s' if len(self.failed_jobs) > 1 else ''} {nums}); see "
                f"{sweep_dir / 'sweep_summary.md'}")


def write_summary(sweep_dir: Path, target_loss: float | None = None) -> SweepResult:
    """sweep_summary.csv, sweep_summary.md and sweep.png from the job dirs in sweep_dir;
    target_loss None: the worst final eval loss among the completed jobs."""
    jobs = read_jobs(sweep_dir)
    study = load_study(sweep_dir)
    target = default_target(jobs) if target_loss is None else target_loss
    columns, rows = table(jobs, target, study)
    with open(sweep_dir / "sweep_summary.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=columns, restval="")
        writer.writeheader()
        writer.writerows(rows)
    text = markdown(sweep_dir, jobs, columns, rows, target, target_loss is not None, study)
    (sweep_dir / "sweep_summary.md").write_text(text)
    try:
        require_extra("matplotlib", "plots", "a sweep's plots (sweep.png)")
    except ConfigError as e:  # the summary stands without them
        print(f"gradsync: sweep: no plots: {e}", file=sys.stderr, flush=True)
    else:
        plot(jobs, sweep_dir / "sweep.png", target)
        plot_memory(rows, sweep_dir / "memory.png", swept_keys(jobs))
        if any(job.noise for job in jobs):
            plot_noise(jobs, sweep_dir / "noise_scale.png")
    failed = [r["job"] for r in rows if r["status"] != "completed"]
    return SweepResult(len(rows), len(failed), text, failed)


def main(argv: list[str]) -> int:
    try:
        target = float(argv[1]) if len(argv) == 2 else None
    except ValueError:
        target = math.nan
    if len(argv) not in (1, 2) or not Path(argv[0]).is_dir() or \
            (target is not None and not math.isfinite(target)):
        print("usage: python -m gradsync.run.sweep <sweep dir> [target eval loss]", file=sys.stderr)
        return 2
    result = write_summary(Path(argv[0]), target)
    print(result.markdown)
    if result.failed:
        print(result.failure_line(Path(argv[0])), file=sys.stderr)
    return 1 if result.failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
