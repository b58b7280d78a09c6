"""Components by _target_: a user's own model, data and policy (the example project, run from
outside the repo), the package installed from its wheel, and the guards on policies (a window
that never synchronises, replicas that drift)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import dist_cases
from components_for_tests import SyncLast
from configs import SAME, losses, plain_cfg
from conftest import REPO
from gradsync.config.validate import validate
from gradsync.sync.policy import as_policy
from gradsync.train import checkpoint

TINY = ["data=synthetic", "data.num_samples=192", "data.eval_samples=16", "data.in_dim=4",
        "data.out_dim=2", "data.micro_batch_size=8", "model.hidden_sizes=[8]",
        "schedule.accum_steps=2", "trainer.max_epochs=1", "trainer.progress_bar=false",
        "trainer.threads_per_worker=1", "trainer.checkpoint_every=0"]


def with_policy(target: str, extra: list[str] = (), **kwargs) -> dict:
    cfg = plain_cfg([*TINY, *extra])
    cfg["sync"] = {"_target_": target, **kwargs}
    validate(cfg)
    return cfg


@pytest.mark.dist
def test_a_policy_needs_only_should_sync(pool2, tmp_path):
    """A class with should_sync alone gets the base class's defaults, and they change nothing:
    the plain all-reduce, no early end of a window, no averaging of the model. Syncing a
    window's last micro-batch only, it trains bitwise what the built-in accumulate trains:
    the same rows, counters and parameters."""
    p = as_policy(SyncLast())
    assert p.name == "SyncLast" and not p.syncs_parameters and not p.own_replicas
    assert p.comm_hook().wire_dtype is None and p.replicas_in_sync()
    model = torch.nn.Linear(3, 2)
    assert p.bind(model) == []  # the engine all-reduces every parameter
    before = {k: v.clone() for k, v in model.state_dict().items()}
    assert not p.window_doomed(model, 0, 2)
    p.after_step(True)
    p.start(model, 0)
    p.after_window(model, 1)
    p.finish(model)
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())
    assert p.replica_drift is None and p.averaging is None

    own, _ = pool2.run(dist_cases.train_run_rows, with_policy("components_for_tests.SyncLast"),
                       str(tmp_path / "own"))
    built_in, _ = pool2.run(dist_cases.train_run_rows,
                            with_policy("gradsync.sync.policies.AccumulateSync"),
                            str(tmp_path / "accumulate"))
    assert (own["summary"]["sync_policy"], built_in["summary"]["sync_policy"]) == (
        "SyncLast", "accumulate")
    assert own["summary"]["sync_backwards"] == [own["summary"]["optimizer_steps"]] * 2
    assert losses(own["rows"]) == losses(built_in["rows"])
    assert {k: own["summary"][k] for k in SAME} == {k: built_in["summary"][k] for k in SAME}
    for name, value in built_in["params"].items():
        assert torch.equal(own["params"][name], value), name


@pytest.mark.slow
@pytest.mark.dist
def test_a_policy_that_never_synchronises_is_stopped_before_the_first_step(pool2, tmp_path):
    """The widely copied no_sync() mistake: each rank would step on its own gradients."""
    cfg = with_policy("components_for_tests.NeverSync")
    messages = pool2.run(dist_cases.train_run_expecting, cfg, str(tmp_path), "UnsyncedWindow")
    for m in messages:
        assert m.startswith("sync policy 'NeverSync' ends a window of 2 micro-batches "
                            "(micro-batches 0-1 of the epoch) inside no_sync()")
    assert not (tmp_path / "checkpoints").exists()  # no step was taken, nothing written


@pytest.mark.slow
@pytest.mark.dist
def test_check_replicas_names_the_parameter_that_drifted(pool2, tmp_path):
    cfg = with_policy("components_for_tests.CorruptRank1After", ["trainer.check_replicas=1"],
                      window=3)
    messages = pool2.run(dist_cases.train_run_expecting, cfg, str(tmp_path / "bad"),
                         "RuntimeError")
    assert messages == ["replicas differ after optimizer step 3: parameter '0.weight' on rank 1 "
                        "is not rank 0's (trainer.check_replicas)"] * 2
    # the same run without the corruption passes every check (6 steps, one per window)
    fine = with_policy("components_for_tests.CorruptRank1After", ["trainer.check_replicas=1"],
                       window=10**6)
    r0, _ = pool2.run(dist_cases.train_run, fine, str(tmp_path / "good"))
    assert r0["summary"]["optimizer_steps"] == 6


def cli(args: list[str], cwd: Path, env: dict, exe: str | None = None):
    exe = exe or str(Path(sys.executable).with_name("gradsync-train"))
    return subprocess.run([exe, *args], cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=300)


@pytest.mark.slow
def test_the_example_project_runs_from_its_own_directory(tmp_path, cli_env):
    """examples/cnn_digits copied outside the repo: its model, data and policy join the
    built-in groups through --config-dir, its modules import from where it runs."""
    project = tmp_path / "project"
    shutil.copytree(REPO / "examples" / "cnn_digits", project)
    refused = cli(["--config-dir", "conf", "experiment=cnn", "sync.warmup_windows=-1",
                   "hydra.run.dir=out/refused"], project, cli_env)
    assert refused.returncode == 2
    assert refused.stderr.strip() == ("gradsync: config error: sync.warmup_windows=-1 is not "
                                      "allowed: an integer >= 0")
    assert not (project / "out" / "refused").exists()
    done = cli(["--config-dir", "conf", "experiment=cnn", "trainer.max_steps=5",
                "sync.warmup_windows=2", "schedule.accum_steps=3", "trainer.progress_bar=false",
                "trainer.threads_per_worker=1", "hydra.run.dir=out/run"], project, cli_env)
    assert done.returncode == 0, done.stderr
    run = project / "out" / "run"
    s = json.loads((run / "summary.json").read_text())
    assert (s["status"], s["sync_policy"], s["optimizer_steps"]) == ("completed",
                                                                      "warmup_always", 5)
    # warm-up: every micro-batch of windows 1-2 synchronises, then only each window's last
    assert s["sync_backwards"] == [2 * 3 + 3 * 1] * 2
    ckpt = checkpoint.load(run / "checkpoints" / "last.pt")
    assert ckpt["model"]["0.weight"].shape == (16, 1, 3, 3)  # the CNN's first convolution
    assert ckpt["policy"] == {"windows_done": 5}


@pytest.mark.slow
def test_the_installed_package_runs_the_default_experiment_from_any_directory(tmp_path,
                                                                             cli_env):
    """pip install of the wheel (not editable) into a fresh venv, offline; gradsync-train from
    a directory that is not the repo finds its configs inside the package."""
    source, wheels = tmp_path / "source", tmp_path / "wheels"  # built from a copy: the repo
    skip = shutil.ignore_patterns("__pycache__", "*.egg-info")  # stays untouched
    for part in ("src", "conf"):
        shutil.copytree(REPO / part, source / part, ignore=skip)
    for part in ("pyproject.toml", "README.md"):
        shutil.copy(REPO / part, source / part)
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps",
                    "--no-build-isolation", "--wheel-dir", str(wheels), str(source)],
                   check=True, capture_output=True, timeout=300)
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True,
                   timeout=120)
    site = next((venv / "lib").glob("python3*/site-packages"))
    deps = [p for p in sys.path if p.endswith("site-packages")]  # torch, hydra, ... as they are
    (site / "deps.pth").write_text("\n".join(deps) + "\n")
    subprocess.run([sys.executable, "-m", "pip", "--python", str(venv / "bin" / "python"),
                    "install", "--quiet", "--no-index", "--no-deps",
                    *map(str, wheels.glob("*.whl"))], check=True, capture_output=True,
                   timeout=300)
    env = {k: v for k, v in cli_env.items() if k != "PYTHONPATH"}
    where = tmp_path / "elsewhere"
    where.mkdir()
    probe = subprocess.run([str(venv / "bin" / "python"), "-c",
                            "import gradsync.run.main as t; print(t.CONF_DIR)"],
                           cwd=where, env=env, capture_output=True, text=True, timeout=120)
    assert probe.stdout.strip() == str(site / "gradsync" / "conf"), probe.stderr
    done = cli(["trainer.max_steps=3", "trainer.progress_bar=false", "hydra.run.dir=run"], where,
               env, exe=str(venv / "bin" / "gradsync-train"))
    assert done.returncode == 0, done.stderr
    s = json.loads((where / "run" / "summary.json").read_text())
    assert (s["status"], s["optimizer_steps"], s["world_size"]) == ("completed", 3, 2)
    assert s["samples_seen"] == 3 * 2 * 4 * 16
    assert not os.path.exists(where / "conf")
