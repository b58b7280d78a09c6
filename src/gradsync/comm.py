"""Communication accounting: a DDP comm hook that counts what really crosses the wire.

Hooks only fire on a synchronising backward, once per bucket; ``bucket.is_last()`` marks the
end of one synchronising backward. Policies that want another all-reduce (low precision, say)
pass it as the inner hook and keep these counts.
"""

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

# No `from __future__ import annotations` here: DDP checks the hook's annotations at runtime.
Hook = Callable[[Any, dist.GradBucket], torch.futures.Future]


@dataclass
class CommCounts:
    allreduce_calls: int = 0
    allreduce_bytes: int = 0
    sync_backwards: int = 0


@dataclass
class CountingState:
    counts: CommCounts
    inner_hook: Hook = default_hooks.allreduce_hook
    inner_state: Any = None  # allreduce_hook's state: the process group (None: default)
    wire_dtype: torch.dtype | None = None  # dtype the inner hook sends; None: the bucket's


def counting_hook(
    state: CountingState, bucket: dist.GradBucket
) -> torch.futures.Future[torch.Tensor]:
    buf = bucket.buffer()
    itemsize = (state.wire_dtype or buf.dtype).itemsize
    state.counts.allreduce_calls += 1
    state.counts.allreduce_bytes += buf.numel() * itemsize
    if bucket.is_last():
        state.counts.sync_backwards += 1
    return state.inner_hook(state.inner_state, bucket)


def install_counting_hook(ddp, inner_hook: Hook | None = None, inner_state: Any = None,
                          wire_dtype: torch.dtype | None = None) -> CommCounts:
    counts = CommCounts()
    state = CountingState(counts, inner_hook or default_hooks.allreduce_hook, inner_state,
                          wire_dtype)
    ddp.register_comm_hook(state, counting_hook)
    return counts
