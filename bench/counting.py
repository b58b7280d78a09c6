"""A counting comm hook for the variants that do not count their own traffic (hand-written,
Lightning, Accelerate): used only in separate untimed accounting runs, and reset when the timed
epoch starts so the numbers cover the same steps as gradsync's own counts."""

from __future__ import annotations

import workload as w
from gradsync.sync.comm import CommCounts, install_counting_hook

_counts = CommCounts()


def install(ddp) -> None:
    global _counts
    _counts = install_counting_hook(ddp)
    w.on_clock_start.append(_reset)


def _reset() -> None:
    _counts.allreduce_calls = _counts.allreduce_bytes = _counts.sync_backwards = 0


def per_step(accum: int) -> dict:
    steps = w.SAMPLES // (w.WORLD * w.MICRO) // accum  # the timed epoch
    assert _counts.sync_backwards > 0, "the variant never synchronised through the hook"
    return {"allreduce_calls": _counts.allreduce_calls / steps,
            "allreduce_bytes": _counts.allreduce_bytes / steps}
