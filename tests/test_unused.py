"""A parameter that got no gradient in a synchronising backward (issue 30, part 4): on every
engine one line naming the parameters and engine.find_unused_parameters=true, exit 1, the run
dir and the checkpoints written before intact (torch_ddp said "Expected to have finished
reduction in the prior iteration" one forward later, naming nothing; fsdp, where the ranks
missed different parameters, died by SIGABRT in gloo's reduce-scatter). With the option, every
engine trains the model (fsdp: FSDP2's set_reduce_scatter_unused_params)."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import pytest

from cli_jobs import Job
from gradsync.train import checkpoint

pytestmark = [pytest.mark.slow, pytest.mark.dist]

TESTS = str(Path(__file__).parent)
# 128 samples, 2 ranks, micro-batches of 8, windows of 1: 8 optimizer steps, each a
# synchronising backward; the branch is skipped on the 2nd call (rank 0's 2nd with by_rank)
JOB = ["data=synthetic", "data.num_samples=128", "data.eval_samples=64", "data.in_dim=8",
       "data.out_dim=2", "schedule.micro_batch_size=8", "model._target_="
       "components_for_tests.SometimesUnusedBranch", "~model.hidden_sizes", "~model.activation",
       "~model.dropout", "schedule.window_size=1", "trainer.max_epochs=1",
       "trainer.checkpoint_every_steps=1", "trainer.progress_bar=false",
       "trainer.threads_per_worker=1", "trainer.devices=2"]


def job(tmp_path: Path, cli_env: dict, *args: str) -> Job:
    env = cli_env | {"PYTHONPATH": os.pathsep.join([TESTS, cli_env.get("PYTHONPATH", "")])}
    return Job(tmp_path / "run", [*JOB, *args], env)


# the branch as an FSDP unit of its own, skipped by rank 0 alone: rank 1 reduce-scatters it in
# FSDP's final callback, where rank 0's next collective was the root's (a timeout)
OWN_UNIT = ("engine.fsdp_units=aux", "trainer.timeout_s=20")


@pytest.mark.parametrize("engine,by_rank,extra", [
    ("torch_ddp", False, ()), ("gradsync", False, ()), ("fsdp", False, ()), ("fsdp", True, ()),
    ("hsdp", True, ("engine.replicas=2",)), ("fsdp", True, OWN_UNIT)])
def test_a_parameter_without_gradient_ends_the_run_in_one_line(tmp_path, cli_env, engine,
                                                               by_rank, extra):
    run = job(tmp_path, cli_env, f"engine={engine}", f"+model.by_rank={by_rank}",
              *extra)
    code, _, err = run.finish()
    assert code == 1, err
    line = err.strip().splitlines()[-1]
    ranks = "0" if by_rank else "[01]"  # with by_rank only rank 0 missed them
    assert re.fullmatch(
        rf"gradsync: training failed: rank ({ranks}) failed: UnusedParameters: rank \1: 2 "
        r"parameter\(s\) got no gradient in this synchronising backward: aux\.weight, "
        r"aux\.bias; the forward did not use them, so .*\. Set "
        r"engine\.find_unused_parameters=true, or leave them out of the model "
        r"\(docs/debugging\.md\)", line), line
    assert "Traceback" not in err and "SIGABRT" not in err and "Timed out" not in err, err
    run_dir = run.run_dir
    assert json.loads((run_dir / "summary.json").read_text())["status"] == "failed"
    # step 1 used the branch everywhere: its checkpoint stays, complete; step 2 wrote none
    assert [p.name for p in checkpoint.complete(run_dir / "checkpoints")] == [
        "step_00000001" + (checkpoint.SHARDED_SUFFIX if engine in ("fsdp", "hsdp") else ".pt")]
    assert (run_dir / "logs" / "rank0.log").is_file() and (run_dir / "metrics.jsonl").is_file()
    assert run.survivors() == []


@pytest.mark.parametrize("engine", ["torch_ddp", "fsdp"])
def test_with_find_unused_parameters_every_engine_trains_the_branch(tmp_path, cli_env, engine):
    run = job(tmp_path, cli_env, f"engine={engine}", "+model.by_rank=true",
              "engine.find_unused_parameters=true")
    code, _, err = run.finish()
    assert code == 0, err
    summary = json.loads((run.run_dir / "summary.json").read_text())
    assert summary["status"] == "completed" and summary["optimizer_steps"] == 8


def test_fsdp_reduces_what_the_window_accumulated(tmp_path, cli_env):
    """Windows of 2 (the branch used on the first micro-batch, inside no_sync, skipped on the
    synchronising second): FSDP reduce-scatters what accumulated, so it trains; torch's DDP
    reduces what the synchronising backward produced, so torch_ddp stops."""
    fsdp = job(tmp_path / "fsdp", cli_env, "engine=fsdp", "schedule.window_size=2")
    code, _, err = fsdp.finish()
    assert code == 0, err
    ddp = job(tmp_path / "ddp", cli_env, "schedule.window_size=2")
    code, _, err = ddp.finish()
    assert code == 1 and "UnusedParameters: rank" in err.strip().splitlines()[-1], err
