"""Reproducible runs and exact resume: the same config twice gives the same bits; a run stopped
in any way (a checkpoint mid-epoch, before a partial window or at an epoch boundary; a kill
between a checkpoint and its rows; rank 0's dir alone; SIGTERM, Ctrl-C and kill -9 of a real
job with a corrupt checkpoint; a SLURM preemption and requeue; kill -9 between two averagings of
local SGD / DiLoCo or of a per-layer rule) and resumed ends where the uninterrupted run ends,
bit for bit (one harness: tests/resume_harness.py); an incompatible resume is refused; a
non-finite loss stops the run."""

from __future__ import annotations

import json
import math
import shutil

import pytest
import torch

import dist_cases
import local_sgd_cases
from cli_jobs import Job
from configs import EXACT_RESUME, LONG_JOB, LONG_JOB_STEPS, SAME, STEPS_PER_EPOCH, losses, plain_cfg
from gradsync.train import checkpoint
from resume_harness import (
    Case,
    Reference,
    Run,
    check,
    from_checkpoint,
    kill_9_at,
    rank0_dir_only,
    rows_past_the_checkpoint,
    sigterm_ctrl_c_then_kill_9_and_a_corrupt_checkpoint,
    slurm_sigusr1_and_requeue,
)
from test_layer_sync import EVERY_4_RUN, WINDOWS
from test_local_sgd import RUN as LOCAL_RUN
from test_local_sgd import params as flat_params

pytestmark = [pytest.mark.dist]

# --- the runs -----------------------------------------------------------------------------------
# 4 epochs of EXACT_RESUME (20 windows), checkpoints every 2 steps. fp16: a GradScaler that
# starts too high and grows back every 3 steps: windows overflow (amp_aware aborts them on every
# rank) and their steps are skipped, so the scaler's state, the skipped-step count and the
# overflow counters must all survive a resume.
EXACT = [*EXACT_RESUME, "trainer.max_epochs=4", "trainer.log_every_windows=3",
         "trainer.checkpoint_every_steps=2", "trainer.keep_checkpoints=50", "seed=7"]
PRECISIONS = {"fp32": [], "fp16": ["precision=fp16", "precision.init_scale=4194304.0",
                                   "precision.growth_interval=3", "sync=amp_aware"]}


def exact_reference(precision: str):
    def check_reference(ref: Reference) -> None:
        s = ref.summary
        assert s["windows"] == 4 * STEPS_PER_EPOCH
        assert s["samples_seen"] == 4 * 199  # the sampler's repeats not counted
        assert [r["window"] for r in ref.rows] == list(range(1, 4 * STEPS_PER_EPOCH + 1))
        if precision == "fp16":
            assert s["amp_skipped_steps"] >= 2 and s["amp_aborted_windows"][0] >= 1
    return check_reference


EXACT_RUNS = {p: Run((*EXACT, *extra), STEPS_PER_EPOCH, check_reference=exact_reference(p))
              for p, extra in PRECISIONS.items()}


def steps_of_the_whole_run(steps: int):
    def check_reference(ref: Reference) -> None:
        assert ref.summary["optimizer_steps"] == steps
    return check_reference


# a real job's whole life (tests/test_faults.py starts the same job to fail it)
JOB_LIFE = Run(tuple(LONG_JOB), STEPS_PER_EPOCH,
               check_reference=steps_of_the_whole_run(LONG_JOB_STEPS))
SLURM = Run((*EXACT_RESUME, "trainer.max_epochs=20", "trainer.log_every_windows=1",
             "trainer.checkpoint_every_steps=25", "seed=5"), STEPS_PER_EPOCH,
            check_reference=steps_of_the_whole_run(20 * STEPS_PER_EPOCH))

# DiLoCo with AdamW inside, dropout (each rank its own masks), fp16 with rank 1's scaler backed
# off at window 2 (an inf injected into its loss): checkpoints every 2 windows, averagings every
# 3 (tests/test_local_sgd.py's run: 4 windows an epoch, 3 epochs).
AVERAGING_KEYS = (*SAME, "averagings", "local_skipped_steps", "max_replica_drift")
DILOCO = [*LOCAL_RUN, "optimizer=adamw", "optimizer.lr=0.01", "model.dropout=0.1",
          "precision=fp16", "sync=diloco"]


def rank_1_skipped_window_2(ref: Reference) -> None:
    assert ref.summary["local_skipped_steps"] == [0, 1]


DILOCO_EVERY_3 = Run((*DILOCO, "sync.every=3", "trainer.checkpoint_every_steps=2",
                      "trainer.keep_checkpoints=50"), 4, AVERAGING_KEYS,
                     local_sgd_cases.recorded_run, (1, 2), rank_1_skipped_window_2)
# averagings every 7 windows, 10 epochs: a command-line job killed after the checkpoint of
# window 6 (no inf can be injected there)
DILOCO_EVERY_7 = Run((*DILOCO, "sync.every=7", "trainer.max_epochs=10",
                      "trainer.log_every_windows=1000", "trainer.checkpoint_every_steps=3",
                      "trainer.keep_checkpoints=50", "seed=3"),
                     4, AVERAGING_KEYS)


# --- what each policy's checkpoint holds where the resume starts ------------------------------
def diloco_between_averagings(state: dict, ref: Reference) -> None:
    """Window 4: each rank's own replica and scaler (rank 1's backed off once), the deployable
    mean, the outer Nesterov momentum of the averaging after window 3."""
    ref0, ref1 = ref.ranks
    assert state["policy"]["in_sync"] is False and state["progress"]["windows"] == 4
    own = [flat_params(r["own"]) for r in state["ranks"]]
    assert torch.equal(own[0], ref0["snaps"][3][2]) and torch.equal(own[1], ref1["snaps"][3][2])
    assert torch.allclose(flat_params(state), (own[0] + own[1]) / 2)  # the deployable mean
    assert state["ranks"][1]["own"]["grad_scaler"]["scale"] == \
        state["ranks"][0]["own"]["grad_scaler"]["scale"] / 2
    assert state["policy"]["outer"]["state"]  # Nesterov momentum after the averaging at 3


def diloco_killed_between_averagings(state: dict, ref: Reference) -> None:
    assert state["progress"]["windows"] == 6 and state["policy"]["in_sync"] is False


def layer_killed_between_averagings(state: dict, ref: Reference) -> None:
    windows = state["progress"]["windows"]
    assert windows < WINDOWS and windows % 4, windows  # between two averagings
    own = [r["own"]["model"]["0.weight"] for r in state["ranks"]]
    assert not torch.equal(own[0], own[1])  # each rank's replica is kept


SLOW = [pytest.mark.slow]  # the cases that start a job (the others run on the pool)
CASES = [
    *[pytest.param(Case(f"{p} checkpoint {step}", EXACT_RUNS[p], from_checkpoint(step)))
      # checkpoints inside an epoch, before its partial last window, at an epoch boundary
      for p in PRECISIONS for step in (4, 6, 10)],
    *[pytest.param(Case(f"{p} rows past the checkpoint", EXACT_RUNS[p],
                        rows_past_the_checkpoint(8, 15))) for p in PRECISIONS],
    *[pytest.param(Case(f"{p} rank 0 dir only", EXACT_RUNS[p], rank0_dir_only))
      for p in PRECISIONS],
    pytest.param(Case("diloco checkpoint between averagings", DILOCO_EVERY_3,
                      from_checkpoint(4), diloco_between_averagings)),
    pytest.param(Case("diloco kill -9 between averagings", DILOCO_EVERY_7, kill_9_at(6),
                      diloco_killed_between_averagings), marks=SLOW),
    pytest.param(Case("layer every 4 kill -9 between averagings", EVERY_4_RUN, kill_9_at(3),
                      layer_killed_between_averagings), marks=SLOW),
    pytest.param(Case("SIGTERM, Ctrl-C, kill -9, corrupt checkpoint", JOB_LIFE,
                      sigterm_ctrl_c_then_kill_9_and_a_corrupt_checkpoint), marks=SLOW),
    pytest.param(Case("SLURM SIGUSR1 and requeue", SLURM, slurm_sigusr1_and_requeue),
                 marks=SLOW),
]


@pytest.mark.parametrize("case", CASES, ids=lambda case: case.id.replace(" ", "-"))
def test_a_stopped_run_resumes_bitwise_like_the_uninterrupted_run(case, references, pool2,
                                                                   tmp_path, cli_env):
    check(case, references, pool2, tmp_path, cli_env)


# --- the same bits twice; what a resume refuses; a run that diverges ---------------------------
@pytest.mark.parametrize("precision", list(PRECISIONS))
def test_the_same_config_twice_gives_the_same_bits(references, pool2, tmp_path, precision):
    first = references.get(EXACT_RUNS[precision])
    overrides = [*EXACT, *PRECISIONS[precision]]
    second, r1 = pool2.run(dist_cases.train_run_rows, plain_cfg(overrides), str(tmp_path))
    assert losses(second["rows"]) == losses(first.rows)
    assert {k: second["summary"][k] for k in SAME} == {k: first.summary[k] for k in SAME}
    for name, value in first.params.items():
        assert torch.equal(second["params"][name], value), name
    assert second["deterministic"] and r1["deterministic"]  # trainer.deterministic: on for CPU
    assert not (second["nan_fill"] or r1["nan_fill"])  # without torch's NaN fill (repro.py)
    # a different seed really changes the run (the comparison above has teeth)
    other, _ = pool2.run(dist_cases.train_run_rows, plain_cfg([*overrides, "seed=8"]),
                         str(tmp_path / "other"))
    assert losses(other["rows"]) != losses(first.rows)


def test_a_finished_run_trained_longer_uses_the_lr_of_a_fresh_run_of_that_length(
        references, pool2, tmp_path):
    """docs/reproducibility.md: a finished 2-epoch run (cosine, min ratio 0: its schedule ends
    at LR 0) resumed with trainer.max_epochs doubled re-plans its schedule: every new step's LR
    is, bit for bit, the one the uninterrupted 4-epoch run used at that step, none of them 0."""
    long = references.get(EXACT_RUNS["fp32"])
    short_args = [a for a in EXACT if not a.startswith("trainer.max_epochs=")]
    short, _ = pool2.run(dist_cases.train_run_rows,
                         plain_cfg([*short_args, "trainer.max_epochs=2"]), str(tmp_path / "a"))
    end = checkpoint.step_path(tmp_path / "a" / "checkpoints", 2 * STEPS_PER_EPOCH)
    assert short["summary"]["optimizer_steps"] == 2 * STEPS_PER_EPOCH
    assert checkpoint.load(end)["optimizer"]["param_groups"][0]["lr"] == 0.0  # the trap
    longer, _ = pool2.run(dist_cases.train_run_rows, plain_cfg([*EXACT, f"resume={end}"]),
                          str(tmp_path / "b"))
    new = [(r["step"], r["lr"]) for r in longer["rows"]]
    assert [s for s, _ in new] == list(range(2 * STEPS_PER_EPOCH + 1, 4 * STEPS_PER_EPOCH + 1))
    fresh = {r["step"]: r["lr"] for r in long.rows}
    assert [lr.hex() for _, lr in new] == [fresh[s].hex() for s, _ in new]
    assert all(lr > 0 for _, lr in new) and new[0][1] > new[-1][1]
    assert longer["summary"]["optimizer_steps"] == 4 * STEPS_PER_EPOCH


@pytest.mark.slow
def test_an_incompatible_resume_is_refused_and_the_run_left_untouched(
        references, tmp_path, cli_env):
    run_dir = tmp_path / "run"
    shutil.copytree(references.get(JOB_LIFE).run_dir, run_dir)

    def snapshot() -> dict[str, bytes]:
        return {str(p.relative_to(run_dir)): p.read_bytes() for p in run_dir.rglob("*")
                if p.is_file() and ".hydra" not in p.parts and p.name != "train.log"}

    before = snapshot()
    code, _, err = Job(run_dir, [*LONG_JOB, "resume=auto", "model.hidden_sizes=[32]"],
                       cli_env).finish()
    assert code == 2, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("gradsync: resume refused: "), err
    assert ("was trained with model.hidden_sizes=[16], this run has model.hidden_sizes=[32]"
            in lines[0])
    assert snapshot() == before


def test_a_non_finite_fp32_loss_stops_the_run_naming_the_step(pool2, tmp_path):
    """SGD with a huge learning rate: the loss overflows within a few steps; both ranks stop
    with the same error, and only checkpoints from before it remain."""
    cfg = plain_cfg([*EXACT, "optimizer=sgd", "optimizer.lr=1e4", "optimizer.momentum=0.9",
                     "trainer.log_every_windows=1", "trainer.checkpoint_every_steps=1"])
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
