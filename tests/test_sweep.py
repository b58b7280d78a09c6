"""Hydra multirun sweeps end to end: real jobs (each spawning 2 gloo workers), the summary the
multirun-end callback writes from the job dirs, the plot, TensorBoard's HParams view, a failed
job, jobs run two at once by the joblib launcher, and the fixed-global-batch equivalence."""

from __future__ import annotations

import csv
import json
import os
import re
import shutil
import signal
import socket
import struct
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import yaml
from hydra import compose, initialize_config_dir

from cli_jobs import Job
from gradsync.config.hydra import to_plain
from gradsync.config.schema import RunConfig
from gradsync.run import rundir, sweep
from gradsync.run.main import CONF_DIR, register_schemas
from gradsync.run.preflight import preflight
from gradsync.train.metrics import final_metrics, flat_hparams
from gradsync.train.schedules import build_schedule

register_schemas()
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def multirun(sweep_dir: Path, *args: str, env: dict) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "gradsync.run.main", "-m", f"hydra.sweep.dir={sweep_dir}",
         "trainer.progress_bar=false", *args],
        capture_output=True, text=True, env=env, timeout=600)


def summaries(sweep_dir: Path, jobs: int) -> list[dict]:
    return [json.loads((sweep_dir / str(j) / "summary.json").read_text()) for j in range(jobs)]


def csv_rows(sweep_dir: Path) -> list[dict[str, str]]:
    with open(sweep_dir / "sweep_summary.csv", newline="") as f:
        return list(csv.DictReader(f))


# --- presets and pure helpers (no processes) -------------------------------------------------
def compose_with_hydra(overrides: list[str], with_hydra: bool = True):
    with initialize_config_dir(config_dir=CONF_DIR, version_base="1.3"):
        return compose("config", overrides=overrides, return_hydra_config=with_hydra)


def test_accum_sweep_preset_sweeps_n_at_fixed_micro_batch():
    cfg = compose_with_hydra(["experiment=accum_sweep"])
    assert dict(cfg.hydra.sweeper.params) == {"schedule.window_size": "1,2,4,8"}
    assert cfg.schedule.name == "constant"
    assert cfg.sync._target_ == "gradsync.sync.policies.AccumulateSync"
    assert cfg.data._target_ == "gradsync.data.digits"  # the default data, as make sweep promises
    assert cfg.hydra.callbacks.sweep_summary._target_ == "gradsync.run.callbacks.SweepSummary"


def test_fixed_global_batch_preset_derives_n_from_each_micro_batch():
    cfg = compose_with_hydra(["experiment=fixed_global_batch"])
    assert dict(cfg.hydra.sweeper.params) == {"schedule.micro_batch_size": "16,32,64"}
    ns = []
    for micro in (16, 32, 64):
        plain = to_plain(compose_with_hydra(["experiment=fixed_global_batch",
                                             f"schedule.micro_batch_size={micro}"], False))
        preflight(plain)
        schedule = build_schedule(RunConfig.from_plain(plain).schedule,
                                  plain["trainer"]["devices"])
        ns.append(schedule.window_size(0))
    assert ns == [4, 2, 1]  # 2 ranks x micro x N = 128 every time


def test_flat_hparams_and_final_metrics():
    assert flat_hparams({"a": {"b": 1, "c": [1, 2]}, "d": True, "e": 0.5, "f": "x"}) == \
        {"a.b": 1, "a.c": "[1, 2]", "d": "True", "e": 0.5, "f": "x"}
    s = {"final_train_loss": 0.5, "eval": {"loss": 0.7, "accuracy": 0.9}, "samples_per_s": 10.0,
         "sync_backwards": [3, 3], "allreduce_calls": [6, 6], "allreduce_bytes": [80, 80],
         "peak_rss_mb": 300.0, "train_s": 1.0}
    assert final_metrics(s) == {"final_train_loss": 0.5, "eval_accuracy": 0.9, "eval_loss": 0.7,
                                "samples_per_s": 10.0, "sync_backwards": 3,
                                "allreduce_calls": 6, "allreduce_bytes": 80, "sent_bytes": 80,
                                "peak_rss_mb": 300.0, "train_s": 1.0}


def test_swept_keys_are_the_overrides_that_differ():
    def job(num, **overrides):
        return sweep.Job(num, Path(str(num)), overrides, {}, [])

    jobs = [job(0, data="synthetic", lr="0.1", n="1"), job(1, data="synthetic", lr="0.1", n="2")]
    assert sweep.swept_keys(jobs) == ["n"]
    assert sweep.swept_keys(jobs[:1]) == ["data", "lr", "n"]  # a lone job: all of them


# --- a real 3-job sweep (basic launcher, jobs one after another) ------------------------------
ACCUM = (1, 2, 4)


@pytest.fixture(scope="module")
def accum_sweep(tmp_path_factory, cli_env_module):
    """Logging to MLflow (its local file store) and W&B (offline) besides TensorBoard: their
    stores outside the sweep dir (test_a_sweep_logs_a_parent_run_with_a_child_per_job)."""
    top = tmp_path_factory.mktemp("accum")
    sweep_dir = top / "sweep"
    proc = multirun(sweep_dir, "experiment=accum_sweep", "data=synthetic",
                    "schedule.window_size=" + ",".join(map(str, ACCUM)), "trainer.max_steps=2",
                    "trainer.log_every_windows=1", "logger=[tensorboard,mlflow,wandb]",
                    f"logger.mlflow.tracking_uri={(top / 'mlruns').as_uri()}",
                    "logger.wandb.mode=offline", f"logger.wandb.dir={top / 'wb'}",
                    env=cli_env_module)
    assert proc.returncode == 0, proc.stderr
    return sweep_dir, proc


@pytest.mark.slow
def test_sweep_summary_has_one_row_per_job_equal_to_its_summary_json(accum_sweep):
    sweep_dir, proc = accum_sweep
    assert sorted(p.name for p in sweep_dir.iterdir() if p.is_dir()) == [
        sweep.JOBS, "0", "1", "2"]  # the jobs' records, and the job dirs
    assert sorted(p.name for p in (sweep_dir / sweep.JOBS).iterdir()) == [
        "0.json", "1.json", "2.json"]
    rows = csv_rows(sweep_dir)
    assert [r["job"] for r in rows] == ["0", "1", "2"]
    for n, row, s in zip(ACCUM, rows, summaries(sweep_dir, 3), strict=True):
        assert s["status"] == row["status"] == "completed"
        assert row["schedule.window_size"] == str(n) and s["window_size"] == n
        assert f"schedule.window_size={n}" in row["overrides"].split()
        # 2 steps x 2 ranks x n micro-batches of schedule.micro_batch_size's default (16)
        assert s["optimizer_steps"] == 2 and s["samples_seen"] == 2 * 2 * n * 16
        assert int(row["global_batch"]) == 2 * 16 * n
        # exact: the CSV keeps full precision
        assert row["final_train_loss"] == repr(s["final_train_loss"])
        assert float(row["eval_loss"]) == s["eval"]["loss"]
        for key in ("samples_per_s", "peak_rss_mb", "train_s", "wall_s"):
            assert float(row[key]) == s[key], key
        for key in ("sync_backwards", "allreduce_calls", "allreduce_bytes"):
            assert int(row[key]) == s[key][0] == s[key][1], key
        assert s["sync_backwards"] == [2, 2]  # accumulate: one syncing backward per step
        assert row["error"] == ""

    md = (sweep_dir / "sweep_summary.md").read_text()
    assert "3 jobs: 3 completed, 0 failed." in md
    common = next(line for line in md.splitlines() if "Common overrides:" in line)
    assert {"experiment=accum_sweep", "data=synthetic", "trainer.max_steps=2"} <= \
        set(common.split("Common overrides: ")[1].rstrip(".").split())
    # what every job shares moves out of the table (accumulate: one all-reduce per step)
    mb = summaries(sweep_dir, 1)[0]["allreduce_bytes"][0] / 1e6
    assert ("Same in every completed job: ranks 2, micro 16, steps 2, grad MB held "
            f"{mb / 2:.2f}, sync backwards/rank 2, MB sent/rank {mb:.2f}.") in md
    assert "Each job evaluated once, at its end: no to-target columns" in md
    table = [line for line in md.splitlines() if line.startswith("| ")]
    # N repeats the swept schedule.window_size: left out (the CSV has it)
    assert table[0] == ("| job | schedule.window_size | status | global batch | final train loss "
                        "| eval loss | samples/s | peak MB | wall s |")
    for n, line, s in zip(ACCUM, table[1:], summaries(sweep_dir, 3), strict=True):
        cells = [c.strip() for c in line.strip("|").split("|")]
        assert cells[:4] == [str(ACCUM.index(n)), str(n), "completed", str(2 * 16 * n)]
        assert f"{s['final_train_loss']:.6g}" in cells
    assert md in proc.stdout  # printed at the end of the sweep too
    # each job starts with "job k of N", and once a job is done an ETA
    progress = [line for line in proc.stdout.splitlines() if line.startswith("gradsync: sweep:")]
    assert progress[0] == "gradsync: sweep: job 1 of 3"
    for k, line in enumerate(progress[1:], start=2):
        assert re.fullmatch(rf"gradsync: sweep: job {k} of 3 \({k - 1} done in \d+ s, "
                            r"ETA \d+ s\)", line), line
    assert len(progress) == 3


@pytest.mark.slow
def test_sweep_png_is_a_real_plot_of_every_job(accum_sweep, tmp_path):
    sweep_dir, _ = accum_sweep
    data = (sweep_dir / "sweep.png").read_bytes()
    assert data[:8] == PNG_SIGNATURE and data[12:16] == b"IHDR"
    assert struct.unpack(">II", data[16:24]) == (1600, 480)
    assert len(data) > 20_000

    jobs = sweep.read_jobs(sweep_dir)
    fig = sweep.plot(jobs, tmp_path / "again.png")
    by_samples, by_bytes, by_seconds = fig.axes
    for ax, key in ((by_samples, "samples"), (by_bytes, "sent_bytes"),
                    (by_seconds, "train_s")):
        assert len(ax.lines) == 6  # per job: its train loss curve, its eval point(s)
        for j in range(3):
            train, evals = ax.lines[2 * j], ax.lines[2 * j + 1]
            rows = [json.loads(x) for x in (sweep_dir / str(j) / "metrics.jsonl").read_text()
                    .splitlines()]
            assert list(train.get_xdata()) == [r[key] for r in rows]
            assert list(train.get_ydata()) == [r["loss"] for r in rows]
            final = json.loads((sweep_dir / str(j) / "evals.jsonl").read_text())
            assert list(evals.get_xdata()) == [final[key]] == [rows[-1][key]]
            assert list(evals.get_ydata()) == [summaries(sweep_dir, 3)[j]["eval"]["loss"]]
    assert by_bytes.get_xscale() == "log"
    assert [t.get_text() for t in by_samples.get_legend().get_texts()] == \
        [f"schedule.window_size={n}" for n in ACCUM]


@pytest.mark.slow
def test_summary_of_a_sweep_dir_can_be_written_by_hand(accum_sweep, tmp_path, cli_env):
    sweep_dir, _ = accum_sweep
    copy = tmp_path / "sweep"
    shutil.copytree(sweep_dir, copy)
    for name in ("sweep_summary.csv", "sweep_summary.md", "sweep.png"):
        (copy / name).unlink()
    proc = subprocess.run([sys.executable, "-m", "gradsync.run.sweep", str(copy)],
                          capture_output=True, text=True, env=cli_env, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert (copy / "sweep_summary.md").read_text() == \
        (sweep_dir / "sweep_summary.md").read_text().replace(str(sweep_dir), str(copy))
    assert [{**r, "dir": ""} for r in csv_rows(copy)] == \
        [{**r, "dir": ""} for r in csv_rows(sweep_dir)]
    assert (copy / "sweep.png").read_bytes()[:8] == PNG_SIGNATURE


def hparams_session_groups(logdir: Path) -> dict:
    """What TensorBoard's HParams tab lists for `tensorboard --logdir logdir`: its own backend
    (plugin data read from the event files), one session group per job."""
    from tensorboard.backend.event_processing.data_provider import MultiplexerDataProvider
    from tensorboard.backend.event_processing.plugin_event_multiplexer import EventMultiplexer
    from tensorboard.context import RequestContext
    from tensorboard.plugins.base_plugin import TBContext
    from tensorboard.plugins.hparams import api_pb2, backend_context, list_session_groups

    mux = EventMultiplexer()
    mux.AddRunsFromDirectory(str(logdir))
    mux.Reload()
    ctx = backend_context.Context(TBContext(logdir=str(logdir), multiplexer=mux,
                                            data_provider=MultiplexerDataProvider(mux, logdir)))
    request = api_pb2.ListSessionGroupsRequest(start_index=0, slice_size=100, allowed_statuses=[
        api_pb2.STATUS_UNKNOWN, api_pb2.STATUS_SUCCESS, api_pb2.STATUS_FAILURE,
        api_pb2.STATUS_RUNNING])
    response = list_session_groups.Handler(RequestContext(), ctx, "", request).run()
    return {g.name: g for g in response.session_groups}


@pytest.mark.slow
def test_tensorboard_hparams_tab_compares_the_jobs(accum_sweep):
    sweep_dir, _ = accum_sweep
    groups = hparams_session_groups(sweep_dir)
    assert sorted(groups) == ["0/tb", "1/tb", "2/tb"]
    for j, (n, s) in enumerate(zip(ACCUM, summaries(sweep_dir, 3), strict=True)):
        g = groups[f"{j}/tb"]
        assert g.hparams["schedule.window_size"].number_value == n
        assert g.hparams["data._target_"].string_value == "gradsync.data.synthetic"
        assert g.hparams["model.hidden_sizes"].string_value == "[128, 128]"
        metrics = {m.name.tag: m.value for m in g.metric_values}
        for key, value in final_metrics(s).items():
            tag = "final/" + key.removeprefix("final_")
            assert metrics[tag] == pytest.approx(value, rel=1e-6), tag  # stored as float32
        assert metrics["train/loss"] == pytest.approx(s["final_train_loss"], rel=1e-6)


# --- a failed job, and jobs run two at once (joblib launcher) ---------------------------------
@pytest.mark.slow
def test_failed_job_gets_a_failed_row_while_joblib_runs_the_others_in_parallel(tmp_path,
                                                                               cli_env):
    sweep_dir = tmp_path / "sweep"
    proc = multirun(sweep_dir, "hydra/launcher=joblib", "hydra.launcher.n_jobs=2",
                    "data=synthetic", "trainer.max_steps=3", "trainer.fail_at_step=-1,2,100",
                    env=cli_env)
    assert proc.returncode == 1, proc.stderr
    errors = [line for line in proc.stderr.splitlines() if line.startswith("gradsync:")]
    assert len(errors) == 3, proc.stderr
    assert errors[0] == (f"gradsync: run dir: {sweep_dir / '1'} (each rank's log and "
                         "traceback: logs/rank<r>.log)")
    assert errors[1] == ("gradsync: training failed: rank 1 failed: RuntimeError: injected "
                         "failure after optimizer step 2 (trainer.fail_at_step, a test aid)")
    assert errors[2] == ("gradsync: sweep: 1 of 3 jobs failed (job 1); see "
                         f"{sweep_dir}/sweep_summary.md")

    rows = csv_rows(sweep_dir)
    assert [(r["trainer.fail_at_step"], r["status"]) for r in rows] == \
        [("-1", "completed"), ("2", "failed"), ("100", "completed")]
    assert rows[1]["error"] == errors[1].removeprefix("gradsync: ")
    assert rows[1]["final_train_loss"] == ""
    s0, failed, s2 = summaries(sweep_dir, 3)
    assert failed == {"status": "failed", "error": rows[1]["error"]}
    for row, s in ((rows[0], s0), (rows[2], s2)):
        assert float(row["final_train_loss"]) == s["final_train_loss"]
        assert s["optimizer_steps"] == 3 and s["sync_backwards"] == [3, 3]
    md = (sweep_dir / "sweep_summary.md").read_text()
    assert "3 jobs: 2 completed, 1 failed." in md
    failed_line = next(line for line in md.splitlines() if line.startswith("| 1 | 2 | failed |"))
    assert failed_line.endswith(f"| {rows[1]['error']} |")
    assert (sweep_dir / "sweep.png").read_bytes()[:8] == PNG_SIGNATURE

    # Jobs 0 and 1 ran at the same time, each with its own store port, group and dir (job 1
    # failed only after its process group and DDP were up); job 2 waited for a free slot.
    def span(j: int) -> tuple[float, float]:
        d = sweep_dir / str(j)
        return (d / ".hydra" / "config.yaml").stat().st_mtime, (d / "summary.json").stat().st_mtime

    (start0, end0), (start1, end1), (start2, _) = span(0), span(1), span(2)
    assert start0 < end1 and start1 < end0, "the joblib jobs did not overlap"
    assert start2 >= min(end0, end1)  # n_jobs=2: never three at once
    assert "rank 0/2 up: backend=gloo" in (sweep_dir / "1" / "logs" / "rank0.log").read_text()
    for j in range(3):
        logs = sweep_dir / str(j) / "logs"
        assert sorted(p.name for p in logs.iterdir()) == ["rank0.log", "rank1.log"]
        hydra_cfg = yaml.safe_load((sweep_dir / str(j) / ".hydra" / "hydra.yaml").read_text())
        assert hydra_cfg["hydra"]["job"]["num"] == j


# --- fixed global batch: the same mathematics, three ways -------------------------------------
@pytest.mark.slow
def test_ctrl_c_ends_a_sweep_within_5_s_leaving_no_process_and_saying_how_far_it_got(
        tmp_path, cli_env):
    """Ctrl-C (SIGINT to the terminal's process group) while the second of two jobs trains:
    the job checkpoints and stops, and the sweep ends with it, within 5 s, every process gone,
    the sweep dir let go, a line saying how far it got."""
    sweep_dir = tmp_path / "sweep"
    job = Job(sweep_dir / "1", ["-m", f"hydra.sweep.dir={sweep_dir}", "trainer.progress_bar=false",
                                "data=synthetic", "trainer.max_epochs=1000",
                                "trainer.max_steps=3,1000000"], cli_env, name_run_dir=False)
    job.wait_for_step(3)
    sent = time.monotonic()
    os.killpg(job.proc.pid, signal.SIGINT)
    code, out, err = job.finish()
    took = time.monotonic() - sent
    assert code == 128 + signal.SIGINT and took < 5, (took, err)
    assert job.seen and job.survivors(wait=0.5) == []
    assert "gradsync: sweep: job 1 of 2\n" in out
    assert re.search(r"^gradsync: sweep: job 2 of 2 \(1 done in \d+ s, ETA \d+ s\)$", out, re.M)
    assert err.strip().splitlines()[-1] == (
        f"gradsync: sweep interrupted by SIGINT with 1 of 2 jobs completed; their summary: "
        f"python -m gradsync.run.sweep {sweep_dir}; to go on, run the sweep again with "
        f"hydra.sweep.dir={sweep_dir} resume=auto")
    assert not (sweep_dir / sweep.SWEEP_LOCK).exists()
    assert json.loads((sweep_dir / "1" / "summary.json").read_text())["status"] == "interrupted"


@pytest.mark.slow
def test_fixed_global_batch_sweep_trains_the_same_model(tmp_path, cli_env):
    # 464 samples: 232 per rank = 3 full windows of 64 samples, then a short one of 40 that
    # holds 16+16+8 (N=4), 32+8 (N=2) or 40 (N=1) samples: normalising per sample makes them
    # agree, dividing by N or by micro-batches would not.
    sweep_dir = tmp_path / "sweep"
    proc = multirun(sweep_dir, "experiment=fixed_global_batch", "data=synthetic",
                    "data.num_samples=464", "trainer.max_epochs=2", env=cli_env)
    assert proc.returncode == 0, proc.stderr
    runs = summaries(sweep_dir, 3)
    assert [s["window_size"] for s in runs] == [4, 2, 1]
    assert [s["micro_batch_size"] for s in runs] == [16, 32, 64]
    assert {(s["optimizer_steps"], s["samples_seen"]) for s in runs} == {(8, 928)}
    assert {tuple(s["sync_backwards"]) for s in runs} == {(8, 8)}
    first = runs[0]
    for s in runs[1:]:
        assert s["final_train_loss"] == pytest.approx(first["final_train_loss"], rel=1e-5, abs=0)
        assert s["eval"]["loss"] == pytest.approx(first["eval"]["loss"], rel=1e-5, abs=0)
    params = [torch.load(sweep_dir / str(j) / "checkpoints" / "last.pt", weights_only=True)
              ["model"] for j in range(3)]
    for other in params[1:]:
        for name, value in params[0].items():
            torch.testing.assert_close(other[name], value, rtol=1e-5, atol=1e-6)

    md = (sweep_dir / "sweep_summary.md").read_text()
    assert "Same in every completed job: ranks 2, global batch 128, steps 8, grad MB held " in md
    spread = next(line for line in md.splitlines() if line.startswith("Final train loss"))
    relative = float(spread.rsplit("relative ", 1)[1].rstrip(").").strip())
    assert relative < 1e-5


# --- a sweep owns its sweep dir; a job refused or lost is a failed row ------------------------
@pytest.mark.slow
def test_a_second_sweep_into_a_sweep_dir_in_use_is_refused_at_once(tmp_path, cli_env):
    """While a sweep holds its sweep dir (sweep.claim, what a running sweep did before its first
    job), another sweep there is refused in one line, exit code 2, and runs nothing."""
    sweep_dir = tmp_path / "sweep"
    sweep.claim(sweep_dir)
    try:
        before = sorted(p.name for p in sweep_dir.iterdir())
        proc = multirun(sweep_dir, "data=synthetic", "seed=0,1", env=cli_env)
        assert proc.returncode == 2, proc.stderr
        assert proc.stderr.splitlines() == [
            f"gradsync: sweep dir in use: {sweep_dir} is in use by another sweep (pid "
            f"{os.getpid()} on {socket.gethostname()}): wait for it to end, or choose another "
            "hydra.sweep.dir"]
        assert sorted(p.name for p in sweep_dir.iterdir()) == before == [sweep.SWEEP_LOCK]
    finally:
        sweep.release(sweep_dir)
    assert list(sweep_dir.iterdir()) == []


@pytest.mark.slow
def test_a_sweep_whose_job_was_refused_exits_1_naming_it_and_counts_every_job(tmp_path,
                                                                              cli_env):
    """Job 1's dir is held by another job (a run started there by hand): job 1 is refused
    ("run dir in use") and cannot write into that dir; the sweep still counts it, as a failed
    row with the refusal, and exits 1 naming it; the other job's dir is left as it was."""
    sweep_dir = tmp_path / "sweep"
    other = sweep_dir / "1"
    other.mkdir(parents=True)
    (other / "summary.json").write_text('{"status": "completed"}')  # the other job's
    with rundir.Claim(other, None, lock=True):
        proc = multirun(sweep_dir, "data=synthetic", "trainer.max_steps=1", "seed=0,1",
                        env=cli_env)
    assert proc.returncode == 1, proc.stderr
    refusal = (f"run dir in use: {other} is in use by another job (pid {os.getpid()} on "
               f"{socket.gethostname()}): wait for it to end, or choose another hydra.run.dir")
    assert [line for line in proc.stderr.splitlines() if line.startswith("gradsync:")] == [
        f"gradsync: {refusal}",
        f"gradsync: sweep: 1 of 2 jobs failed (job 1); see {sweep_dir}/sweep_summary.md"]
    rows = csv_rows(sweep_dir)
    assert [(r["job"], r["seed"], r["status"], r["error"]) for r in rows] == [
        ("0", "0", "completed", ""), ("1", "1", "failed", refusal)]
    assert "2 jobs: 1 completed, 1 failed." in (sweep_dir / "sweep_summary.md").read_text()
    # untouched (Hydra's log file handler opens an empty train.log before gradsync runs)
    assert (other / "summary.json").read_text() == '{"status": "completed"}'
    assert sorted(p.name for p in other.iterdir() if p.name != "train.log") == ["summary.json"]
    assert not (sweep_dir / sweep.SWEEP_LOCK).exists()  # released when the sweep ended


def test_a_job_lost_without_an_outcome_is_a_failed_row_and_the_sweep_names_it(tmp_path):
    """Written by hand (python -m gradsync.run.sweep) from the records a sweep left: job 0
    started and never reported (its process was killed), job 1 was refused; both are rows."""
    sweep_dir = tmp_path / "sweep"
    sweep_dir.mkdir()
    sweep.job_started(sweep_dir, 0, sweep_dir / "0", ["seed=0"])
    sweep.job_started(sweep_dir, 1, sweep_dir / "1", ["seed=1"])
    sweep.job_ended(sweep_dir, 1, sweep_dir / "1", ["seed=1"],
                    {"status": "failed", "error": "run dir in use: busy"})
    result = sweep.write_summary(sweep_dir)
    assert (result.jobs, result.failed, result.failed_jobs) == (2, 2, [0, 1])
    assert result.failure_line(sweep_dir) == (
        f"gradsync: sweep: 2 of 2 jobs failed (jobs 0, 1); see {sweep_dir}/sweep_summary.md")
    rows = csv_rows(sweep_dir)
    assert [(r["seed"], r["status"], r["error"]) for r in rows] == [
        ("0", "failed", sweep.LOST), ("1", "failed", "run dir in use: busy")]
    assert "2 jobs: 0 completed, 2 failed." in result.markdown


@pytest.mark.slow
def test_a_sweep_logs_a_parent_run_with_a_child_per_job(accum_sweep, monkeypatch):
    """MLflow: a parent run for the sweep (its summary as artifacts, the job counts), each job's
    run its child (mlflow.parentRunId) with one train/loss point per metrics.jsonl row, read
    back with MlflowClient at the URI summary.json names; W&B: the jobs' runs and a run of the
    sweep in one group."""
    from mlflow.tracking import MlflowClient

    from test_trackers import jsonl, wandb_run

    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # the file store, as gradsync does
    sweep_dir, _ = accum_sweep
    parents = json.loads((sweep_dir / "trackers.json").read_text())
    parent = parents["mlflow"]
    client = MlflowClient(tracking_uri=parent["uri"])
    run = client.get_run(parent["run_id"])
    assert run.info.status == "FINISHED" and run.data.tags["gradsync.sweep_dir"] == str(sweep_dir)
    assert {k: run.data.metrics[f"jobs_{k}"] for k in ("total", "completed", "failed")} == {
        "total": 3, "completed": 3, "failed": 0}
    assert sorted(a.path for a in client.list_artifacts(parent["run_id"])) == [
        "sweep_summary.csv", "sweep_summary.md"]
    children = client.search_runs([parent["experiment_id"]],
                                  f"tags.mlflow.parentRunId = '{parent['run_id']}'")
    made = [summaries(sweep_dir, 3)[j]["trackers"] for j in range(3)]
    assert sorted(c.info.run_id for c in children) == sorted(m["mlflow"]["run_id"] for m in made)
    for j, m in enumerate(made):
        assert m["mlflow"]["uri"] == parent["uri"]
        rows = jsonl(sweep_dir / str(j) / "metrics.jsonl")
        history = MlflowClient(tracking_uri=m["mlflow"]["uri"]).get_metric_history(
            m["mlflow"]["run_id"], "train/loss")
        assert [(h.step, h.value) for h in history] == [(r["window"], r["loss"]) for r in rows]
        assert client.get_run(m["mlflow"]["run_id"]).data.params["schedule.window_size"] == \
            str(ACCUM[j])
    # W&B: one group; the jobs' runs (train) and the sweep's (sweep), each its own offline run
    wb = parents["wandb"]
    group = wb["group"]
    sweep_run = wandb_run(Path(wb["uri"]))
    assert (sweep_run["id"], sweep_run["group"], sweep_run["job_type"]) == (
        wb["run_id"], group, "sweep")
    assert sweep_run["summary"]["jobs_completed"] == 3
    for j, m in enumerate(made):
        job = wandb_run(Path(m["wandb"]["uri"]))
        assert (job["id"], job["group"], job["job_type"]) == (m["wandb"]["run_id"], group,
                                                              "train")
        assert job["config"]["gradsync.sweep_parent"] == wb["run_id"]
        rows = jsonl(sweep_dir / str(j) / "metrics.jsonl")
        assert [(h["_step"], h["train/loss"]) for h in job["history"]] == [
            (r["window"], r["loss"]) for r in rows]


@pytest.mark.slow
def test_a_sweep_summary_without_matplotlib_says_so_in_one_line(accum_sweep, monkeypatch,
                                                                 tmp_path, capsys):
    """gradsync[plots] missing: the summary is written, the plots are not, one line says why."""
    import shutil

    sweep_dir, _ = accum_sweep
    copy = tmp_path / "sweep"
    shutil.copytree(sweep_dir, copy, ignore=shutil.ignore_patterns("*.png", "checkpoints"))
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    result = sweep.write_summary(copy)
    assert result.jobs == 3 and (copy / "sweep_summary.md").exists()
    assert not list(copy.glob("*.png"))
    assert capsys.readouterr().err.splitlines() == [
        "gradsync: sweep: no plots: a sweep's plots (sweep.png) needs matplotlib: pip install "
        "'gradsync[plots]'"]
