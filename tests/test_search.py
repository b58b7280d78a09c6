"""Search sweeps: hydra/sweeper=optuna (run/search.py: Optuna's ask/tell behind Hydra's Sweeper)
on real jobs (each spawning 2 gloo workers). The study in the sweep dir's study.db, read back
with Optuna's own API, against the jobs' summary.json; failed runs as FAIL trials and failed
rows; a sweep SIGKILLed and started again; two objectives; range() as a grid means it; bad
input, bad study files, an optuna 2 study, a study another search shares: refused in one line
or left alone, the file as it was."""

from __future__ import annotations

import hashlib
import json
import re
import sqlite3
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from cli_jobs import Job
from gradsync.config.validate import ConfigError
from gradsync.run import search as run_search
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
    """The study's trials, read with Optuna's own API (the name: the sweep's own, in
    optuna.json; the only study in its study.db)."""
    name = sweep.read_study(sweep_dir)["study_name"]
    assert name == run_search.default_study_name(sweep_dir)
    assert optuna.study.get_all_study_names(f"sqlite:///{sweep_dir}/study.db") == [name]
    study = optuna.load_study(study_name=name, storage=f"sqlite:///{sweep_dir}/study.db")
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
    assert (s.objective, s.direction, s.storage, s.study_name, s.n_trials, s.n_jobs) == (
        "eval_loss", "minimize", "sqlite:////s/study.db", None, 20, 1)
    assert s.sampler._target_ == "optuna.samplers.TPESampler"
    # no hydra-optuna-sweeper: Optuna's public API, Hydra's public Sweeper
    src = (Path(run_search.__file__).read_text()
           + Path(sys.modules["hydra_plugins.gradsync_search"].__file__).read_text())
    assert "hydra_optuna_sweeper" not in src and "_impl" not in src
    assert not re.search(r"(from|import) (hydra\._internal|optuna\._)", src)


# --- 3 trials: one completes, one is refused (fail_at_step=0), one fails mid-run ---------------
# TPESampler(seed=15)'s first 3 (random) draws of choice(-1,1,0): -1, 1, 0 (optuna 5.1)
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


# --- the check: 3 COMPLETE trials, each its job's eval loss; MLflow parent + children --
@pytest.mark.slow
def test_three_trials_complete_with_their_jobs_eval_losses_and_an_mlflow_parent(tmp_path,
                                                                               cli_env):
    from mlflow.tracking import MlflowClient

    from test_trackers import jsonl

    sweep_dir, db = tmp_path / "sweep", tmp_path / "mlflow.db"
    proc = search(sweep_dir, "hydra.sweeper.n_trials=3", "hydra.sweeper.sampler.seed=3",
                  "optimizer.lr=interval(0.01,0.1)", "logger=[tensorboard,mlflow]",
                  f"logger.mlflow.tracking_uri=sqlite:///{db}", env=cli_env)
    assert proc.returncode == 0, proc.stderr
    got = trials(sweep_dir)
    assert [(t.number, t.state.name) for t in got] == [
        (0, "COMPLETE"), (1, "COMPLETE"), (2, "COMPLETE")]
    assert int(optuna.__version__.split(".")[0]) >= 4
    parent = json.loads((sweep_dir / "trackers.json").read_text())["mlflow"]
    client = MlflowClient(tracking_uri=parent["uri"])
    assert client.get_run(parent["run_id"]).info.status == "FINISHED"
    for t in got:
        s = summary_json(sweep_dir / str(t.number))
        assert t.values == [s["eval"]["loss"]]
        child = s["trackers"]["mlflow"]
        run = client.get_run(child["run_id"])
        assert run.data.tags["mlflow.parentRunId"] == parent["run_id"]
        assert float(run.data.params["optimizer.lr"]) == t.params["optimizer.lr"]
        assert run.data.metrics["final/eval_loss"] == t.values[0]
        history = client.get_metric_history(child["run_id"], "train/loss")
        assert [(h.step, h.value) for h in history] == [
            (r["window"], r["loss"]) for r in jsonl(sweep_dir / str(t.number) / "metrics.jsonl")]


# --- two objectives -------------------------------------------------------------------------
@pytest.mark.slow
def test_two_objectives_record_eval_loss_and_bytes_sent(tmp_path, cli_env):
    sweep_dir = tmp_path / "sweep"
    proc = search(sweep_dir, "hydra.sweeper.n_trials=2", "hydra.sweeper.sampler.seed=1",
                  "hydra.sweeper.objective=[eval_loss,allreduce_bytes]",
                  "hydra.sweeper.direction=[minimize,minimize]",
                  "schedule.window_size=range(1,5,3)", env=cli_env)  # as a grid: 1, 4
    assert proc.returncode == 0, proc.stderr
    got = trials(sweep_dir)
    assert len(got) == 2
    for t in got:
        s = summary_json(sweep_dir / str(t.number))
        assert t.state == optuna.trial.TrialState.COMPLETE
        assert t.values == [s["eval"]["loss"], s["allreduce_bytes"][0]]
        assert t.params == {"schedule.window_size": s["window_size"]}
        assert s["window_size"] in (1, 4)
        assert t.distributions["schedule.window_size"] == optuna.distributions.IntDistribution(
            1, 4, step=3)
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


# --- range(...) means what it means in a grid (issue 46.6) ----------------------------------
def admitted(dist) -> list:
    """Every value a distribution of the search can give a trial."""
    if isinstance(dist, optuna.distributions.CategoricalDistribution):
        return list(dist.choices)
    return list(range(dist.low, dist.high + 1, dist.step))


@pytest.mark.parametrize("sweep_text", [
    "range(2,6)", "range(6,2,-1)", "range(1,10,3)", "range(5)", "range(-3,4,2)",
    "range(0.1,0.5,0.1)", "range(0,1,0.25)", "shuffle(range(1,4))", "tag(log,range(1,9))",
    "choice(1,4,16)", "choice(n1,n2,adaptive)"])
def test_a_range_or_choice_gives_the_values_a_grid_runs_and_no_other(sweep_text):
    from hydra.core.override_parser.overrides_parser import OverridesParser

    override = OverridesParser.create().parse_override(f"trainer.max_epochs={sweep_text}")
    grid = sorted(override.sweep_iterator(), key=str)  # what Hydra's basic sweeper runs
    space, fixed = run_search.search_space([f"trainer.max_epochs={sweep_text}"])
    assert fixed == {} and sorted(admitted(space["trainer.max_epochs"]), key=str) == grid


def test_a_range_of_integers_is_ordered_for_the_sampler_and_an_interval_is_continuous():
    space, fixed = run_search.search_space([
        "trainer.max_epochs=range(2,6)", "optimizer.lr=tag(log,interval(1e-3,1e-1))",
        "schedule.window_size=tag(int,interval(1,16))", "data=synthetic",
        "+experiment/window=choice(n1,n2)", "trainer.max_steps=choice(1,2)",
        "trainer.max_steps=3"])  # a later override of a key replaces the earlier
    d = optuna.distributions
    assert space == {"trainer.max_epochs": d.IntDistribution(2, 5),
                     "optimizer.lr": d.FloatDistribution(1e-3, 1e-1, log=True),
                     "schedule.window_size": d.IntDistribution(1, 16),
                     "+experiment/window": d.CategoricalDistribution(["n1", "n2"])}
    assert fixed == {"data": "data=synthetic", "trainer.max_steps": "trainer.max_steps=3"}
    for text, error in [
            ("range(2,2)", "an empty range (as in a grid, the end is left out: range(2,6) is "
                           "2, 3, 4, 5)"),
            ("interval(0.1,0.01)", "interval(low, high) needs finite numbers, low < high"),
            ("tag(log,interval(0,1))", "tag(log, interval(low, high)) needs low > 0"),
            ("tag(log,range(0.5,2,0.5))", "tag(log, ...) of a range of floats"),
            ("tag(log,range(1,9,2))", "tag(log, range(...)) needs step 1 and values >= 1"),
            ("tag(int,interval(0.5,3))", "tag(int, interval(low, high)) needs integer ends")]:
        with pytest.raises(ConfigError) as e:
            run_search.search_space([f"optimizer.lr={text}"])
        assert str(e.value).startswith(f"optimizer.lr={text}: {error}"), e.value


# --- bad settings: one line each, before anything is written --------------------------------
def test_nonsense_search_settings_are_refused_naming_the_key():
    good = dict(n_trials=3, n_jobs=1, storage="sqlite:////s/study.db", study_name=None)
    run_search.check_settings(**good)
    for key, value, error in [
            ("n_trials", 0, "hydra.sweeper.n_trials=0 is not allowed: an integer >= 1"),
            ("n_trials", -5, "hydra.sweeper.n_trials=-5 is not allowed: an integer >= 1"),
            ("n_jobs", 0, "hydra.sweeper.n_jobs=0 is not allowed: an integer >= 1"),
            ("storage", "", "hydra.sweeper.storage='' is not allowed: a database URL"),
            ("storage", "study.db", "hydra.sweeper.storage='study.db' is not allowed: a "
                                    "database URL"),
            ("storage", "sqlite://", "hydra.sweeper.storage='sqlite://' is not allowed: a "
                                     "database in memory ends with the sweep's process"),
            ("study_name", "", "hydra.sweeper.study_name='' is not allowed: null (the sweep's "
                               "own) or a name of 1 to 512 characters")]:
        with pytest.raises(ConfigError) as e:
            run_search.check_settings(**(good | {key: value}))
        assert str(e.value).startswith(error), e.value


@pytest.mark.slow
def test_bad_settings_end_in_one_line_and_exit_2_with_nothing_written(tmp_path, cli_env):
    for args, line in [
            (["hydra.sweeper.n_trials=0"],
             "gradsync: config error: hydra.sweeper.n_trials=0 is not allowed: an integer >= 1 "
             "(trials in the study)"),
            (["+experiment/window=choice(n1,n9)"],
             "gradsync: config error: experiment/window=n9: no such option; choose one of: ")]:
        sweep_dir = tmp_path / "sweep"
        proc = search(sweep_dir, "optimizer.lr=interval(0.01,0.1)", *args, env=cli_env)
        assert proc.returncode == 2, proc.stderr
        lines = proc.stderr.splitlines()
        assert len(lines) == 1 and lines[0].startswith(line), proc.stderr
        assert not (sweep_dir / "study.db").exists() and not (sweep_dir / "0").exists()


# --- the study file: refused in one line naming it and the cause, untouched ------------------
def sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def a_study_file(path: Path) -> Path:
    study = optuna.create_study(study_name="s", storage=f"sqlite:///{path}")
    study.enqueue_trial({"x": 0.5})
    trial = study.ask({"x": optuna.distributions.FloatDistribution(0, 1)})
    study.tell(trial, 1.0)
    return path


def test_a_corrupt_or_truncated_study_file_is_refused_naming_it_and_left_as_it_was(tmp_path):
    good = a_study_file(tmp_path / "good.db").read_bytes()
    run_search.check_study_file(tmp_path / "good.db")
    faults = {"corrupt": (bytes(range(256)) * (len(good) // 256), "not an SQLite database "
                                                                  "(file is not a database)"),
              "truncated": (good[:len(good) // 3], "damaged or truncated (database disk image "
                                                   "is malformed)"),
              "header only": (good[:100], "damaged or truncated"),
              "another program's": (None, "another program's database (tables t...), not an "
                                          "Optuna study")}
    for name, (data, cause) in faults.items():
        path = tmp_path / f"{name}.db"
        if data is None:
            with sqlite3.connect(path) as con:
                con.execute("CREATE TABLE t (x)")
            con.close()
            data = path.read_bytes()
        else:
            path.write_bytes(data)
        with pytest.raises(run_search.SearchRefused) as e:
            run_search.open_storage(f"sqlite:///{path}")
        assert str(e.value).startswith(f"{path}: {cause}"), e.value
        assert path.read_bytes() == data, name  # left as it was
    with pytest.raises(run_search.SearchRefused) as e:
        run_search.open_storage(f"sqlite:///{tmp_path}/nowhere/study.db")
    assert str(e.value) == (f"{tmp_path}/nowhere/study.db: its directory does not exist "
                            "(hydra.sweeper.storage)")


@pytest.mark.slow
def test_a_read_only_study_file_is_refused_in_one_line_before_any_trial(tmp_path, cli_env):
    """A read-only mount (root writes any file mode 0444): a private mount namespace, gone
    with the command."""
    sweep_dir = tmp_path / "sweep"
    sweep_dir.mkdir()
    (tmp_path / "ro").mkdir()
    db = a_study_file(tmp_path / "ro" / "study.db")
    before = sha(db)
    main = (f"{sys.executable} -m gradsync.run.main -m hydra.sweep.dir={sweep_dir} "
            + " ".join(TINY) + f" hydra.sweeper.storage=sqlite:///{db} "
            "'optimizer.lr=interval(0.01,0.1)'")
    proc = subprocess.run(
        ["unshare", "-m", "sh", "-c", f"mount --bind {db.parent} {db.parent} && mount -o "
         f"remount,ro,bind {db.parent} && {main}"], capture_output=True, text=True,
        env=cli_env, timeout=300)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.splitlines() == [
        f"gradsync: search refused: {db}: read-only: a search writes each trial into it "
        "(attempt to write a readonly database)"]
    assert sha(db) == before and not (sweep_dir / "0").exists()


def test_a_study_asking_other_directions_objectives_or_parameter_kinds_is_refused(tmp_path):
    storage = f"sqlite:///{tmp_path}/s.db"
    study = optuna.create_study(study_name="s", storage=storage, directions=["minimize"])
    with pytest.warns(optuna.exceptions.ExperimentalWarning):  # since 3.2
        study.set_metric_names(["eval_loss"])
    trial = study.ask({"lr": optuna.distributions.FloatDistribution(0.01, 0.1)})
    study.tell(trial, 0.5)
    d = optuna.distributions
    run_search.check_study(study, "f", ["eval_loss"], ["minimize"],
                           {"lr": d.FloatDistribution(0.001, 0.1), "n": d.IntDistribution(1, 4)})
    for args, error in [
            ((["eval_loss"], ["maximize"], {}), "f: study s was made to minimize; this search "
                                                "asks to maximize: keep them"),
            ((["wall_s"], ["minimize"], {}), "f: study s optimises eval_loss; this search "
                                             "wall_s: keep them"),
            ((["eval_loss"], ["minimize"], {"lr": d.CategoricalDistribution([0.01, 0.1])}),
             "f: study s's trial 0 drew lr from FloatDistribution(high=0.1, log=False, "
             "low=0.01, step=None), this search from CategoricalDistribution(choices=(0.01, "
             "0.1)): keep its kind")]:
        with pytest.raises(run_search.SearchRefused) as e:
            run_search.check_study(study, "f", *args)
        assert str(e.value).startswith(error), e.value


# --- two searches on one study ----------------------------------------------------------------
def test_each_sweep_has_a_study_of_its_own_and_fails_only_its_own_lost_trials(tmp_path):
    a, b = tmp_path / "a" / "sweep", tmp_path / "b" / "sweep"
    assert run_search.default_study_name(a) != run_search.default_study_name(b)
    assert run_search.default_study_name(a) == run_search.default_study_name(a)
    assert run_search.default_study_name(a).startswith("sweep-")
    # one study shared on purpose (the same storage and study_name): a start of sweep a
    # fails a's trials that were running when it died, never b's running trial
    study = optuna.create_study(study_name="shared", storage=f"sqlite:///{tmp_path}/s.db")
    space = {"x": optuna.distributions.FloatDistribution(0, 1)}
    owners = [str(a), str(b), None, str(a)]
    for owner in owners:
        trial = study.ask(space)
        if owner:
            trial.set_user_attr(run_search.OWNER, owner)
    study.tell(3, 0.25)
    assert run_search.fail_lost_trials(study, a) == [0, 2]  # 2: asked by an earlier gradsync
    assert [t.state.name for t in study.get_trials()] == [
        "FAIL", "RUNNING", "FAIL", "COMPLETE"]
    assert run_search.fail_lost_trials(study, a) == []


# --- a study the old search wrote (optuna 2.10.1, SQLAlchemy 1.4) ---------------------------
@pytest.mark.slow
def test_an_optuna_2_study_is_refused_in_one_line_then_continued_once_upgraded(tmp_path,
                                                                             cli_env):
    """tests/data/optuna2_study.sql: the study.db of a 2-trial search by gradsync before this
    one (hydra-optuna-sweeper 1.3.0, optuna 2.10.1), as SQL text."""
    sweep_dir = tmp_path / "sweep"
    sweep_dir.mkdir()
    db = sweep_dir / "study.db"
    with sqlite3.connect(db) as con:
        con.executescript((Path(__file__).parent / "data" / "optuna2_study.sql").read_text())
    con.close()
    storage = f"sqlite:///{db}"
    sweep.write_study(sweep_dir, {"storage": storage, "study_name": "gradsync",
                                  "objectives": ["eval_loss"], "directions": ["minimize"],
                                  "jobs": {"0": 0, "1": 1}})
    args = ("hydra.sweeper.n_trials=3", "optimizer.lr=interval(0.01,0.1)",
            "schedule.window_size=choice(1,2)")
    before = sha(db)
    proc = search(sweep_dir, *args, env=cli_env)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.splitlines() == [
        f"gradsync: search refused: {db}: a study written by optuna 2.10.1 (gradsync's search "
        f"before Optuna 4); optuna {optuna.__version__} reads it once its tables are upgraded "
        f"in place: copy the file, then run: optuna storage upgrade --storage {storage}"]
    assert sha(db) == before and not (sweep_dir / "2").exists()
    upgrade = subprocess.run([str(Path(sys.executable).parent / "optuna"), "storage", "upgrade",
                              "--storage", storage], capture_output=True, text=True,
                             timeout=120)
    assert upgrade.returncode == 0, upgrade.stderr
    proc = search(sweep_dir, *args, env=cli_env)
    assert proc.returncode == 0, proc.stderr
    study = optuna.load_study(study_name="gradsync", storage=storage)
    got = study.get_trials()
    assert [(t.number, t.state.name) for t in got] == [
        (0, "COMPLETE"), (1, "COMPLETE"), (2, "COMPLETE")]
    assert got[0].values == [0.38129260505957063] and got[1].params == {  # as recorded then
        "optimizer.lr": 0.05903948646972072, "schedule.accum_steps": 2}  # old name
    assert got[2].values == [summary_json(sweep_dir / "2")["eval"]["loss"]]
    assert got[2].user_attrs[run_search.OWNER] == str(sweep_dir)
    md = (sweep_dir / "sweep_summary.md").read_text()
    assert f"Optuna study gradsync ({storage}): eval_loss (minimize); 1 trials: 1 COMPLETE." in md


# --- without gradsync[search] ----------------------------------------------------------------
@pytest.mark.slow
def test_a_search_without_optuna_is_one_line_naming_the_extra(tmp_path, cli_env):
    sweep_dir = tmp_path / "sweep"
    code = ("import sys; sys.modules['optuna'] = None; from gradsync.run.main import main; "
            "main()")
    proc = subprocess.run(
        [sys.executable, "-c", code, "-m", f"hydra.sweep.dir={sweep_dir}", *TINY,
         "optimizer.lr=interval(0.01,0.1)"], capture_output=True, text=True, env=cli_env,
        timeout=300)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.splitlines() == [
        "gradsync: config error: hydra/sweeper=optuna (a search) needs optuna: pip install "
        "'gradsync[search]'"]
