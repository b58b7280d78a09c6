"""Buffers (issue 30, part 3): the model that is evaluated is the model that is saved, on every
engine. With BatchNorm, DDP broadcasts rank 0's buffers at the start of each forward and each
rank then updates its own (FSDP2 never syncs them), so after the last forward the ranks'
running statistics differed, each rank evaluated its shard of the eval data with its own, and
the summary's eval_loss was not the checkpoint's. Every engine now broadcasts rank 0's buffers
(what DDP's forward and the checkpoint keep) before each evaluation and each checkpoint."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import dist_cases
import engine_cases
from configs import plain_cfg
from gradsync.components import build
from gradsync.data.contract import build_data
from gradsync.data.evaluation import evaluate
from gradsync.train import checkpoint

pytestmark = [pytest.mark.dist]

# 203 samples (uneven over 2 ranks), micro-batches of 8, windows of 2, 2 epochs; eval data
# 61 samples (rank 0 scores 31, rank 1 30)
BATCHNORM = ["data=synthetic", "data.num_samples=203", "data.eval_samples=61", "data.in_dim=8",
             "data.out_dim=2", "schedule.micro_batch_size=8",
             "model._target_=components_for_tests.BatchNormMLP", "~model.hidden_sizes",
             "~model.activation", "~model.dropout", "schedule.window_size=2",
             "optimizer.lr=0.05", "trainer.max_epochs=2", "trainer.checkpoint_every_steps=5",
             "trainer.eval_every_steps=4", "trainer.progress_bar=false",
             "trainer.threads_per_worker=1"]


def one_process_eval(cfg: dict, state: dict) -> float:
    """The saved model evaluated in this process, on all the eval data."""
    data = build_data(cfg["data"], cfg["seed"])
    model = build(cfg["model"], data.sizes)
    model.load_state_dict(state)
    return evaluate(model, data, 0, 1, torch.device("cpu"))["loss"]


@pytest.mark.parametrize("engine", ["torch_ddp", "gradsync", "fsdp", "hsdp"])
def test_the_evaluated_model_is_the_saved_model(pool2, tmp_path, engine):
    replicas = ["engine.replicas=2"] if engine == "hsdp" else []  # 2 replicas of 1 rank
    cfg = plain_cfg([*BATCHNORM, f"engine={engine}", *replicas])
    ranks = pool2.run(dist_cases.train_run_buffers, cfg, str(tmp_path))
    b0, b1 = ranks[0]["buffers"], ranks[1]["buffers"]
    assert set(b0) == {"norm.running_mean", "norm.running_var", "norm.num_batches_tracked"}
    differ = {n: float((b0[n].double() - b1[n].double()).abs().max()) for n in b0}
    last = checkpoint.load(Path(tmp_path) / "checkpoints" / "last.pt")["model"]
    reported, alone = ranks[0]["summary"]["eval"]["loss"], one_process_eval(cfg, last)
    print(engine, "max |r0 - r1| per buffer:", differ,
          f"eval_loss reported {reported:.9f}, last.pt in one process {alone:.9f}")
    assert all(torch.equal(b0[n], b1[n]) for n in b0), differ
    assert all(torch.equal(last[n], b0[n]) for n in b0)  # the checkpoint keeps these
    assert abs(reported - alone) <= 1e-6 * abs(alone)


# --- engine.sync_batchnorm ---------------------------------------------------------------------
@pytest.mark.parametrize("extra,placement,says", [
    ([], None, "engine.sync_batchnorm=true needs CUDA ranks: torch's SyncBatchNorm computes its "
               "statistics on the GPU only (no CPU kernel); on CPU ranks each rank keeps its "
               "own batch statistics"),
    (["model=mlp"], "nccl", "engine.sync_batchnorm=true: the model (gradsync.models.MLP) has "
     "no BatchNorm layer to synchronise")])
def test_sync_batchnorm_is_refused_where_it_cannot_run(extra, placement, says):
    """On the sharded engines it is no key at all (tests/test_fsdp.py: another engine's
    setting is an unknown key in one line)."""
    from gradsync.config.validate import ConfigError
    from gradsync.run.main import compose_plain
    from gradsync.run.placement import Placement
    from gradsync.run.preflight import preflight

    model = [] if extra == ["model=mlp"] else BATCHNORM
    cfg = compose_plain([*BATCHNORM[:5], *model[5:], *extra, "engine.sync_batchnorm=true"])
    with pytest.raises(ConfigError) as e:
        preflight(cfg, Placement(placement, 2) if placement else None)
    assert str(e.value) == says


@pytest.mark.slow
def test_sync_batchnorm_on_cpu_ranks_is_one_line_exit_2(tmp_path, cli_env):
    import os
    import subprocess
    import sys

    env = cli_env | {"PYTHONPATH": os.pathsep.join([str(Path(__file__).parent),
                                                    cli_env.get("PYTHONPATH", "")])}
    done = subprocess.run([sys.executable, "-m", "gradsync.run.main", *BATCHNORM,
                           "engine.sync_batchnorm=true", f"hydra.run.dir={tmp_path / 'run'}"],
                          capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 2, done.stderr
    assert done.stderr.strip().splitlines() == [
        "gradsync: config error: engine.sync_batchnorm=true needs CUDA ranks: torch's "
        "SyncBatchNorm computes its statistics on the GPU only (no CPU kernel); on CPU ranks "
        "each rank keeps its own batch statistics"]
    assert not (tmp_path / "run" / "checkpoints").exists()


def test_sync_batchnorm_converts_the_models_batchnorm(pool2):
    """On CPU ranks only the conversion (torch's SyncBatchNorm trains on CUDA only; its DDP
    refuses it on a CPU module): the gradsync engine's model holds a SyncBatchNorm with the
    BatchNorm's buffers; torch_ddp's builder converts too, and DDP says why CPU ranks are
    refused. tests/test_gpu.py trains both."""
    for sync, name in ((True, "SyncBatchNorm"), (False, "BatchNorm1d")):
        out = pool2.run(engine_cases.batchnorm_statistics, "gradsync", sync, "cpu", False)
        assert [o["norm"] for o in out] == [name] * 2
        assert set(out[0]["buffers"]) == {"norm.running_mean", "norm.running_var",
                                          "norm.num_batches_tracked"}
    with pytest.raises(RuntimeError, match="SyncBatchNorm layers only work with GPU modules"):
        pool2.run(engine_cases.batchnorm_statistics, "torch_ddp", True, "cpu", False)


@pytest.mark.parametrize("engine", ["torch_ddp", "fsdp"])
def test_a_resumed_run_evaluates_what_the_uninterrupted_one_does(pool2, tmp_path, engine):
    """Resumed from the step-5 checkpoint in a fresh dir, every later evaluation and the saved
    buffers are the uninterrupted run's, bit for bit. Before, on fsdp, the resumed rank 1
    started from rank 0's buffers (DCP saves a replicated tensor once) while the uninterrupted
    rank 1 kept its own: their evaluations differed."""
    import json

    import sharded_cases

    cfg = plain_cfg([*BATCHNORM, f"engine={engine}"])
    through = pool2.run(sharded_cases.run, cfg, str(tmp_path / "through"))[0]
    ckpt = checkpoint.step_path(tmp_path / "through" / "checkpoints", 5)
    if engine == "fsdp":
        ckpt = ckpt.with_suffix(checkpoint.SHARDED_SUFFIX)
    resumed = pool2.run(sharded_cases.run, cfg | {"resume": str(ckpt)},
                        str(tmp_path / "resumed"))[0]
    assert resumed["summary"]["resumed_from"] == str(ckpt)

    def evals(run: str) -> list[tuple[int, str]]:
        rows = (tmp_path / run / "evals.jsonl").read_text().splitlines()
        return [(r["step"], r["loss"].hex()) for r in map(json.loads, rows) if r["step"] > 5]

    assert len(evals("through")) == 3  # steps 8, 12 and the end (14)
    assert evals("resumed") == evals("through")
    for name, value in through["params"].items():
        assert torch.equal(resumed["params"][name], value), name


def test_torch_ddp_and_gradsync_train_the_same_bits_with_batchnorm(pool2, tmp_path):
    """Both engines broadcast the buffers the same way (in the forward, and before every
    evaluation and checkpoint): the same rows, parameters and buffers, bit for bit. (Training
    itself is what it was before the buffers were aligned: DDP's next forward broadcasts rank
    0's buffers anyway; checked once against the code before, 14 rows and last.pt equal.)"""
    from configs import losses

    out = {}
    for engine in ("torch_ddp", "gradsync"):
        cfg = plain_cfg([*BATCHNORM, f"engine={engine}"])
        out[engine] = pool2.run(dist_cases.train_run_rows, cfg, str(tmp_path / engine))[0]
    theirs, ours = out["torch_ddp"], out["gradsync"]
    assert len(ours["rows"]) == 14 and losses(ours["rows"]) == losses(theirs["rows"])
    for name, value in theirs["params"].items():
        assert torch.equal(ours["params"][name], value), name
