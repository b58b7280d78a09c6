"""The summary of a multirun sweep, read back from its job dirs: sweep_summary.csv,
sweep_summary.md and sweep.png in the sweep dir.

Everything comes from files (each job's .hydra/, summary.json and metrics.jsonl), never from
in-process job results: Hydra hands its multirun-end callback none, and jobs may have run in
other processes (joblib launcher). `python -m gradsync.sweep <sweep dir>` writes the summary of
an interrupted sweep by hand.
"""

from __future__ import annotations

import csv
import json
import math
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from gradsync.metrics import final_metrics


@dataclass
class Job:
    num: int
    dir: Path
    overrides: dict[str, str]  # key -> value, as given on the command line / by the sweeper
    summary: dict[str, Any]  # summary.json; {"status": "failed", "error": ...} when it failed
    losses: list[tuple[int, float]]  # (samples seen, train loss) per optimizer step

    @property
    def completed(self) -> bool:
        return self.summary.get("status") == "completed"


def _read_job(job_dir: Path) -> Job:
    hydra_cfg = yaml.safe_load((job_dir / ".hydra" / "hydra.yaml").read_text())["hydra"]
    overrides = {k: v for k, _, v in (o.partition("=") for o in hydra_cfg["overrides"]["task"])}
    summary_path = job_dir / "summary.json"
    summary = (json.loads(summary_path.read_text()) if summary_path.exists() else
               {"status": "failed", "error": "no summary.json: the job did not finish"})
    metrics = job_dir / "metrics.jsonl"
    rows = [json.loads(line) for line in metrics.read_text().splitlines()] \
        if metrics.exists() else []
    return Job(int(hydra_cfg["job"]["num"]), job_dir, overrides, summary,
               [(r["samples"], r["loss"]) for r in rows if "loss" in r])


def read_jobs(sweep_dir: Path) -> list[Job]:
    """Every job dir under the sweep dir (any hydra.sweep.subdir), in job order."""
    dirs = {p.parent.parent for p in sweep_dir.glob("**/.hydra/hydra.yaml")}
    return sorted((_read_job(d) for d in dirs), key=lambda j: j.num)


def swept_keys(jobs: list[Job]) -> list[str]:
    """The override keys whose values differ between jobs (all of them for a lone job)."""
    keys = list(dict.fromkeys(k for j in jobs for k in j.overrides))
    varying = [k for k in keys if len({j.overrides.get(k) for j in jobs}) > 1]
    return varying if varying or len(jobs) != 1 else keys


def _global_batch(s: dict[str, Any]) -> int | str:
    n = s.get("accum_steps")
    return s["world_size"] * s["micro_batch_size"] * n if isinstance(n, int) else ""


def table(jobs: list[Job]) -> tuple[list[str], list[dict[str, Any]]]:
    """One row per job: its overrides, swept values, status and final numbers (raw values)."""
    keys = swept_keys(jobs)
    rows = []
    for job in jobs:
        s = job.summary
        row: dict[str, Any] = {"job": job.num,
                               "overrides": " ".join(f"{k}={v}" for k, v in job.overrides.items())}
        row |= {k: job.overrides.get(k, "") for k in keys}
        row["status"] = s.get("status", "failed")
        if job.completed:
            row |= {k: s[k] for k in ("world_size", "micro_batch_size", "accum_steps")}
            row |= {"global_batch": _global_batch(s), "optimizer_steps": s["optimizer_steps"]}
            row |= final_metrics(s)
        row["error"] = s.get("error", "")
        row["dir"] = str(job.dir)
        rows.append(row)
    columns = list(dict.fromkeys(c for row in rows for c in row))
    columns.remove("error")
    columns.remove("dir")
    return columns + ["error", "dir"], rows


# Markdown headers and formats; columns not listed here (the swept keys) show as they are.
MARKDOWN: dict[str, tuple[str, Callable[[Any], str]]] = {
    "world_size": ("ranks", str),
    "micro_batch_size": ("micro", str),
    "accum_steps": ("N", str),
    "global_batch": ("global batch", str),
    "optimizer_steps": ("steps", str),
    "final_train_loss": ("final train loss", lambda v: f"{v:.6g}"),
    "eval_loss": ("eval loss", lambda v: f"{v:.6g}"),
    "eval_accuracy": ("eval accuracy", lambda v: f"{v:.4f}"),
    "samples_per_s": ("samples/s", lambda v: f"{v:,.0f}"),
    "sync_backwards": ("sync backwards/rank", str),
    "allreduce_calls": ("all-reduce calls/rank", str),
    "allreduce_bytes": ("all-reduce MB/rank", lambda v: f"{v / 1e6:.2f}"),
    "peak_rss_mb": ("peak RSS MB", lambda v: f"{v:.0f}"),
    "wall_s": ("wall s", lambda v: f"{v:.1f}"),
    "max_replica_drift": ("max replica drift", lambda v: f"{v:.3g}"),  # local SGD, DiLoCo
}
# Set-up columns that move out of the table into one line when every completed job agrees.
SETUP = ("world_size", "micro_batch_size", "accum_steps", "global_batch", "optimizer_steps")


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
    """When the jobs move different all-reduce bytes (per-layer rules, wire dtypes, local SGD):
    each job's bytes and final losses against the first completed job's: what it saves and
    what that costs."""
    done = [r for r in rows if r["status"] == "completed"]
    if len(done) < 2 or len({r["allreduce_bytes"] for r in done}) < 2:
        return []
    first = done[0]
    lines = [f"Against job {first['job']} ({first['overrides'] or 'no overrides'}):"]
    for r in done[1:]:
        ratio = r["allreduce_bytes"] / first["allreduce_bytes"] if first["allreduce_bytes"] \
            else math.inf
        parts = [f"all-reduce bytes x{ratio:.3f} ({(1 - ratio) * 100:.1f} % saved)"]
        for key in ("final_train_loss", "eval_loss"):
            if key in r and key in first:
                delta = r[key] - first[key]
                rel = delta / abs(first[key]) * 100 if first[key] else math.inf
                parts.append(f"{key.replace('_', ' ')} {delta:+.4g} ({rel:+.2f} %)")
        lines.append(f"- job {r['job']}: " + ", ".join(parts))
    return lines


def markdown(sweep_dir: Path, jobs: list[Job], columns: list[str],
             rows: list[dict[str, Any]]) -> str:
    """The table a person reads: the swept values, what differs, and the final numbers."""
    failed = sum(r["status"] != "completed" for r in rows)
    done = [r for r in rows if r["status"] == "completed"]
    same = [c for c in SETUP if done and len({str(r[c]) for r in done}) == 1]
    common = [f"{k}={v}" for k, v in jobs[0].overrides.items()
              if k not in columns and all(j.overrides.get(k) == v for j in jobs)] if jobs else []
    shown = [c for c in columns if (c in MARKDOWN and c not in same and c != "train_s")
             or c in swept_keys(jobs) or c in ("job", "status") or (c == "error" and failed)]
    headers = [MARKDOWN.get(c, (c, str))[0] for c in shown]
    lines = [f"# Sweep {sweep_dir}", "",
             f"{len(rows)} jobs: {len(done)} completed, {failed} failed. "
             f"Common overrides: {' '.join(common) or 'none'}."]
    if same:
        lines.append("Same in every completed job: " + ", ".join(
            f"{MARKDOWN[c][0]} {_cell(c, done[0][c])}" for c in same) + ".")
    lines += ["", "| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    for row in rows:
        cells = [_cell(c, row.get(c, "")).replace("|", "\\|") for c in shown]
        lines.append("| " + " | ".join(cells) + " |")
    spread = _loss_spread(rows)
    against = _against_first(rows)
    lines += ["", *([spread, ""] if spread else []), *([*against, ""] if against else []),
              "Per-rank counters are rank 0's; peak RSS is the largest worker's. Loss curves "
              "and samples/s: sweep.png. Every column: sweep_summary.csv. HParams: "
              f"`tensorboard --logdir {sweep_dir}`.", ""]
    return "\n".join(lines)


def plot(jobs: list[Job], path: Path):
    """Loss curves of every job on one axis (against samples seen, so different N compare at
    equal data) and samples/s against the swept value. Returns the figure (closed)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    keys = swept_keys(jobs)

    def label(job: Job) -> str:
        text = " ".join(f"{k}={job.overrides.get(k, '')}" for k in keys) or f"job {job.num}"
        return text if job.completed else f"{text} (failed)"

    fig, (ax_loss, ax_speed) = plt.subplots(1, 2, figsize=(13, 4.8))
    for job in jobs:
        if job.losses:
            samples, losses = zip(*job.losses, strict=True)
            ax_loss.plot(samples, losses, label=label(job), linewidth=1.2)
    # NaN marks a window aborted by fp16 overflow: a gap in the curve, not a scale
    all_losses = [loss for job in jobs for _, loss in job.losses if math.isfinite(loss)]
    if all_losses and min(all_losses) > 0 and max(all_losses) > 10 * min(all_losses):
        ax_loss.set_yscale("log")
    ax_loss.set(xlabel="samples seen", ylabel="train loss (mean over ranks)",
                title="Train loss per job")
    if any(job.losses for job in jobs):
        ax_loss.legend(fontsize="small")

    done = [(i, job) for i, job in enumerate(jobs) if job.completed]
    ax_speed.plot([i for i, _ in done], [job.summary["samples_per_s"] for _, job in done],
                  "o-")
    ticks = [(" ".join(job.overrides.get(k, "") for k in keys) or str(job.num))
             + ("" if job.completed else "\n(failed)") for job in jobs]
    ax_speed.set_xticks(range(len(jobs)), ticks)
    ax_speed.set(xlabel=", ".join(keys) or "job", ylabel="samples/s", title="Throughput")
    ax_speed.set_ylim(bottom=0)
    for ax in (ax_loss, ax_speed):
        ax.grid(True, alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return fig


@dataclass
class SweepSummary:
    jobs: int
    failed: int
    markdown: str


def write_summary(sweep_dir: Path) -> SweepSummary:
    """sweep_summary.csv, sweep_summary.md and sweep.png from the job dirs in sweep_dir."""
    jobs = read_jobs(sweep_dir)
    columns, rows = table(jobs)
    with open(sweep_dir / "sweep_summary.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=columns, restval="")
        writer.writeheader()
        writer.writerows(rows)
    text = markdown(sweep_dir, jobs, columns, rows)
    (sweep_dir / "sweep_summary.md").write_text(text)
    plot(jobs, sweep_dir / "sweep.png")
    return SweepSummary(len(rows), sum(r["status"] != "completed" for r in rows), text)


def main(argv: list[str]) -> int:
    if len(argv) != 1 or not Path(argv[0]).is_dir():
        print("usage: python -m gradsync.sweep <sweep dir>", file=sys.stderr)
        return 2
    result = write_summary(Path(argv[0]))
    print(result.markdown)
    return 1 if result.failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
