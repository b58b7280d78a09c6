"""The training loop's contract: the default experiment trains what it trained before the loop
became callbacks (a recorded hash), one step's collectives run in the order train/loop.py's
docstring gives, and a policy with nothing but should_sync trains on every engine."""

from __future__ import annotations

import hashlib
import json
from collections import Counter
from pathlib import Path

import pytest
import torch

import dist_cases
import loop_cases
from cli_jobs import Job
from configs import SAME, losses, plain_cfg
from gradsync.train import checkpoint

# --- the default experiment, bitwise ---------------------------------------------------------
# `make train`'s config (digits, the MLP, SGD + cosine, accumulate), 30 optimizer steps on one
# rank with one intra-op thread, in portable bits (the same bits on any x86-64 CPU with AVX2:
# core/numerics.py), as trained at da9f304 (before the loop's callbacks) under the same pins:
# the sha256 of its final parameters (sorted by name, raw bytes) and its final loss, bitwise.
DEFAULT_RUN = ["trainer.devices=1", "trainer.max_steps=30", "trainer.progress_bar=false",
               "trainer.threads_per_worker=1", "trainer.bits=portable"]
DEFAULT_PARAMS_SHA256 = "e7d76bbbcba0bcb5"
DEFAULT_FINAL_LOSS = "0x1.c9f3000000000p+0"


def params_hash(params: dict[str, torch.Tensor]) -> str:
    h = hashlib.sha256()
    for name in sorted(params):
        h.update(name.encode())
        h.update(params[name].contiguous().numpy().tobytes())
    return h.hexdigest()[:16]


@pytest.mark.slow
def test_the_default_experiment_trains_bitwise_what_it_trained_before(tmp_path, cli_env):
    code, _, err = Job(tmp_path / "run", DEFAULT_RUN, cli_env).finish()
    assert code == 0, err
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    params = checkpoint.load(tmp_path / "run" / "checkpoints" / "last.pt")["model"]
    assert summary["optimizer_steps"] == 30 and summary["windows"] == 30
    assert summary["numerics"]["cpu"]["capability"] == "AVX2"  # pinned on every CPU
    assert float(summary["final_train_loss"]).hex() == DEFAULT_FINAL_LOSS
    assert params_hash(params) == DEFAULT_PARAMS_SHA256


# --- the order of one step's collectives -----------------------------------------------------
STEP = ["data=synthetic", "data.num_samples=128", "data.eval_samples=16", "data.in_dim=4",
        "data.out_dim=2", "schedule.micro_batch_size=8", "model.hidden_sizes=[8]",
        "schedule.window_size=2", "trainer.max_steps=4", "trainer.progress_bar=false",
        "trainer.threads_per_worker=1", "trainer.log_every_windows=2", "trainer.check_replicas=2",
        "trainer.eval_every_steps=2", "trainer.checkpoint_every_steps=2"]
# what each run's windows hold besides the stop agreement (4 windows of 2 micro-batches)
ORDER_RUNS = {
    # fp16 with overflow consensus: a flag after each no_sync backward, found_inf agreed
    "amp_aware fp16": ([*STEP, "precision=fp16", "sync=amp_aware", "sync.comm_dtype=fp16"],
                       {"doomed_window": 4, "overflow_agreement": 4, "loss": 2,
                        "replica_check": 2, "evaluation": 2}),
    # the noise scale (its rows ride on the loss's all-reduce) and the adaptive schedule, which
    # flushes them when it chooses the next window's size
    "adaptive": ([*(s for s in STEP if not s.startswith("schedule.")), "noise_scale.enabled=true",
                  "schedule=adaptive", "schedule.every_steps=2", "schedule.initial_window_size=2"],
                 {"schedule": 2, "loss": 2, "replica_check": 2, "evaluation": 2,
                  "checkpoint": 2}),
    # local SGD averaging every 2 windows: the averaging, the drift riding on the log point's
    # loss, the replicas checked after it, the finite check before each checkpoint
    "local_sgd": ([*STEP, "sync=local_sgd", "sync.every=2"],
                  {"averaging": 4, "loss": 2, "replica_check": 2, "evaluation": 2,
                   "checkpoint": 2}),
}


def test_the_documented_order_names_every_collective_of_a_step():
    assert loop_cases.documented() == [
        "token_count", "doomed_window", "overflow_agreement", "schedule", "averaging",
        "loss", "replica_check", "evaluation", "stop", "checkpoint"]


@pytest.mark.dist
@pytest.mark.parametrize("name", ORDER_RUNS)
def test_one_steps_collectives_run_in_the_documented_order(pool2, tmp_path, name):
    """Every collective a 2-rank run makes, named by the code that made it: the same on both
    ranks, none unnamed, and inside each window in the order of train/loop.py's docstring."""
    overrides, counts = ORDER_RUNS[name]
    r0, r1 = pool2.run(loop_cases.recorded_collectives, plain_cfg(overrides), str(tmp_path))
    assert r0 == r1
    assert not [c for c in r0 if c.startswith("unnamed")], r0
    order = loop_cases.documented()
    steps = Counter(c for c in r0 if c in order)
    # the stop agreement's all-reduce is asynchronous: a new one starts when the last is done
    assert steps.pop("stop") >= 1
    assert steps == counts, r0
    windows: list[list[str]] = []
    for c in r0:
        if c == "window":
            windows.append([])
        elif c in order and windows:
            windows[-1].append(c)
    assert len(windows) == 4
    for names in windows:
        where = [order.index(c) for c in names]
        assert where == sorted(where), names


# --- a policy of one's own on every engine ---------------------------------------------------
TINY = ["data=synthetic", "data.num_samples=192", "data.eval_samples=16", "data.in_dim=4",
        "data.out_dim=2", "schedule.micro_batch_size=8", "model.hidden_sizes=[8]",
        "schedule.window_size=2", "trainer.max_epochs=1", "trainer.progress_bar=false",
        "trainer.threads_per_worker=1", "trainer.checkpoint_every_steps=0"]


def with_policy(target: str, engine: str) -> dict:
    cfg = plain_cfg([*TINY, f"engine={engine}"])
    cfg["sync"] = {"_target_": target}
    return cfg


@pytest.mark.dist
@pytest.mark.parametrize("engine", ["torch_ddp", "gradsync", "fsdp"])
def test_a_policy_with_only_should_sync_trains_as_accumulate_on_every_engine(pool2, tmp_path,
                                                                             engine):
    """components_for_tests.SyncLast (should_sync and nothing else) against the built-in
    accumulate on the same engine, 2 real gloo ranks: the same rows, counters and parameters,
    bitwise."""
    own, _ = pool2.run(dist_cases.train_run_rows,
                       with_policy("components_for_tests.SyncLast", engine), str(tmp_path / "own"))
    ref, _ = pool2.run(dist_cases.train_run_rows,
                       with_policy("gradsync.sync.policies.AccumulateSync", engine),
                       str(tmp_path / "accumulate"))
    assert own["summary"]["sync_policy"] == "SyncLast"
    # 192 samples / (2 ranks x 8 x 2): 6 windows, one synchronising backward each
    assert own["summary"]["optimizer_steps"] == 6
    assert own["summary"]["sync_backwards"] == [6, 6]
    assert losses(own["rows"]) == losses(ref["rows"])
    assert {k: own["summary"][k] for k in SAME} == {k: ref["summary"][k] for k in SAME}
    assert set(own["params"]) == set(ref["params"]) and own["params"]
    for name, value in ref["params"].items():
        assert torch.equal(own["params"][name], value), name
    assert not torch.equal(ref["params"][name], torch.zeros_like(value))  # trained something


def test_a_renamed_option_on_the_command_line_names_the_new_one(tmp_path, monkeypatch, capsys):
    from test_config import TESTS, entry_point_error

    for old, new in (("sync.warmup_steps", "sync.warmup_windows"),
                     ("sync.powersgd_start_step", "sync.powersgd_start_backwards")):
        sync = "sync=local_sgd" if "warmup" in old else "sync=accumulate"
        line = entry_point_error([sync, f"{old}=2"], TESTS, tmp_path / old, monkeypatch, capsys)
        assert line == f"{old} was renamed: use {new}"
    assert Path(TESTS).is_dir()


# --- the contract page lists exactly what the code calls -------------------------------------
def test_the_contract_page_lists_exactly_the_members_gradsync_calls():
    import re

    from gradsync.sync.averaging import Averager
    from gradsync.sync.comm import Wire
    from gradsync.sync.policy import AVERAGER, OPTIONAL, WIRE, Adopted, SyncPolicy, as_policy

    page = (Path(__file__).parents[1] / "docs" / "components.md").read_text()

    def listed(header: str) -> set[str]:
        table = page.split(f"| {header} | default | what for |")[1].split("\n\n")[0]
        return {name for row in table.splitlines()[2:]
                for name in re.findall(r"`(\w+)(?:\([^`]*\))?`", row.split(" | ")[0])}

    # the policy's own table, and one per role
    assert listed("member") == {"should_sync", *OPTIONAL}
    assert listed("wire member") == set(WIRE)
    assert listed("averager member") == set(AVERAGER)
    # the base classes' members are those (state_dict / load_state_dict: what a checkpoint
    # calls on any component that has them, no default)
    checkpoint_only = {"state_dict", "load_state_dict"}
    assert {n for n in vars(SyncPolicy) if not n.startswith("_")} == (
        {"should_sync", *OPTIONAL} - checkpoint_only)
    assert {n for n in vars(Wire) if not n.startswith("_")} == set(WIRE)
    assert {n for n in vars(Averager) if not n.startswith("_")} == set(AVERAGER) - checkpoint_only
    # an Adopted has no members of its own: it reads the roles from the object it holds
    held = {n for n in vars(Adopted) if not n.startswith("_")}
    assert held - {"name"} == set()  # its name: the held class's

    class Own:
        wire, averager = Wire(), Averager()

        def should_sync(self, micro_index: int, window_size: int) -> bool:
            return True

    own = Own()
    adopted = as_policy(own)
    assert isinstance(adopted, Adopted) and type(own) is Own  # its class left as it is
    assert (adopted.name, adopted.wire, adopted.averager) == ("Own", own.wire, own.averager)
