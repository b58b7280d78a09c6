"""The shared-memory all-reduce (engine.allreduce): gloo's result bit for bit, in several
buckets and over several backwards, low-precision wires, the fall-back across hosts, a buffer
without a name (nothing in /dev/shm, whatever is killed), and whole runs that match the
process-group transport bit for bit."""

from __future__ import annotations

import pytest
import torch

import shm_cases
from configs import losses, plain_cfg
from dist_cases import train_run_rows
from gradsync.config.validate import ConfigError
from gradsync.run.main import compose_plain
from gradsync.run.placement import Placement
from gradsync.run.preflight import preflight

pytestmark = [pytest.mark.dist]


@pytest.mark.parametrize("wire", [None, "bf16", "fp16"])
def test_shared_memory_gives_the_process_groups_mean_bit_for_bit(pool2, wire):
    via_pg = pool2.run(shm_cases.synced_grads, "pg", wire)
    via_shm = pool2.run(shm_cases.synced_grads, "shm", wire)
    assert via_shm[0]["hook"] == "shm_hook" and via_pg[0]["hook"] != "shm_hook"
    for pg, shm in zip(via_pg, via_shm, strict=True):
        assert len(shm["synced"]) == 3
        for a, b in zip(pg["synced"], shm["synced"], strict=True):
            assert torch.equal(a, b)  # every window, every bucket, bitwise
        assert shm["calls"] == pg["calls"] > 3  # several buckets per backward
        assert shm["bytes"] == pg["bytes"]
        assert shm["new_files"] == set()  # the name is gone once every rank mapped it
    # and it is the mean of the ranks' own gradients (up to the wire's rounding)
    eps = {None: 1e-6, "bf16": 2**-8, "fp16": 2**-11}[wire]  # the wire's relative rounding
    for w in range(3):
        a, b = via_shm[0]["local"][w], via_shm[1]["local"][w]
        assert torch.equal(via_shm[0]["synced"][w], via_shm[1]["synced"][w])
        # each rank's share is rounded on the wire: the error scales with the larger share
        err = (via_shm[0]["synced"][w] - (a + b) / 2).abs()
        assert bool((err <= 2 * eps * torch.maximum(a.abs(), b.abs()) + 1e-6).all())
        assert not torch.allclose(a, (a + b) / 2, atol=1e-3)


def test_ranks_on_different_hosts_fall_back_or_refuse(pool2):
    assert pool2.run(shm_cases.refused_across_hosts, "auto") == ["unchanged", "unchanged"]
    errors = pool2.run(shm_cases.refused_across_hosts, "shared_memory")
    assert all(e.startswith("error: engine.allreduce=shared_memory needs every rank on one "
                            "host") for e in errors)
    assert pool2.run(shm_cases.shm_files) == [[], []]


def test_the_shared_buffer_has_no_name_a_kill_could_leave_behind(pool2):
    """Every rank maps a memfd (a buffer without a name: /proc/self/maps says
    "/memfd:gradsync-slots (deleted)"), no descriptor of it stays open once mapped, and
    nothing appears in /dev/shm: the kernel frees it with the last process that maps it, so no
    kill of any process at any moment leaves anything behind."""
    for rank in pool2.run(shm_cases.map_and_look):
        assert rank["mapping"] == "/memfd:gradsync-slots (deleted)"
        assert rank["open_memfds"] == [] and rank["new_files"] == set()
        assert rank["seen"] == 42  # one buffer: rank 0's write is every rank's


def test_a_run_through_shared_memory_equals_one_through_gloo(pool2, tmp_path):
    base = ["data=synthetic", "data.num_samples=256", "schedule.micro_batch_size=16",
            "model.hidden_sizes=[32,32]", "schedule.window_size=2", "trainer.max_epochs=2",
            "trainer.threads_per_worker=1", "trainer.progress_bar=false",
            "trainer.log_every_windows=1"]
    runs = {}
    for mode in ("shared_memory", "process_group"):
        cfg = plain_cfg([*base, f"engine.allreduce={mode}"])
        runs[mode], _ = pool2.run(train_run_rows, cfg, str(tmp_path / mode))
    shm, pg = runs["shared_memory"], runs["process_group"]
    assert len(shm["rows"]) == 2 * 256 // (2 * 16 * 2)
    assert losses(shm["rows"]) == losses(pg["rows"])
    for k, v in pg["params"].items():
        assert torch.equal(shm["params"][k], v), k
    assert (shm["summary"]["allreduce"], pg["summary"]["allreduce"]) == ("shared_memory",
                                                                         "process_group")
    for key in ("allreduce_calls", "allreduce_bytes", "sync_backwards"):
        assert shm["summary"][key] == pg["summary"][key]


def test_allreduce_mode_is_checked_before_any_worker_starts():
    with pytest.raises(ConfigError, match="engine.allreduce='tcp' is not allowed"):
        preflight(compose_plain(["engine.allreduce=tcp"]))
    with pytest.raises(ConfigError, match="shared_memory is for CPU ranks"):
        preflight(compose_plain(["engine.allreduce=shared_memory", "trainer.backend=nccl"]),
                  Placement("nccl", 2))
    preflight(compose_plain(["engine.allreduce=shared_memory"]))


@pytest.mark.slow  # a pool of three ranks of its own: three interpreters start
def test_three_ranks_sum_every_slot_and_stay_bitwise_replicas():
    """More than two slots: every rank sums all three in rank order (gloo's ring sums in
    another order, so the check is against the mean, and replicas are bitwise equal)."""
    from dist_pool import DistPool

    pool = DistPool(3)
    try:
        ranks = pool.run(shm_cases.synced_grads, "shm", None)
    finally:
        pool.close()
    assert ranks[0]["hook"] == "shm_hook"
    for w in range(3):
        local = [r["local"][w] for r in ranks]
        assert torch.equal(ranks[0]["synced"][w], ranks[1]["synced"][w])
        assert torch.equal(ranks[0]["synced"][w], ranks[2]["synced"][w])
        torch.testing.assert_close(ranks[0]["synced"][w], sum(local) / 3, rtol=1e-5, atol=1e-5)
        assert not torch.allclose(local[0], sum(local) / 3, atol=1e-3)
