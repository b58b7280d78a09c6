"""Search sweeps: hydra/sweeper=optuna (run/search.py) on real jobs (each spawning 2 gloo
workers). The study in the sweep dir's study.db, read back with Optuna's own API, against the
jobs' summary.json; failed runs as FAIL trials and failed rows; a sweep SIGKILLed and started
again; two objectives; bad input refused before any trial."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from cli_jobs import Job
from gradsync.config.validate import ConfigError
from gradsync.run import sweep
from gradsync.run.main import CONF_DIR
from test_sweep import csv_rows

optuna = sweep.import_optuna()
TINY = ("data=synthetic", "trainer.max_steps=2", "trainer.progress_bar=false",
        "hydra/sweeper=optuna")


def search(sweep_dir: Path, *args: str, env: dict) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "gradsync.run.main", "-m", f"hydra.sweep.dir={sweep_dir}", *TINY,
         *args], capture_output=True, text=True, env=env, timeout=300)


def trials(sweep_dir: Path) -> list[optuna.trial.FrozenTrial]:
    study = optuna.load_study(study_name="gradsync", storage=f"sqlite:///{sweep_dir}/study.db")
    return study.get_trials()


def job_overrides(job_dir: Path) -> dict[str, str]:
    task = yaml.safe_load((job_dir / ".hydra" / "overrides.yaml").read_text())
    return dict(o.split("=", 1) for o in task)


def summary_json(job_dir: Path) -> dict:
    return json.loads((job_dir / "summary.json").read_text())


def snapshot(job_dir: Path) -> dict[str, tuple[int, bytes]]:
    return {str(p.relative_to(job_dir)): (p.stat().st_mtime_ns, p.read_bytes())
            for p in sorted(job_dir.rglob("*")) if p.is_file()}


def test_optuna_is_gradsyncs_search_with_its_study_in_the_sweep_dir():
    with initialize_config_dir(config_dir=CONF_DIR, version_base="1.3"):
        cfg = compose("config", overrides=["hydra/sweeper=optuna", "hydra.sweep.dir=/s"],
                      return_hydra_config=True)
    s = cfg.hydra.sweeper
    assert s._target_ == "hydra_plugins.gradsync_search.OptunaSearch"
    assert (s.objective, s.direction, s.storage, s.study_name) == (
        "eval_loss", "minimize", "sqlite:////s/study.db", "gradsync")
    assert s.sampler._target_ == "optuna.samplers.TPESampler"


# --- 3 trials: one completes, one is refused (fail_at_step=0), one fails mid-run ---------------
# TPESampler(seed=15)'s first 3 (random) draws of choice(-1,1,0): -1, 1, 0
@pytest.fixture(scope="module")
def three_trials(tmp_path_factory, cli_env_module):
    sweep_dir = tmp_path_factory.mktemp("search") / "sweep"
    proc = search(sweep_dir, "hydra.sweeper.n_trials=3", "hydra.sweeper.sampler.seed=15",
                  "trainer.fail_at_step=choice(-1,1,0)", "optimizer.lr=interval(0.01,0.1)",
                  env=cli_env_module)
    return sweep_dir, proc


@pytest.mark.slow
def test_study_db_holds_each_trial_with_the_params_and_objective_of_its_jobs_summary(
        three_trials):
    sweep_dir, proc = three_trials
    assert proc.returncode == 1, proc.stderr  # two failed trials
    got = trials(sweep_dir)
    assert [t.number for t in got] == [0, 1, 2]
    by_fail = {}
    for t in got:
        job_dir = sweep_dir / str(t.number)
        overrides = job_overrides(job_dir)
        assert t.params == {"trainer.fail_at_step": int(overrides["trainer.fail_at_step"]),
                            "optimizer.lr": float(overrides["optimizer.lr"])}
        by_fail[t.params["trainer.fail_at_step"]] = (t, summary_json(job_dir))
    done, s = by_fail[-1]
    assert done.state == optuna.trial.TrialState.COMPLETE
    assert done.values == [s["eval"]["loss"]] and s["status"] == "completed"
    for fail_at, kind in ((0, "config error: trainer.fail_at_step"), (1, "training failed: ")):
        t, s = by_fail[fail_at]
        assert t.state == optuna.trial.TrialState.FAIL and t.values is None
        assert s["status"] == "failed" and s["error"].startswith(kind), s
        assert t.user_attrs["gradsync_error"] == f"the run did not complete: {s['error']}"
    rows = csv_rows(sweep_dir)
    assert [(r["trial"], r["trial_state"], r["status"], r["error"]) for r in rows] == [
        (str(t.number), t.state.name, by_fail[t.params["trainer.fail_at_step"]][1]["status"],
         by_fail[t.params["trainer.fail_at_step"]][1].get("error", "")) for t in got]
    assert float(rows[done.number]["eval_loss"]) == done.values[0]
    md = (sweep_dir / "sweep_summary.md").read_text()
    params = " ".join(f"{k}={v}" for k, v in done.params.items())
    assert (f"Best trial {done.number} (job {done.number}, {sweep_dir / str(done.number)}): "
            f"{params}: eval_loss {done.values[0]:.6g}.") in md
    assert "3 jobs: 1 completed, 2 failed." in md
    assert proc.stderr.splitlines()[-1].startswith("gradsync: sweep: 2 of 3 jobs failed (jobs ")


# --- killed after its second trial, started again ---------------------------------------------
@pytest.mark.slow
def test_a_sweep_killed_and_started_again_runs_each_planned_trial_once(tmp_path, cli_env):
    sweep_dir = tmp_path / "sweep"
    args = ["-m", f"hydra.sweep.dir={sweep_dir}", *TINY, "hydra.sweeper.n_trials=4",
            "hydra.sweeper.sampler.seed=0", "optimizer.lr=interval(0.01,0.1)"]
    job = Job(sweep_dir, args, cli_env, name_run_dir=False)
    job.kill_9_when(sweep_dir / sweep.JOBS / "2.json")  # trial 2 started: kill the session
    first = {t.number: t for t in trials(sweep_dir)}
    assert [(n, t.state.name) for n, t in first.items()] == [
        (0, "COMPLETE"), (1, "COMPLETE"), (2, "RUNNING")]
    before = {n: snapshot(sweep_dir / str(n)) for n in (0, 1)}

    proc = subprocess.run([sys.executable, "-m", "gradsync.run.main", *args],
                          capture_output=True, text=True, env=cli_env, timeout=300)
    assert proc.returncode == 1, proc.stderr  # the trial the kill cut short: failed
    final = trials(sweep_dir)
    assert [(t.number, t.state.name) for t in final] == [
        (0, "COMPLETE"), (1, "COMPLETE"), (2, "FAIL"), (3, "COMPLETE")]
    for n in (0, 1):  # not run again: their study entries and their dirs as they were
        assert (final[n].params, final[n].values) == (first[n].params, first[n].values)
        assert snapshot(sweep_dir / str(n)) == before[n]
    assert final[2].params == first[2].params
    assert final[3].values == [summary_json(sweep_dir / "3")["eval"]["loss"]]
    assert final[3].params == {"optimizer.lr": float(job_overrides(sweep_dir / "3")[
        "optimizer.lr"])}
    rows = csv_rows(sweep_dir)
    assert [(r["job"], r["trial_state"], r["status"]) for r in rows] == [
        ("0", "COMPLETE", "completed"), ("1", "COMPLETE", "completed"), ("2", "FAIL", "failed"),
        ("3", "COMPLETE", "completed")]
    assert rows[2]["error"] == sweep.LOST
    assert proc.stderr.splitlines()[-1] == (
        f"gradsync: sweep: 1 of 4 jobs failed (job 2); see {sweep_dir}/sweep_summary.md")


# --- two objectives -------------------------------------------------------------------------
@pytest.mark.slow
def test_two_objectives_record_eval_loss_and_bytes_sent(tmp_path, cli_env):
    sweep_dir = tmp_path / "sweep"
    proc = search(sweep_dir, "hydra.sweeper.n_trials=2", "hydra.sweeper.sampler.seed=1",
                  "hydra.sweeper.objective=[eval_loss,allreduce_bytes]",
                  "hydra.sweeper.direction=[minimize,minimize]",
                  "schedule.accum_steps=choice(1,4)", env=cli_env)
    assert proc.returncode == 0, proc.stderr
    got = trials(sweep_dir)
    assert len(got) == 2
    for t in got:
        s = summary_json(sweep_dir / str(t.number))
        assert t.state == optuna.trial.TrialState.COMPLETE
        assert t.values == [s["eval"]["loss"], s["allreduce_bytes"][0]]
        assert t.params == {"schedule.accum_steps": s["accum_steps"]}
    md = (sweep_dir / "sweep_summary.md").read_text()
    assert "eval_loss (minimize), allreduce_bytes (minimize); 2 trials: 2 COMPLETE." in md
    assert "On the Pareto front: trial " in md


# --- bad input: one line, exit 2, before any trial ------------------------------------------
def test_objectives_and_directions_are_checked_against_what_the_runs_produce():
    from gradsync.run.search import check_objectives

    cfg = OmegaConf.create({"noise_scale": {"enabled": False}, "engine": {"name": "torch_ddp"},
                            "sync": {"_target_": "gradsync.sync.policies.AccumulateSync"}})
    assert check_objectives(["eval_loss", "allreduce_bytes"], "minimize", cfg) == (
        ["eval_loss", "allreduce_bytes"], ["minimize", "minimize"])
    assert check_objectives("eval_accuracy", ["maximize"], cfg) == (["eval_accuracy"],
                                                                    ["maximize"])
    for objective, direction, error in [
            ("eval_los", "minimize", "hydra.sweeper.objective=eval_los: not a value a run "
             "produces; one of eval_loss, final_train_loss, "),
            ("eval_loss", "down", "hydra.sweeper.direction=down: minimize or maximize"),
            ("noise_scale", "minimize", "hydra.sweeper.objective=noise_scale: the sweep's runs "
             "do not produce it (only noise_scale.enabled=true does)"),
            ("max_replica_drift", "minimize", "hydra.sweeper.objective=max_replica_drift: the "
             "sweep's runs do not produce it (only sync=local_sgd or sync=diloco does)"),
            (["eval_loss", "wall_s"], ["minimize"] * 3, "hydra.sweeper.direction: 3 directions "
             "for 2 objectives (eval_loss, wall_s): one, or one each")]:
        with pytest.raises(ConfigError) as e:
            check_objectives(objective, direction, cfg)
        assert str(e.value).startswith(error), e.value
    cfg.noise_scale.enabled = True
    assert check_objectives("noise_scale", "maximize", cfg) == (["noise_scale"], ["maximize"])


@pytest.mark.slow
def test_bad_objective_is_one_line_and_exit_2_before_any_trial(tmp_path, cli_env):
    sweep_dir = tmp_path / "sweep"
    proc = search(sweep_dir, "hydra.sweeper.objective=noise_scale",
                  "optimizer.lr=interval(0.01,0.1)", env=cli_env)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.splitlines() == [
        "gradsync: config error: hydra.sweeper.objective=noise_scale: the sweep's runs do not "
        "produce it (only noise_scale.enabled=true does)"]
    assert not (sweep_dir / "study.db").exists() and not (sweep_dir / "0").exists()
