"""PowerSGD as the all-reduce of accumulate/amp_aware (sync.compression=powersgd): far fewer
bytes, a model close to exact training, and fp16 windows it cannot step do not poison its
error feedback."""

from __future__ import annotations

import math

import pytest

from configs import plain_cfg
from dist_cases import train_run_rows
from gradsync.config.validate import ConfigError
from gradsync.run.main import compose_plain
from gradsync.run.preflight import preflight

pytestmark = [pytest.mark.dist]

# 32 -> 64 -> 64 -> 8: matrices PowerSGD compresses at rank 4 (biases go uncompressed)
BASE = ["data=synthetic", "data.num_samples=512", "data.in_dim=32", "data.out_dim=8",
        "schedule.micro_batch_size=16", "model.hidden_sizes=[64,64]", "model.activation=tanh",
        "optimizer.lr=0.05", "schedule.window_size=2", "trainer.max_epochs=4",
        "trainer.threads_per_worker=1", "trainer.progress_bar=false", "trainer.log_every_windows=1",
        "trainer.checkpoint_every_steps=0"]
RANK = 4
PSGD = ["sync.compression=powersgd", f"sync.powersgd_rank={RANK}",
        "sync.powersgd_start_backwards=2"]
STEPS = 4 * 512 // (2 * 16 * 2)


def test_powersgd_sends_a_fraction_of_the_bytes_and_trains_close_to_exact(pool2, tmp_path):
    exact, _ = pool2.run(train_run_rows, plain_cfg(BASE), str(tmp_path / "exact"))
    psgd, _ = pool2.run(train_run_rows, plain_cfg([*BASE, *PSGD]), str(tmp_path / "psgd"))
    e, p = exact["summary"], psgd["summary"]
    assert e["optimizer_steps"] == p["optimizer_steps"] == STEPS
    assert e["sync_backwards"] == p["sync_backwards"] == [STEPS, STEPS]
    assert p["allreduce"] == "process_group"  # its own all-reduces, never shared memory
    # 2 exact backwards, then factors: 32x64, 64x64 at rank 4 are (96 + 128) x 4 numbers instead
    # of 2048 + 4096; 64x8 (512 < 2 x 72 x 4: not worth it) and the 136 biases go as they are
    grads = 32 * 64 + 64 + 64 * 64 + 64 + 64 * 8 + 8
    compressed = (32 + 64) * RANK + (64 + 64) * RANK + 64 * 8 + 64 + 64 + 8
    assert p["allreduce_bytes"] == [4 * (2 * grads + (STEPS - 2) * compressed)] * 2
    assert e["allreduce_bytes"] == [4 * STEPS * grads] * 2
    first = exact["rows"][0]["loss"]
    assert e["final_train_loss"] < 0.5 * first  # it learned
    assert p["final_train_loss"] != e["final_train_loss"]  # approximate...
    assert abs(p["final_train_loss"] - e["final_train_loss"]) < 0.05 * e["final_train_loss"]


def test_skipped_fp16_steps_do_not_poison_the_error_feedback(pool2, tmp_path):
    """A scale of 2^30 overflows the first windows after compression has started. Without
    overflow consensus they reach PowerSGD, whose error feedback then holds inf/nan: unless it
    is dropped with the skipped step, every later window overflows too (seen: 32 of 32)."""
    fp16 = ["precision=fp16", "precision.init_scale=1073741824", "sync=amp_aware",
            "sync.comm_dtype=fp32", "sync.overflow_consensus=false"]
    runs = {}
    for name, extra in (("psgd", PSGD), ("exact", [])):
        runs[name], _ = pool2.run(train_run_rows, plain_cfg([*BASE, *fp16, *extra]),
                                  str(tmp_path / name))
    psgd, exact = runs["psgd"]["summary"], runs["exact"]["summary"]
    assert psgd["amp_skipped_steps"] >= 5  # 2^30 backs off to fp16's range one halving a window
    # the same windows step as in exact training: none poisoned by an overflowed one
    stepped = [[r["stepped"] for r in runs[k]["rows"]] for k in ("psgd", "exact")]
    assert stepped[0] == stepped[1] and sum(stepped[0]) == psgd["optimizer_steps"] > STEPS // 2
    assert math.isfinite(psgd["final_train_loss"])
    assert abs(psgd["final_train_loss"] - exact["final_train_loss"]) < (
        0.05 * exact["final_train_loss"])


def test_powersgd_options_are_checked_before_any_worker_starts():
    with pytest.raises(ConfigError, match="sync.compression='topk' is not allowed"):
        preflight(compose_plain(["sync.compression=topk"]))
    with pytest.raises(ConfigError, match="sync.powersgd_start_backwards=1 is not allowed"):
        preflight(compose_plain([*PSGD, "sync.powersgd_start_backwards=1"]))
    with pytest.raises(ConfigError, match="set sync.comm_dtype=fp32"):
        preflight(compose_plain(["sync=amp_aware", "sync.compression=powersgd"]))
    with pytest.raises(ConfigError, match="powersgd all-reduces through the process group"):
        preflight(compose_plain([*PSGD, "engine.allreduce=shared_memory"]))
    with pytest.raises(Exception, match="Could not override 'sync.compression'"):
        compose_plain(["sync=always", "sync.compression=powersgd"])  # always has none to choose
