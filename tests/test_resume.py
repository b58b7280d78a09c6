"""Reproducible runs and exact resume on the pool's 2 real gloo ranks: the same config twice gives
the same bits; continuing from any checkpoint (mid-epoch, before a partial window, at an epoch
boundary) ends where the uninterrupted run ends, bit for bit; a non-finite loss stops the run."""

from __future__ import annotations

import json
import math
import shutil

import pytest
import torch

import dist_cases
from configs import EXACT_RESUME, SAME, STEPS_PER_EPOCH, losses, plain_cfg
from gradsync.train import checkpoint

pytestmark = [pytest.mark.dist, pytest.mark.slow]

EXACT = [*EXACT_RESUME, "trainer.max_epochs=4", "trainer.log_every=3",
         "trainer.checkpoint_every=2", "trainer.keep_checkpoints=50", "seed=7"]
WINDOWS = 4 * STEPS_PER_EPOCH
# fp16 with a GradScaler that starts too high and grows back every 3 steps: windows overflow
# (amp_aware aborts them on every rank) and their steps are skipped, so the scaler's state, the
# skipped-step count and the overflow counters must all survive a resume.
PRECISIONS = {"fp32": [], "fp16": ["precision=fp16", "precision.init_scale=4194304.0",
                                   "precision.growth_interval=3", "sync=amp_aware"]}


@pytest.fixture(scope="module", params=list(PRECISIONS))
def uninterrupted(request, pool2, tmp_path_factory):
    overrides = [*EXACT, *PRECISIONS[request.param]]
    run_dir = tmp_path_factory.mktemp(f"uninterrupted_{request.param}")
    r0, _ = pool2.run(dist_cases.train_run_rows, plain_cfg(overrides), str(run_dir))
    assert r0["summary"]["windows"] == WINDOWS
    assert r0["summary"]["samples_seen"] == 4 * 199  # the sampler's repeats not counted
    assert [r["window"] for r in r0["rows"]] == list(range(1, WINDOWS + 1))
    if request.param == "fp16":
        assert r0["summary"]["amp_skipped_steps"] >= 2
        assert r0["summary"]["amp_aborted_windows"][0] >= 1
    return overrides, run_dir, r0


def test_the_same_config_twice_gives_the_same_bits(pool2, uninterrupted, tmp_path):
    overrides, _, first = uninterrupted
    second, r1 = pool2.run(dist_cases.train_run_rows, plain_cfg(overrides), str(tmp_path))
    assert losses(second["rows"]) == losses(first["rows"])
    assert {k: second["summary"][k] for k in SAME} == {k: first["summary"][k] for k in SAME}
    for name, value in first["params"].items():
        assert torch.equal(second["params"][name], value), name
    assert second["deterministic"] and r1["deterministic"]  # trainer.deterministic: on for CPU
    # a different seed really changes the run (the comparison above has teeth)
    other, _ = pool2.run(dist_cases.train_run_rows, plain_cfg([*overrides, "seed=8"]),
                         str(tmp_path / "other"))
    assert losses(other["rows"]) != losses(first["rows"])


@pytest.mark.parametrize("step", [4, 6, 10])
def test_resuming_from_a_checkpoint_ends_bitwise_where_the_uninterrupted_run_ends(
        pool2, uninterrupted, tmp_path, step):
    """Checkpoints inside an epoch, before its partial last window, at an epoch boundary."""
    overrides, ref_dir, ref = uninterrupted
    ckpt = checkpoint.step_path(ref_dir / "checkpoints", step)
    state = checkpoint.load(ckpt)
    progress = state["progress"]
    assert progress["step"] == step and len(state["ranks"]) == 2
    assert (progress["epoch"], progress["epoch_step"]) == divmod(progress["windows"],
                                                                 STEPS_PER_EPOCH)
    # the two ranks' RNG streams differ (seeded from seed and rank)
    assert not torch.equal(state["ranks"][0]["rng"]["torch"], state["ranks"][1]["rng"]["torch"])

    # the resumed run has its own dir: it only holds the rows from the checkpoint on
    out, _ = pool2.run(dist_cases.train_run_rows, plain_cfg([*overrides, f"resume={ckpt}"]),
                       str(tmp_path))
    assert out["summary"]["resumed_from"] == str(ckpt)
    assert losses(out["rows"]) == losses(ref["rows"])[progress["windows"]:]
    assert {k: out["summary"][k] for k in SAME} == {k: ref["summary"][k] for k in SAME}
    for name, value in ref["params"].items():
        assert torch.equal(out["params"][name], value), name


def test_resume_auto_in_the_run_dir_truncates_the_rows_after_the_checkpoint(
        pool2, uninterrupted, tmp_path):
    """A run dir whose newest checkpoint is older than its last logged rows (killed between
    the two): resume=auto drops the rows after the checkpoint and logs them again, once."""
    overrides, ref_dir, ref = uninterrupted
    (tmp_path / "checkpoints").mkdir()
    for name in ("step_00000008.pt", "step_00000008.json"):
        (tmp_path / "checkpoints" / name).write_bytes((ref_dir / "checkpoints" / name)
                                                      .read_bytes())
    lines = (ref_dir / "metrics.jsonl").read_text().splitlines()
    (tmp_path / "metrics.jsonl").write_text("\n".join(lines[:15]) + "\n" + lines[15][:20])
    out, _ = pool2.run(dist_cases.train_run_rows, plain_cfg([*overrides, "resume=auto"]),
                       str(tmp_path))
    assert losses(out["rows"]) == losses(ref["rows"])
    steps = ref["summary"]["optimizer_steps"]
    kept = sorted(p.name for p in (tmp_path / "checkpoints").glob("step_*.pt"))
    assert kept[0] == "step_00000008.pt" and kept[-1] == f"step_{steps:08d}.pt"
    assert checkpoint.load(tmp_path / "checkpoints" / "last.pt")["step"] == steps


def test_a_non_finite_fp32_loss_stops_the_run_naming_the_step(pool2, tmp_path):
    """SGD with a huge learning rate: the loss overflows within a few steps; both ranks stop
    with the same error, and only checkpoints from before it remain."""
    cfg = plain_cfg([*EXACT, "optimizer=sgd", "optimizer.lr=1e4", "optimizer.momentum=0.9",
                     "trainer.log_every=1", "trainer.checkpoint_every=1"])
    errors = pool2.run(dist_cases.train_run_expecting, cfg, str(tmp_path), "FloatingPointError")
    assert errors[0] == errors[1]
    assert "non-finite training loss" in errors[0] and "(fp32)" in errors[0]
    bad_step = int(errors[0].split("at optimizer step ")[1].split()[0])
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(1, bad_step + 1))
    assert all(math.isfinite(r["loss"]) for r in rows[:-1]) and not math.isfinite(
        rows[-1]["loss"])
    kept = checkpoint.complete(tmp_path / "checkpoints")
    assert kept and checkpoint.load(kept[0])["step"] == bad_step - 1
    for path in kept:
        assert all(torch.isfinite(t).all() for t in checkpoint.load(path)["model"].values())


def test_ranks_agree_to_stop_one_step_after_a_flag_without_blocking(pool2):
    # rank 1 alone gets the signal before poll 3: both ranks stop at poll 4
    assert pool2.run(dist_cases.agree_on_stop, 10, 1, 3) == [4, 4]
    assert pool2.run(dist_cases.agree_on_stop, 10, 0, 0) == [1, 1]
    assert pool2.run(dist_cases.agree_on_stop, 5, 0, 99) == [-1, -1]


def test_every_rank_starts_from_the_checkpoint_rank_0_chose(pool2, uninterrupted, tmp_path):
    """Under torchrun each node's job picks a checkpoint in its own run dir: here rank 0's dir
    holds the checkpoints and rank 1's holds none. Rank 1 must resume from rank 0's choice, not
    start afresh (it reads it on the shared disk), or nothing would match."""
    overrides, ref_dir, ref = uninterrupted
    shutil.copytree(ref_dir / "checkpoints", tmp_path / "rank0" / "checkpoints")
    (tmp_path / "rank0" / "checkpoints" / "last.pt").unlink()
    newest = checkpoint.complete(tmp_path / "rank0" / "checkpoints")[0]
    newest.unlink()  # resume from the one before the end, so that there is training to match
    newest.with_suffix(".json").unlink()
    chosen = str(checkpoint.complete(tmp_path / "rank0" / "checkpoints")[0])
    out, r1 = pool2.run(dist_cases.train_run_rows, plain_cfg([*overrides, "resume=auto"]),
                        str(tmp_path), True)
    assert out["summary"]["resumed_from"] == r1["summary"]["resumed_from"] == chosen
    assert {k: out["summary"][k] for k in SAME} == {k: ref["summary"][k] for k in SAME}
    for name, value in ref["params"].items():
        assert torch.equal(out["params"][name], value), name
