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
from gradsync.config.schema import PrecisionConfig
from gradsync.run.preflight import preflight
from gradsync.sync.comm import PLAIN, ShardedSync, decides_per_bucket
from gradsync.sync.policy import as_policy
from gradsync.train import checkpoint
from gradsync.train.precision import build_precision
from test_install import build_wheel

TINY = ["data=synthetic", "data.num_samples=192", "data.eval_samples=16", "data.in_dim=4",
        "data.out_dim=2", "schedule.micro_batch_size=8", "model.hidden_sizes=[8]",
        "schedule.window_size=2", "trainer.max_epochs=1", "trainer.progress_bar=false",
        "trainer.threads_per_worker=1", "trainer.checkpoint_every_steps=0"]


def with_policy(target: str, extra: list[str] = (), **kwargs) -> dict:
    cfg = plain_cfg([*TINY, *extra])
    cfg["sync"] = {"_target_": target, **kwargs}
    preflight(cfg)
    return cfg


@pytest.mark.dist
def test_a_policy_needs_only_should_sync(pool2, tmp_path):
    """A class with should_sync alone gets the base class's defaults, and they change nothing:
    the plain all-reduce, no early end of a window, no averaging of the model. Syncing a
    window's last micro-batch only, it trains bitwise what the built-in accumulate trains:
    the same rows, counters and parameters."""
    p = as_policy(SyncLast())
    # no roles: the engine gets the plain all-reduce, the loop no averager (no replica of a
    # rank's own, no window that ends without a gradient all-reduce)
    assert p.name == "SyncLast" and p.wire is None and p.averager is None
    wire = p.wire or PLAIN
    assert wire.comm_hook().wire_dtype is None and not decides_per_bucket(wire)
    model = torch.nn.Linear(3, 2)
    assert wire.bind(model) == []  # the engine all-reduces every parameter
    assert wire.sharded_sync(["weight", "bias"]) == {n: ShardedSync("rest", None, "boundary",
                                                                    "boundary")
                                                     for n in ("weight", "bias")}
    before = {k: v.clone() for k, v in model.state_dict().items()}
    fp16 = build_precision(PrecisionConfig(name="fp16"), "cpu", p)
    assert fp16.consensus is None and not fp16.window_doomed(model, 0, 2)  # no overflow check
    wire.after_step(True)
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())

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


def test_data_is_built_from_the_seed_alone():
    """No cache: the preflight, +inspect and every rank build the data each, and wherever it is
    built it is the same data (the global streams seeded from the run seed, the caller's left
    as they were)."""
    from gradsync.data.contract import build_data

    node = {"_target_": "components_for_tests.data_from_the_global_stream"}
    torch.manual_seed(123)
    checked = build_data(node, 7)
    torch.manual_seed(999)
    state = torch.get_rng_state()
    again = build_data(node, 7)  # the rank's: built anew
    assert again is not checked
    assert torch.equal(again.train.tensors[0], checked.train.tensors[0])
    assert torch.equal(torch.get_rng_state(), state)
    other = build_data(node, 8)
    assert not torch.equal(other.train.tensors[0], checked.train.tensors[0])


@pytest.mark.dist
def test_a_policy_that_never_synchronises_is_stopped_before_the_first_step(pool2, tmp_path):
    """The widely copied no_sync() mistake: each rank would step on its own gradients."""
    cfg = with_policy("components_for_tests.NeverSync")
    messages = pool2.run(dist_cases.train_run_expecting, cfg, str(tmp_path), "UnsyncedWindow")
    for m in messages:
        assert m.startswith("sync policy 'NeverSync' ends a window of 2 micro-batches "
                            "(micro-batches 0-1 of the epoch) inside no_sync(): no micro-batch "
                            "of the window synchronised: no gradient was all-reduced, so every "
                            "rank would step on gradients of its own"), m
    assert not (tmp_path / "checkpoints").exists()  # no step was taken, nothing written
    # a policy that synchronised an earlier micro-batch of the window is told so
    cfg = with_policy("components_for_tests.SyncFirstOnly", ["schedule.window_size=3"])
    messages = pool2.run(dist_cases.train_run_expecting, cfg, str(tmp_path / "first"),
                         "UnsyncedWindow")
    for m in messages:
        assert m.startswith("sync policy 'SyncFirstOnly' ends a window of 3 micro-batches "
                            "(micro-batches 0-2 of the epoch) inside no_sync(): micro-batch 0 "
                            "synchronised, but micro-batches 1-2 (the last included) did not: "
                            "the gradients accumulated after it were never all-reduced"), m


@pytest.mark.dist
@pytest.mark.parametrize("data,expected", [
    ("components_for_tests.digits_with_mean_loss",
     "data (components_for_tests.digits_with_mean_loss): loss(output, target) returned a tuple "
     "of 2: a tensor of shape [], a tensor of shape []; expected per-sample loss sums and unit "
     "counts, each a tensor of shape [8] for the micro-batch's 8 kept samples"),
    ("components_for_tests.digits_with_per_sample_correct",
     "data (components_for_tests.digits_with_per_sample_correct): correct(output, target) "
     "returned a tensor of shape [8]; expected a scalar count of the units predicted right"),
])
def test_the_loss_and_correct_contracts_are_checked_on_the_first_micro_batch(pool2, tmp_path,
                                                                            data, expected):
    """A loss returning the micro-batch's mean trains, wrongly, and a per-sample `correct`
    fails only at the final evaluation: both stop every rank at its first micro-batch."""
    cfg = plain_cfg([a for a in TINY if not a.startswith("data")])
    cfg["data"] = {"_target_": data}
    preflight(cfg)  # nothing to see before training: the bundle is a DataBundle
    messages = pool2.run(dist_cases.train_run_expecting, cfg, str(tmp_path), "ContractError")
    for m in messages:
        assert m.startswith(expected), m
    assert not (tmp_path / "checkpoints").exists()  # no step was taken


def test_a_role_that_is_no_wire_or_averager_is_one_line_before_any_worker(tmp_path, monkeypatch,
                                                                          capsys):
    from test_config import TESTS, entry_point_error

    line = entry_point_error(["sync=always", "sync._target_=components_for_tests.WireIsADtype"],
                             TESTS, tmp_path, monkeypatch, capsys)
    assert line == ("sync (components_for_tests.WireIsADtype): wire is a str, not a "
                    "gradsync.sync.comm.Wire (subclass it) or None")


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
                "sync.warmup_windows=2", "schedule.window_size=3", "trainer.progress_bar=false",
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
def test_inspect_params_composes_through_config_dir_and_leaves_nothing(tmp_path, cli_env):
    """+inspect=params with --config-dir and an experiment of the project's own: the CNN's
    parameters (not the default MLP's), nothing trained, no run dir."""
    project = tmp_path / "project"
    shutil.copytree(REPO / "examples" / "cnn_digits", project)
    shown = cli(["--config-dir", "conf", "experiment=cnn", "model.channels=4", "+inspect=params",
                 "hydra.run.dir=out/run"], project, cli_env)
    assert shown.returncode == 0, shown.stderr
    rows = {}
    for line in shown.stdout.splitlines():
        if line[:1].isdigit():  # name [shape] bytes rule
            name, rest = line.split(maxsplit=1)
            shape, _, after = rest.partition("]")
            rows[name] = (shape + "]", int(after.split()[0]))
    # conv 1->4 3x3, conv 4->4 3x3, linear 4*4*4 -> 10 (8x8 images pooled to 4x4): the CNN
    assert rows == {"0.weight": ("[4, 1, 3, 3]", 144), "0.bias": ("[4]", 16),
                    "2.weight": ("[4, 4, 3, 3]", 576), "2.bias": ("[4]", 16),
                    "6.weight": ("[10, 64]", 2560), "6.bias": ("[10]", 40)}, shown.stdout
    assert not (project / "out").exists() and not (project / "outputs").exists()


@pytest.mark.slow
def test_the_installed_package_runs_the_default_experiment_from_any_directory(tmp_path,
                                                                             cli_env):
    """pip install of the wheel (not editable) into a fresh venv, offline; gradsync-train from
    a directory that is not the repo finds its configs inside the package."""
    wheel = build_wheel(tmp_path)
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True,
                   timeout=120)
    site = next((venv / "lib").glob("python3*/site-packages"))
    deps = [p for p in sys.path if p.endswith("site-packages")]  # torch, hydra, ... as they are
    (site / "deps.pth").write_text("\n".join(deps) + "\n")
    subprocess.run([sys.executable, "-m", "pip", "--python", str(venv / "bin" / "python"),
                    "install", "--quiet", "--no-index", "--no-deps",
                    str(wheel)], check=True, capture_output=True,
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
    # the Hugging Face example project, from its own directory, on the installed package
    project = tmp_path / "hf_causal_lm"
    shutil.copytree(REPO / "examples" / "hf_causal_lm", project)
    done = cli(["--config-dir", "conf", "experiment=tiny_llama", "trainer.max_steps=2",
                "trainer.progress_bar=false", "trainer.threads_per_worker=1",
                "hydra.run.dir=out/run"], project, env, exe=str(venv / "bin" / "gradsync-train"))
    assert done.returncode == 0, done.stderr
    s = json.loads((project / "out" / "run" / "summary.json").read_text())
    assert (s["status"], s["optimizer_steps"], s["world_size"]) == ("completed", 2, 2)
    model = checkpoint.load(project / "out" / "run" / "checkpoints" / "last.pt")["model"]
    assert model["model.lm_head.weight"].shape == (256, 64)  # the Llama: 4 layers of width 64
    assert sum(k.endswith("self_attn.q_proj.weight") for k in model) == 4
