"""train/memory.py's byte counts: storages counted once each (views into one buffer, as DDP's
gradients are into its buckets) and the gradient maxima an engine records. (Whole runs' memory
entries: tests/test_fsdp.py, tests/test_bench.py.)"""

from __future__ import annotations

import torch

from gradsync.core.memory import MemoryMeter, storage_bytes


def test_storages_count_once_each_and_views_add_nothing():
    bucket = torch.zeros(10)  # 40 bytes, like a DDP bucket its gradients are views into
    views = [bucket[:4], bucket[4:].view(2, 3)]
    assert storage_bytes(views) == 40
    assert storage_bytes([*views, bucket, None]) == 40
    other = torch.zeros(3, dtype=torch.float64)
    assert storage_bytes([*views, other]) == 40 + 24
    freed = torch.zeros(5)
    freed.untyped_storage().resize_(0)  # as FSDP frees an unsharded parameter
    assert storage_bytes([freed, other]) == 24


def test_the_meter_keeps_each_maximum_over_the_run():
    meter = MemoryMeter(torch.device("cpu"))
    for unsharded, sharded in [(100, 0), (40, 30), (0, 70), (10, 5)]:
        meter.record(unsharded, sharded)
    g = meter.grads
    assert (g.unsharded_bytes, g.sharded_bytes, g.held_bytes) == (100, 70, 100)
    meter.record(90, 20)
    assert meter.grads.held_bytes == 110
    summary = meter.summary()
    assert (summary["grad_unsharded_bytes"], summary["grad_sharded_bytes"],
            summary["grad_held_bytes"]) == (100, 70, 110)
