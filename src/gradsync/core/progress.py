"""Overall progress of long work made of units (a sweep's jobs, make bench's runs): "k of N"
and an ETA, the mean time of the units done so far times the units left."""

from __future__ import annotations


def duration(seconds: float) -> str:
    """45 s, 3 min 05 s, 1 h 02 min."""
    s = max(0, round(seconds))
    if s < 60:
        return f"{s} s"
    if s < 3600:
        return f"{s // 60} min {s % 60:02d} s"
    return f"{s // 3600} h {s % 3600 // 60:02d} min"


def eta(total: int, done: int, elapsed: float) -> str:
    """When the units left should be done: the mean time of the `done` ones (elapsed in all)
    times the units left."""
    return duration(elapsed / done * max(0, total - done)) if done else "?"


def progress(k: int, total: int | None, done: int, elapsed: float) -> str:
    """'k of N (d done in T, ETA E)' for unit k (1-based) of `total` (None: unknown), when
    `done` units took `elapsed` seconds; no ETA before the first unit is done."""
    line = f"{k} of {total}" if total else f"{k}"
    if done and total:
        return f"{line} ({done} done in {duration(elapsed)}, ETA {eta(total, done, elapsed)})"
    if done:
        return f"{line} ({done} done in {duration(elapsed)})"
    return line
