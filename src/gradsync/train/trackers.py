"""Experiment trackers, the `logger` config group (conf/logger/: tensorboard, the default, csv,
mlflow, wandb; several at once: logger=[tensorboard,mlflow]; docs/trackers.md). RunLog
(train/metrics.py), the one place a run's metrics are written, hands each tracker what it
writes: the config as params when the run starts, every metric at its step (the window: the
optimizer step attempt, as in metrics.jsonl and TensorBoard), the summary when it ends. Only
rank 0 builds trackers (run/worker.py asks core/ranks.py); no Hydra here.

A tracker with ``every_row`` gets each metrics.jsonl row's loss and LR at its window (train/loss,
train/lr: one point per row) and the other scalars at the log points, in step order (RunLog
holds them until the rows of their windows are in); TensorBoard (``every_row`` False) gets the
scalars as they come, as it always did (train/loss at the log points).

What each tracker made (its URI and run id) goes into summary.json's "trackers" and into the
run dir's trackers.json, where a resumed run finds its runs again and continues them. In a sweep
(run/callbacks.py) MLflow and W&B get one parent run for the sweep (MLflow: a parent run whose
children are the jobs' runs; W&B: a group, and a run of job_type sweep) holding the sweep's
summary; <sweep dir>/trackers.json records them.

MLflow and W&B are extras (gradsync[mlflow], gradsync[wandb]): without them the run is refused
in one line before any worker starts (their @checks).
"""

from __future__ import annotations

import csv
import json
import logging
import math
import os
import secrets
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gradsync.components import checks, require_extra

TRACKERS_FILE = "trackers.json"  # in a run dir: its trackers' runs; in a sweep dir: the parents
TENSORBOARD = "gradsync.train.trackers.TensorBoard"  # logger=tensorboard's _target_


@dataclass
class RunInfo:
    """What a tracker's run is started with."""

    run_dir: Path
    params: dict[str, Any]  # the config, flat: {"optimizer.lr": 0.1, ...}
    resumed_at: int  # the window the run continues after (0: a fresh run)
    previous: dict[str, Any] | None  # this tracker's entry in the run dir's trackers.json
    parent: dict[str, Any] | None  # a sweep job's: this tracker's entry in the sweep's file
    sweep_dir: Path | None = None


def read_file(path: Path) -> dict[str, Any]:
    try:
        out = json.loads((path / TRACKERS_FILE).read_text())
    except (OSError, ValueError):
        return {}
    return out if isinstance(out, dict) else {}


def write_file(path: Path, info: dict[str, Any]) -> None:
    from gradsync.core.files import replacing

    with replacing(path / TRACKERS_FILE) as f:
        json.dump(info, f, indent=2, sort_keys=True)
        f.write("\n")


def _new_id() -> str:
    """A W&B run id (8 characters of [0-9a-f]: unique enough for a project's runs)."""
    return secrets.token_hex(4)


def _status(summary: dict[str, Any] | None) -> str:
    """completed | interrupted | failed."""
    return str(summary.get("status", "failed")) if summary else "failed"


class Tracker:
    """The interface RunLog drives: start, log (metrics at a step), flush, finish."""

    every_row = True

    def start(self, run: RunInfo) -> dict[str, Any]:
        """Starts (or, resumed, continues) the tracker's run; returns what summary.json records
        of it: uri and run_id at least."""
        raise NotImplementedError

    def log(self, metrics: dict[str, float], step: int) -> None:
        raise NotImplementedError

    def flush(self) -> None:
        pass

    def finish(self, summary: dict[str, Any] | None, final: dict[str, float]) -> None:
        """summary: the run's (None: it failed before it had one); final: its summary values
        (train/metrics.final_metrics)."""
        raise NotImplementedError


class TensorBoard(Tracker):
    """tb/ in the run dir: every scalar as it is logged (the HParams tab's row is written by
    the job at the end: train/metrics.write_hparams)."""

    every_row = False

    def __init__(self) -> None:
        self.writer: Any = None
        self.dir: Path | None = None

    def start(self, run: RunInfo) -> dict[str, Any]:
        from torch.utils.tensorboard import SummaryWriter  # slow import: rank 0 only

        self.dir = run.run_dir / "tb"
        # a run continued from window w drops what an earlier attempt logged after w
        self.writer = SummaryWriter(log_dir=str(self.dir), purge_step=run.resumed_at + 1)
        return {"uri": str(self.dir), "run_id": None}

    def log(self, metrics: dict[str, float], step: int) -> None:
        for key, value in metrics.items():
            self.writer.add_scalar(key, value, step)

    def finish(self, summary: dict[str, Any] | None, final: dict[str, float]) -> None:
        self.writer.flush()
        self.writer.close()


class CSV(Tracker):
    """csv/ in the run dir: params.csv (name,value), metrics.csv (step,name,value: one line per
    metric and step; pandas' pivot makes it a table), summary.csv (name,value) at the end."""

    def __init__(self) -> None:
        self.dir: Path | None = None
        self.rows: list[tuple[int, str, float]] = []

    def start(self, run: RunInfo) -> dict[str, Any]:
        self.dir = run.run_dir / "csv"
        self.dir.mkdir(parents=True, exist_ok=True)
        self._write("params.csv", ["name", "value"], sorted(run.params.items()))
        metrics = self.dir / "metrics.csv"
        kept: list[list[str]] = []
        if run.resumed_at and metrics.exists():  # what an earlier attempt logged after w goes
            with open(metrics, newline="") as f:
                kept = [r for r in csv.reader(f) if r and r[0].isdigit()
                        and int(r[0]) <= run.resumed_at]
        self._write("metrics.csv", ["step", "name", "value"], kept)
        return {"uri": str(self.dir), "run_id": None}

    def _write(self, name: str, header: list[str], rows: Any) -> None:
        assert self.dir is not None
        with open(self.dir / name, "w", newline="") as f:
            out = csv.writer(f)
            out.writerow(header)
            out.writerows(rows)

    def log(self, metrics: dict[str, float], step: int) -> None:
        self.rows += [(step, k, v) for k, v in metrics.items()]

    def flush(self) -> None:
        assert self.dir is not None
        with open(self.dir / "metrics.csv", "a", newline="") as f:
            csv.writer(f).writerows(self.rows)
        self.rows = []

    def finish(self, summary: dict[str, Any] | None, final: dict[str, float]) -> None:
        self.flush()
        self._write("summary.csv", ["name", "value"],
                    [("status", _status(summary)), *sorted(final.items())])


def _needs_mlflow(args: dict[str, Any], ctx: Any) -> None:
    require_extra("mlflow", "mlflow", "logger=mlflow")


def _file_store(uri: str) -> bool:
    return uri.startswith("file:") or "://" not in uri


@checks(_needs_mlflow)
class MLflow(Tracker):
    """An MLflow run through mlflow's own client (MlflowClient): params, metrics by step, the
    summary (final/<name> metrics, summary.json as an artifact), its status. tracking_uri null:
    MLFLOW_TRACKING_URI, else a local file store, outputs/mlruns under the directory the job
    started in (MLflow 3 calls its file store "maintenance mode": gradsync allows it,
    MLFLOW_ALLOW_FILE_STORE=true, unless that says false); sqlite:///<path>: a database, its
    artifacts beside it (mlartifacts/)."""

    BATCH = 1000  # metrics per log_batch (MLflow's limit)

    def __init__(self, tracking_uri: str | None = None, experiment_name: str = "gradsync",
                 run_name: str | None = None, tags: dict[str, str] | None = None) -> None:
        self.tracking_uri, self.experiment_name = tracking_uri, experiment_name
        self.run_name, self.tags = run_name, dict(tags or {})
        self.client: Any = None
        self.run_id = ""
        self.pending: list[Any] = []

    def uri(self) -> str:
        uri = self.tracking_uri or os.environ.get("MLFLOW_TRACKING_URI") or \
            Path("outputs/mlruns").absolute().as_uri()
        if _file_store(uri):
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
        return uri

    def _client(self, uri: str) -> Any:
        logging.getLogger("mlflow").setLevel(logging.WARNING)  # its INFO lines: not the run's
        logging.getLogger("alembic").setLevel(logging.WARNING)
        from mlflow.tracking import MlflowClient

        return MlflowClient(tracking_uri=uri)

    def experiment(self, client: Any, uri: str) -> str:
        """The experiment's id, made if new (another job may make it at the same moment)."""
        from mlflow.exceptions import MlflowException

        found = client.get_experiment_by_name(self.experiment_name)
        if found is not None:
            return str(found.experiment_id)
        where = None
        if uri.startswith("sqlite:///"):  # artifacts beside the database, not in the cwd
            where = (Path(uri.removeprefix("sqlite:///")).parent / "mlartifacts").as_uri()
        try:
            return str(client.create_experiment(self.experiment_name, artifact_location=where))
        except MlflowException:
            found = client.get_experiment_by_name(self.experiment_name)
            if found is None:
                raise
            return str(found.experiment_id)

    def start(self, run: RunInfo) -> dict[str, Any]:
        require_extra("mlflow", "mlflow", "logger=mlflow")
        from mlflow.entities import Param

        uri = self.uri()
        self.client = client = self._client(uri)
        experiment = self.experiment(client, uri)
        previous = run.previous or {}
        if run.resumed_at and previous.get("uri") == uri and previous.get("run_id"):
            self.run_id = previous["run_id"]  # the same run, continued
            client.update_run(self.run_id, status="RUNNING")
        else:
            tags = {"gradsync.run_dir": str(run.run_dir), **self.tags}
            if run.parent:
                tags["mlflow.parentRunId"] = run.parent["run_id"]
            self.run_id = client.create_run(experiment, run_name=self.run_name or
                                            run.run_dir.name, tags=tags).info.run_id
            params = [Param(k, str(v)[:6000]) for k, v in sorted(run.params.items())]
            for i in range(0, len(params), 100):  # MLflow takes 100 params per batch
                client.log_batch(self.run_id, params=params[i:i + 100])
        return {"uri": uri, "run_id": self.run_id, "experiment_id": experiment}

    def log(self, metrics: dict[str, float], step: int) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        self.pending += [Metric(k, float(v), now, step) for k, v in metrics.items()]

    def flush(self) -> None:
        for i in range(0, len(self.pending), self.BATCH):
            self.client.log_batch(self.run_id, metrics=self.pending[i:i + self.BATCH])
        self.pending = []

    def finish(self, summary: dict[str, Any] | None, final: dict[str, float]) -> None:
        self.flush()
        step = int(summary.get("optimizer_steps") or 0) if summary else 0
        for key, value in final.items():
            if math.isfinite(value):
                self.log({f"final/{key.removeprefix('final_')}": value}, step)
        self.flush()
        if summary:
            self.client.log_dict(self.run_id, summary, "summary.json")
        status = _status(summary)
        self.client.set_tag(self.run_id, "gradsync.status", status)
        self.client.set_terminated(self.run_id, {"completed": "FINISHED",
                                                 "interrupted": "KILLED"}.get(status, "FAILED"))

    # --- a sweep's parent run ----------------------------------------------------------------
    def start_sweep(self, sweep_dir: Path, previous: dict[str, Any] | None) -> dict[str, Any]:
        require_extra("mlflow", "mlflow", "logger=mlflow")
        uri = self.uri()
        client = self._client(uri)
        experiment = self.experiment(client, uri)
        if previous and previous.get("uri") == uri:  # a search started again: its parent
            client.update_run(previous["run_id"], status="RUNNING")
            return previous
        run = client.create_run(experiment, run_name=self.run_name or sweep_dir.name,
                                tags={"gradsync.sweep_dir": str(sweep_dir), **self.tags})
        return {"uri": uri, "run_id": run.info.run_id, "experiment_id": experiment}

    def finish_sweep(self, parent: dict[str, Any], sweep_dir: Path,
                     counts: dict[str, int]) -> dict[str, Any]:
        """The sweep's summary (jobs_total, jobs_completed, jobs_failed; sweep_summary.md and
        .csv as artifacts) to its parent run, which ends; returns what the sweep records."""
        client = self._client(parent["uri"])
        run_id = parent["run_id"]
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        client.log_batch(run_id, metrics=[Metric(f"jobs_{k}", float(v), now, 0)
                                          for k, v in counts.items()])
        for name in ("sweep_summary.md", "sweep_summary.csv"):
            if (sweep_dir / name).exists():
                client.log_artifact(run_id, str(sweep_dir / name))
        client.set_terminated(run_id, "FINISHED")
        return parent


def _needs_wandb(args: dict[str, Any], ctx: Any) -> None:
    require_extra("wandb", "wandb", "logger=wandb")


@checks(_needs_wandb)
class WandB(Tracker):
    """A Weights & Biases run: the config, metrics by step, the summary (run.summary).
    mode: null (wandb's own: WANDB_MODE, online once logged in), online, offline (files only,
    in dir/wandb/: `wandb sync` uploads them) or disabled; dir null: the run dir."""

    def __init__(self, project: str = "gradsync", entity: str | None = None,
                 mode: str | None = None, dir: str | None = None, group: str | None = None,
                 name: str | None = None, tags: list[str] | None = None) -> None:
        self.project, self.entity, self.mode, self.dir = project, entity, mode, dir
        self.group, self.name, self.tags = group, name, list(tags or [])
        self.run: Any = None

    def _init(self, where: Path, run_id: str, **kwargs: Any) -> Any:
        wandb = require_extra("wandb", "wandb", "logger=wandb")
        where.mkdir(parents=True, exist_ok=True)
        return wandb.init(project=self.project, entity=self.entity, mode=self.mode,
                          dir=str(where), id=run_id, resume="allow", tags=self.tags or None,
                          settings=wandb.Settings(silent=True, console="off"), **kwargs)

    def _info(self, run: Any) -> dict[str, Any]:
        url = None if run.offline else run.url  # offline: the run's own folder
        return {"uri": url or str(Path(run.dir).parent), "run_id": run.id,
                "project": self.project, "group": run.group or None}

    def start(self, run: RunInfo) -> dict[str, Any]:
        previous = run.previous or {}
        run_id = previous["run_id"] if run.resumed_at and previous.get("run_id") else \
            _new_id()
        parent = run.parent or {}
        config = dict(run.params)
        if parent:
            config["gradsync.sweep_parent"] = parent["run_id"]
        self.run = self._init(Path(self.dir) if self.dir else run.run_dir, run_id,
                              name=self.name or run.run_dir.name, config=config,
                              group=self.group or parent.get("group"), job_type="train")
        return self._info(self.run)

    def log(self, metrics: dict[str, float], step: int) -> None:
        self.run.log(metrics, step=step)

    def finish(self, summary: dict[str, Any] | None, final: dict[str, float]) -> None:
        self.run.summary.update({**final, "status": _status(summary)})
        self.run.finish(exit_code=0 if _status(summary) != "failed" else 1)

    def start_sweep(self, sweep_dir: Path, previous: dict[str, Any] | None) -> dict[str, Any]:
        require_extra("wandb", "wandb", "logger=wandb")
        if previous:
            return previous
        group = self.group or f"{sweep_dir.name}-{_new_id()}"
        return {"uri": None, "run_id": _new_id(), "group": group,
                "project": self.project}

    def finish_sweep(self, parent: dict[str, Any], sweep_dir: Path,
                     counts: dict[str, int]) -> dict[str, Any]:
        """The sweep's own run (job_type sweep) in the group, with the summary table; returns
        what the sweep records of it."""
        run = self._init(Path(self.dir) if self.dir else sweep_dir, parent["run_id"],
                         name=self.name or sweep_dir.name, group=parent["group"],
                         job_type="sweep", config={"sweep_dir": str(sweep_dir)})
        run.summary.update({f"jobs_{k}": v for k, v in counts.items()})
        table = sweep_dir / "sweep_summary.csv"
        if table.exists():
            import wandb

            with open(table, newline="") as f:
                rows = list(csv.reader(f))
            if rows:
                columns: Any = rows[0]
                run.log({"sweep_summary": wandb.Table(columns=columns, data=rows[1:])})
        info = {**parent, **self._info(run)}
        run.finish()
        return info
