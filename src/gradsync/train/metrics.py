"""What a run records, written by rank 0 only: one JSON line per optimizer step in metrics.jsonl,
one per evaluation in evals.jsonl, every metric to the run's experiment trackers (the `logger`
group, train/trackers.py: TensorBoard scalars under tb/ by default), and summary.json at the
end. Other ranks get a RunLog that writes nothing, so the loop never asks which rank it is."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from gradsync.core.files import replacing
from gradsync.train import trackers as tracking


def keep_rows_through(path: Path, window: int) -> None:
    """Rewrite metrics.jsonl with its rows up to `window` only (a torn last line dropped)."""
    if not path.exists():
        return
    kept = []
    for line in path.read_text().splitlines():
        try:
            if json.loads(line)["window"] <= window:
                kept.append(line + "\n")
        except (ValueError, KeyError, TypeError):
            pass
    with replacing(path) as f:
        f.write("".join(kept))


# a metrics.jsonl row's fields that trackers with every_row get at the row's window
PER_ROW = {"train/loss": "loss", "train/lr": "lr"}


class RunLog:
    """Rank 0's writer; ``RunLog(run_dir, active=False)`` on the other ranks. trackers: the
    run's experiment trackers by name (None: TensorBoard alone, the default logger), started
    with params (the config, flat) and, in a sweep, the sweep's parent runs by tracker name."""

    def __init__(self, run_dir: Path, active: bool, total_steps: int = 0,
                 progress_bar: bool = False, start_window: int = 0,
                 trackers: dict[str, tracking.Tracker] | None = None,
                 params: dict[str, Any] | None = None,
                 parents: dict[str, Any] | None = None):
        self.active = active
        self.run_dir = run_dir
        self.jsonl: Any = None
        self.eval_jsonl: Any = None
        self.bar: Any = None
        self.trackers: dict[str, tracking.Tracker] = {}
        self.info: dict[str, Any] = {}  # what each tracker made: summary.json's "trackers"
        self.pending: dict[int, dict[str, float]] = {}  # every_row trackers' metrics by step
        self.finished = False
        if not active:
            return
        run_dir.mkdir(parents=True, exist_ok=True)
        # A run continued from window w drops what an earlier attempt logged after w.
        keep_rows_through(run_dir / "metrics.jsonl", start_window)
        keep_rows_through(run_dir / "evals.jsonl", start_window)
        self.jsonl = open(run_dir / "metrics.jsonl", "a", buffering=1)
        self.eval_jsonl = open(run_dir / "evals.jsonl", "a", buffering=1)
        chosen = {"tensorboard": tracking.TensorBoard()} if trackers is None else trackers
        previous = tracking.read_file(run_dir)
        try:
            for name, tracker in chosen.items():
                self.info[name] = tracker.start(tracking.RunInfo(
                    run_dir, params or {}, start_window, previous.get(name),
                    (parents or {}).get(name)))
                self.trackers[name] = tracker
        except BaseException:  # the ones that started end as failed; the error is the run's
            self.ordered = []
            self._end_failed()
            raise
        finally:
            tracking.write_file(run_dir, self.info)  # a resumed run continues these runs
        self.ordered = [t for t in self.trackers.values() if t.every_row]
        self.direct = [t for t in self.trackers.values() if not t.every_row]
        if progress_bar:
            from tqdm import tqdm

            self.bar = tqdm(total=total_steps, initial=start_window, desc="train", unit="step",
                            dynamic_ncols=True, mininterval=0.5)

    def _hold(self, step: int, values: dict[str, float]) -> None:
        if values and self.ordered:
            self.pending.setdefault(step, {}).update(values)

    def _release(self, below: float) -> None:
        """The held metrics of the steps below `below`, in step order (the rows of a log point
        come after scalars of their windows, and a tracker such as W&B takes steps in order
        only)."""
        steps = sorted(s for s in self.pending if s < below)
        for step in steps:
            metrics = self.pending.pop(step)
            for tracker in self.ordered:
                tracker.log(metrics, step)
        if steps:
            for tracker in self.ordered:
                tracker.flush()

    def steps(self, rows: list[dict[str, Any]]) -> None:
        """One row per optimizer step (written in batches at log points)."""
        if not self.active:
            return
        if rows:
            self._release(rows[0]["window"])
        for row in rows:
            self.jsonl.write(json.dumps(row) + "\n")
            self._hold(row["window"], {k: row[f] for k, f in PER_ROW.items() if f in row})
        if self.bar is not None and rows:
            self.bar.update(len(rows))

    def evals(self, row: dict[str, Any]) -> None:
        """One row per evaluation: where the run stood (window, samples, bytes, seconds) and
        the held-out metrics."""
        if self.active:
            self.eval_jsonl.write(json.dumps(row) + "\n")

    def scalars(self, step: int, values: dict[str, float]) -> None:
        if not self.active:
            return
        for tracker in self.direct:
            tracker.log(values, step)
        self._hold(step, {k: v for k, v in values.items() if k not in PER_ROW})
        if self.bar is not None:
            shown = {k.split("/")[-1]: f"{v:.4g}" for k, v in values.items()
                     if k in ("train/loss", "perf/samples_per_s", "eval/accuracy", "eval/loss")}
            self.bar.set_postfix(shown, refresh=False)

    def finish(self, summary: dict[str, Any]) -> dict[str, Any]:
        """The run's summary to every tracker (its final metrics, its status), which ends their
        runs; returns what each tracker made (uri, run_id), for summary.json."""
        if not self.active or self.finished:
            return dict(self.info)
        self._release(math.inf)
        final = final_metrics(summary) if summary.get("status") != "failed" else {}
        self.finished = True
        for tracker in self.trackers.values():
            tracker.finish(summary, final)
        return dict(self.info)

    def close(self) -> None:
        if not self.active:
            return
        if self.bar is not None:
            self.bar.close()
        try:
            self._end_failed()
        finally:
            self.jsonl.close()
            self.eval_jsonl.close()

    def _end_failed(self) -> None:
        """A run that failed: its trackers' runs end as failed, as far as they can (the run's
        own error is what counts)."""
        if self.finished:
            return
        self.finished = True
        for step in (lambda: self._release(math.inf), *(
                lambda t=t: t.finish(None, {}) for t in self.trackers.values())):
            try:
                step()
            except Exception:
                pass


def tracking_of(cfg: Any) -> dict[str, Any]:
    """RunLog's trackers, params and parents for a run's config (config/schema.py RunConfig):
    its logger group's trackers built, the config flat (the logger left out), a sweep job's
    parent runs (<sweep dir>/trackers.json)."""
    from gradsync.components import build

    plain = {k: v for k, v in cfg.to_plain().items() if k != "logger"}
    return {"trackers": {name: build(c.node) for name, c in cfg.logger.items()},
            "params": flat_hparams(plain),
            "parents": tracking.read_file(Path(cfg.sweep_dir)) if cfg.sweep_dir else None}


def final_metrics(summary: dict[str, Any]) -> dict[str, float]:
    """The numbers runs are compared by: a sweep's summary columns and TensorBoard's HParams
    metrics. Per-rank counters are rank 0's (every rank joins every all-reduce); the bytes per
    optimizer step add rank 0's all-reduce, reduce-scatter and all-gather bytes; gradient and
    peak memory are the largest rank's."""
    out = {"final_train_loss": summary["final_train_loss"]}
    out |= {f"eval_{k}": v for k, v in sorted(summary["eval"].items())}
    out |= {"samples_per_s": summary["samples_per_s"],
            "sync_backwards": summary["sync_backwards"][0],
            "allreduce_calls": summary["allreduce_calls"][0],
            "allreduce_bytes": summary["allreduce_bytes"][0],
            "peak_rss_mb": summary["peak_rss_mb"]}
    for rank, mb in enumerate(summary.get("peak_gpu_mem_mb") or []):
        out[f"peak_gpu_mem_mb_rank{rank}"] = mb
    if "reduce_scatter_bytes" in summary:  # a sharded engine
        out |= {k: summary[k][0] for k in ("reduce_scatter_bytes", "all_gather_bytes")}
    out["sent_bytes"] = out["allreduce_bytes"] + out.get("reduce_scatter_bytes", 0) \
        + out.get("all_gather_bytes", 0)
    if "memory" in summary:
        mem = summary["memory"]
        steps = summary.get("optimizer_steps") or 0
        moved = summary["allreduce_bytes"][0] + summary.get("reduce_scatter_bytes", [0])[0] \
            + summary.get("all_gather_bytes", [0])[0]
        out |= {"comm_bytes_per_step": moved / steps if steps else 0.0,
                "grad_held_bytes": max(mem["grad_held_bytes"])}
        peaks = [mb for mb in mem["peak_mb"] if mb is not None]
        if peaks:
            out["peak_mem_mb"] = max(peaks)
    out |= {k: summary[k] for k in ("train_s", "wall_s", "max_replica_drift", "noise_scale")
            if summary.get(k) is not None}
    return out


def flat_hparams(cfg: dict[str, Any], prefix: str = "") -> dict[str, float | str]:
    """{"optimizer.lr": 0.1, "model.hidden_sizes": "[128, 128]", ...}: numbers stay numbers,
    everything else (lists, booleans) becomes text TensorBoard can filter on."""
    out: dict[str, float | str] = {}
    for key, value in cfg.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            out |= flat_hparams(value, f"{name}.")
        elif isinstance(value, (int, float)) and not isinstance(value, bool):
            out[name] = value
        else:
            out[name] = str(value)
    return out


def write_hparams(tb_dir: Path, hparams: dict[str, float | str], metrics: dict[str, float],
                  step: int) -> None:
    """The run's hyperparameters and final metrics (as scalars "final/<name>") for TensorBoard's
    HParams tab, in the run's own tb/ dir as Lightning does. Only the session summaries, no
    experiment summary: TensorBoard then takes the columns from every run under --logdir, where
    one experiment summary per run would make it show the first run's columns only."""
    from torch.utils.tensorboard import SummaryWriter
    from torch.utils.tensorboard.summary import hparams as hparams_summaries

    tags = {f"final/{k.removeprefix('final_')}": float(v) for k, v in metrics.items()}
    _, session_start, session_end = hparams_summaries(hparams, tags)
    with SummaryWriter(log_dir=str(tb_dir)) as writer:
        writer.file_writer.add_summary(session_start, step)
        writer.file_writer.add_summary(session_end, step)
        for tag, value in tags.items():
            writer.add_scalar(tag, value, step)
