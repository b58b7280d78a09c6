"""The test-only plan of one rank's epoch: every window the loop would cut, in order."""

from __future__ import annotations

from gradsync.train.windows import Shard, Window, cut_window, micro_batches


def plan_epoch(shard: Shard, micro_batch_size: int, window_size: int) -> list[Window]:
    """One rank's epoch cut into windows of window_size micro-batches (cut_window's)."""
    windows: list[Window] = []
    start = 0
    while start < micro_batches(shard, micro_batch_size):
        windows.append(cut_window(shard, micro_batch_size, start, window_size))
        start = windows[-1].stop
    return windows
