"""Experiment trackers (train/trackers.py, the `logger` group): what RunLog hands each tracker
(every metrics.jsonl row's loss and LR, every scalar at its window, in step order; TensorBoard
as it always was), and a real run logging to TensorBoard, CSV, MLflow (a SQLite database, read
back with mlflow's own MlflowClient at the URI summary.json names) and W&B (offline, its run
file read back) at once. A sweep's parent and child runs: test_sweep.py. Without an extra: one
line naming it."""

from __future__ import annotations

import csv
import json
import struct
import subprocess
import sys
from pathlib import Path

import pytest

from gradsync.run.main import compose_plain
from gradsync.run.preflight import preflight
from gradsync.train import trackers
from gradsync.train.metrics import RunLog, flat_hparams

# --- what RunLog hands a tracker ---------------------------------------------------------------


class Recorder(trackers.Tracker):
    def __init__(self, every_row: bool = True):
        self.every_row = every_row
        self.logged: list[tuple[int, dict]] = []
        self.flushes = 0
        self.started = self.ended = None

    def start(self, run):
        self.started = run
        return {"uri": "mem", "run_id": "r1"}

    def log(self, metrics, step):
        self.logged.append((step, dict(metrics)))

    def flush(self):
        self.flushes += 1

    def finish(self, summary, final):
        self.ended = (summary, final)


def rows(first: int, last: int) -> list[dict]:
    return [{"window": w, "step": w, "loss": 1.0 / w, "lr": 0.1 * w} for w in
            range(first, last + 1)]


def test_runlog_hands_each_tracker_every_row_and_scalar_in_step_order(tmp_path):
    ordered, direct = Recorder(), Recorder(every_row=False)
    log = RunLog(tmp_path, active=True, trackers={"a": ordered, "tb": direct},
                 params={"optimizer.lr": 0.1}, start_window=0)
    assert ordered.started.params == {"optimizer.lr": 0.1} and ordered.started.resumed_at == 0
    # a log point as StepLog.flush makes it: a drift scalar of window 3 before the rows 1..5,
    # then the log point's scalars, then an evaluation
    log.scalars(3, {"sync/replica_drift": 0.5})
    log.steps(rows(1, 5))
    log.scalars(5, {"train/loss": 0.2, "train/lr": 0.5, "perf/samples_per_s": 10.0})
    log.scalars(5, {"eval/loss": 0.3})
    log.steps(rows(6, 10))
    log.scalars(10, {"train/loss": 0.1, "train/lr": 1.0, "perf/samples_per_s": 11.0})
    assert tracking_summary(log) == {"a": {"uri": "mem", "run_id": "r1"},
                                     "tb": {"uri": "mem", "run_id": "r1"}}
    assert max(s for s, _ in ordered.logged) == 5  # the rows 6..10 wait for the next flush
    log.close()  # never finished: the run failed, its trackers' runs end as failed
    assert ordered.ended == (None, {}) and direct.ended == (None, {})
    steps = [s for s, _ in ordered.logged]
    assert steps == sorted(steps) == list(range(1, 11))  # one call per step, in order
    by_step = dict(ordered.logged)
    for w in range(1, 11):  # every row's loss and LR; the log point's own train/* not twice
        assert by_step[w]["train/loss"] == 1.0 / w and by_step[w]["train/lr"] == 0.1 * w
    assert by_step[3]["sync/replica_drift"] == 0.5
    assert by_step[5] == {"train/loss": 0.2, "train/lr": 0.5, "perf/samples_per_s": 10.0,
                          "eval/loss": 0.3}
    # TensorBoard-like: the scalars as they come, train/loss at the log points only
    assert direct.logged == [(3, {"sync/replica_drift": 0.5}),
                             (5, {"train/loss": 0.2, "train/lr": 0.5,
                                  "perf/samples_per_s": 10.0}),
                             (5, {"eval/loss": 0.3}),
                             (10, {"train/loss": 0.1, "train/lr": 1.0,
                                   "perf/samples_per_s": 11.0})]
    assert json.loads((tmp_path / "trackers.json").read_text())["a"]["run_id"] == "r1"


def tracking_summary(log: RunLog) -> dict:
    return {k: v for k, v in log.info.items()}


def test_a_resumed_run_hands_its_trackers_their_earlier_runs(tmp_path):
    first = Recorder()
    RunLog(tmp_path, active=True, trackers={"a": first}).close()
    again = Recorder()
    RunLog(tmp_path, active=True, trackers={"a": again}, start_window=7).close()
    assert again.started.resumed_at == 7
    assert again.started.previous == {"uri": "mem", "run_id": "r1"}


def test_mlflows_default_store_is_outputs_mlruns_where_the_job_started(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    assert trackers.MLflow().uri() == (tmp_path / "outputs" / "mlruns").as_uri()
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "sqlite:////x/mlflow.db")
    assert trackers.MLflow().uri() == "sqlite:////x/mlflow.db"
    assert trackers.MLflow(tracking_uri="http://h:5000").uri() == "http://h:5000"


def test_the_logger_group_composes_one_or_several_trackers():
    assert compose_plain([])["logger"] == {"tensorboard": {
        "_target_": "gradsync.train.trackers.TensorBoard"}}
    cfg = preflight(compose_plain(["logger=[tensorboard,csv,mlflow,wandb]",
                                   "logger.wandb.mode=offline"]))
    assert list(cfg.logger) == ["tensorboard", "csv", "mlflow", "wandb"]
    assert cfg.logger["wandb"].args["mode"] == "offline"
    from gradsync.train.repro import config_hash

    assert config_hash(cfg.to_plain()) == config_hash(preflight(compose_plain([])).to_plain())


# --- reading W&B's offline run file -------------------------------------------------------------
def wandb_records(run_dir: Path) -> list:
    """The records of a W&B offline run (run-<id>.wandb): the LevelDB log format W&B writes
    (a 7-byte header ':W&B' + magic + version, then 32 KiB blocks of records, each a 7-byte
    header: crc32, length, type FULL/FIRST/MIDDLE/LAST), each record a wandb_internal Record."""
    from wandb.proto import wandb_internal_pb2 as pb

    data = next(run_dir.glob("run-*.wandb")).read_bytes()
    assert data[:4] == b":W&B"
    block, pos, out, part = 32768, 7, [], b""
    while pos + 7 <= len(data):
        left = block - pos % block
        if left < 7:
            pos += left
            continue
        _, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        if length == 0 and kind == 0:  # the block's padding
            pos += left
            continue
        payload, pos = data[pos + 7:pos + 7 + length], pos + 7 + length
        if kind == 1:
            out.append(payload)
        elif kind in (2, 3):
            part += payload
        elif kind == 4:
            out.append(part + payload)
            part = b""
    records = []
    for payload in out:
        record = pb.Record()
        record.ParseFromString(payload)
        records.append(record)
    return records


def wandb_run(run_dir: Path) -> dict:
    """A W&B offline run as its file holds it: the run record, history rows, summary, exit."""
    records = wandb_records(run_dir)
    kind = [r.WhichOneof("record_type") for r in records]
    run = next(r.run for r, k in zip(records, kind, strict=True) if k == "run")
    history = [{i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in r.history.item}
               for r, k in zip(records, kind, strict=True) if k == "history"]
    summary = {}
    for r, k in zip(records, kind, strict=True):
        if k == "summary":
            summary |= {i.key or "/".join(i.nested_key): json.loads(i.value_json)
                        for i in r.summary.update}
    exits = [r.exit.exit_code for r, k in zip(records, kind, strict=True) if k == "exit"]
    return {"id": run.run_id, "group": run.run_group, "job_type": run.job_type,
            "config": {i.key: json.loads(i.value_json) for i in run.config.update},
            "history": history, "summary": summary, "exit": exits}


def jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


# --- a run, every tracker at once -----------------------------------------------------------
@pytest.mark.slow
def test_a_run_logs_its_config_every_metric_and_its_summary_to_every_tracker(tmp_path,
                                                                           cli_env):
    from mlflow.tracking import MlflowClient
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    run_dir, db = tmp_path / "run", tmp_path / "ml" / "mlflow.db"
    db.parent.mkdir()
    overrides = ["data=synthetic", "trainer.max_steps=12", "trainer.log_every_windows=5",
                 "trainer.eval_every_steps=5", "trainer.progress_bar=false",
                 "logger=[tensorboard,csv,mlflow,wandb]",
                 f"logger.mlflow.tracking_uri=sqlite:///{db}", "logger.wandb.mode=offline"]
    proc = subprocess.run(
        [sys.executable, "-m", "gradsync.run.main", f"hydra.run.dir={run_dir}", *overrides],
        capture_output=True, text=True, env=cli_env, timeout=300)
    assert proc.returncode == 0, proc.stderr
    s = json.loads((run_dir / "summary.json").read_text())
    made = s["trackers"]
    assert made == json.loads((run_dir / "trackers.json").read_text())
    assert made["tensorboard"] == {"uri": str(run_dir / "tb"), "run_id": None}
    assert made["csv"] == {"uri": str(run_dir / "csv"), "run_id": None}
    steps, evals = jsonl(run_dir / "metrics.jsonl"), jsonl(run_dir / "evals.jsonl")
    assert [r["window"] for r in steps] == list(range(1, 13)) and len(evals) == 3
    losses = [(r["window"], r["loss"]) for r in steps]
    eval_losses = [(e["window"], e["loss"]) for e in evals]
    config = preflight(compose_plain(overrides)).to_plain()
    params = flat_hparams({k: v for k, v in config.items() if k != "logger"})
    final_eval = s["eval"]["loss"]

    # MLflow, read back with its own client at the URI summary.json names
    ml = made["mlflow"]
    assert ml["uri"] == f"sqlite:///{db}"
    client = MlflowClient(tracking_uri=ml["uri"])
    run = client.get_run(ml["run_id"])
    assert run.info.status == "FINISHED" and run.data.tags["gradsync.status"] == "completed"
    assert run.data.tags["gradsync.run_dir"] == str(run_dir)
    history = client.get_metric_history(ml["run_id"], "train/loss")
    assert [(m.step, m.value) for m in history] == losses  # one point per metrics.jsonl row
    assert [(m.step, m.value) for m in client.get_metric_history(ml["run_id"], "train/lr")] \
        == [(r["window"], r["lr"]) for r in steps]
    assert [(m.step, m.value) for m in client.get_metric_history(ml["run_id"], "eval/loss")] \
        == eval_losses
    assert run.data.params == {k: str(v) for k, v in params.items()}
    assert run.data.metrics["final/eval_loss"] == final_eval
    assert run.data.metrics["final/train_loss"] == s["final_train_loss"]
    assert [a.path for a in client.list_artifacts(ml["run_id"])] == ["summary.json"]

    # W&B, offline: its run file read back
    wb = wandb_run(Path(made["wandb"]["uri"]))
    assert wb["id"] == made["wandb"]["run_id"] and wb["job_type"] == "train"
    assert Path(made["wandb"]["uri"]).parent == run_dir / "wandb"
    assert {k: wb["config"][k] for k in params} == params
    assert [(h["_step"], h["train/loss"]) for h in wb["history"]] == losses
    assert [(h["_step"], h["eval/loss"]) for h in wb["history"] if "eval/loss" in h] == \
        eval_losses
    assert wb["summary"]["eval_loss"] == final_eval and wb["summary"]["status"] == "completed"
    assert wb["exit"] == [0]

    # CSV
    with open(run_dir / "csv" / "metrics.csv", newline="") as f:
        got = list(csv.DictReader(f))
    assert [(int(r["step"]), float(r["value"])) for r in got if r["name"] == "train/loss"] == \
        losses
    with open(run_dir / "csv" / "params.csv", newline="") as f:
        assert {r["name"]: r["value"] for r in csv.DictReader(f)} == {
            k: str(v) for k, v in params.items()}
    with open(run_dir / "csv" / "summary.csv", newline="") as f:
        final = {r["name"]: r["value"] for r in csv.DictReader(f)}
    assert final["status"] == "completed" and float(final["eval_loss"]) == final_eval

    # TensorBoard: as it always was (train/loss at the log points), and the HParams row
    acc = EventAccumulator(str(run_dir / "tb"))
    acc.Reload()
    assert [e.step for e in acc.Scalars("train/loss")] == [5, 10, 12]
    assert acc.Scalars("final/eval_loss")[0].value == pytest.approx(final_eval)


@pytest.mark.slow
def test_a_tracker_whose_extra_is_missing_is_one_line_naming_it(tmp_path, cli_env,
                                                                  monkeypatch):
    run_dir = tmp_path / "run"
    from gradsync.components import ConfigError

    for blocked, logger, line in [  # W&B's the same way, in-process: below
            ("mlflow", "mlflow", "logger=mlflow needs mlflow: pip install 'gradsync[mlflow]'")]:
        code = (f"import sys; sys.modules[{blocked!r}] = None; "
                "from gradsync.run.main import main; main()")
        proc = subprocess.run([sys.executable, "-c", code, f"hydra.run.dir={run_dir}",
                               f"logger={logger}", "trainer.max_steps=1"],
                              capture_output=True, text=True, env=cli_env, timeout=300)
        assert proc.returncode == 2, proc.stderr
        assert proc.stderr.splitlines() == [f"gradsync: config error: {line}"]
        assert not run_dir.exists()
    monkeypatch.setitem(sys.modules, "wandb", None)
    with pytest.raises(ConfigError) as e:
        preflight(compose_plain(["logger=[tensorboard,wandb]"]))
    assert str(e.value) == "logger=wandb needs wandb: pip install 'gradsync[wandb]'"
