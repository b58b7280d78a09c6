"""What a run records, written by rank 0 only: TensorBoard scalars under tb/, one JSON line per
optimizer step in metrics.jsonl, one per evaluation in evals.jsonl, and summary.json at the
end. Other ranks get a RunLog that writes nothing, so the loop never asks which rank it is."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from gradsync.core.files import replacing


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


class RunLog:
    """Rank 0's writer; ``RunLog(run_dir, active=False)`` on the other ranks."""

    def __init__(self, run_dir: Path, active: bool, total_steps: int = 0,
                 progress_bar: bool = False, start_window: int = 0):
        self.active = active
        self.run_dir = run_dir
        self.tb: Any = None
        self.jsonl: Any = None
        self.eval_jsonl: Any = None
        self.bar: Any = None
        if not active:
            return
        from torch.utils.tensorboard import SummaryWriter  # slow import: rank 0 only

        # A run continued from window w drops what an earlier attempt logged after w.
        keep_rows_through(run_dir / "metrics.jsonl", start_window)
        keep_rows_through(run_dir / "evals.jsonl", start_window)
        self.tb = SummaryWriter(log_dir=str(run_dir / "tb"), purge_step=start_window + 1)
        self.jsonl = open(run_dir / "metrics.jsonl", "a", buffering=1)
        self.eval_jsonl = open(run_dir / "evals.jsonl", "a", buffering=1)
        if progress_bar:
            from tqdm import tqdm

            self.bar = tqdm(total=total_steps, initial=start_window, desc="train", unit="step",
                            dynamic_ncols=True, mininterval=0.5)

    def steps(self, rows: list[dict[str, Any]]) -> None:
        """One row per optimizer step (written in batches at log points)."""
        if not self.active:
            return
        for row in rows:
            self.jsonl.write(json.dumps(row) + "\n")
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
        for key, value in values.items():
            self.tb.add_scalar(key, value, step)
        if self.bar is not None:
            shown = {k.split("/")[-1]: f"{v:.4g}" for k, v in values.items()
                     if k in ("train/loss", "perf/samples_per_s", "eval/accuracy", "eval/loss")}
            self.bar.set_postfix(shown, refresh=False)

    def close(self) -> None:
        if not self.active:
            return
        if self.bar is not None:
            self.bar.close()
        self.tb.flush()
        self.tb.close()
        self.jsonl.close()
        self.eval_jsonl.close()


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
