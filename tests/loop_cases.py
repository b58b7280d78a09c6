"""Functions tests/test_loop.py runs on every rank of the pool (dist_pool.py): the worker's real
run_training with torch.distributed's collectives wrapped, each call named by the code that
made it (what train/loop.py's docstring calls it)."""

from __future__ import annotations

import re
import sys

import torch.distributed as dist

import dist_cases
from gradsync.train import loop

COLLECTIVES = ("all_reduce", "all_gather", "broadcast", "barrier", "all_gather_object",
               "broadcast_object_list", "reduce_scatter_tensor", "all_gather_into_tensor",
               "all_to_all", "scatter", "gather", "reduce")
# the innermost frame that names a collective (its code's qualified name) -> the name
NAMES = {
    "ByTokens.micro_loss": "token_count",
    "OverflowConsensus.window_doomed": "doomed_window",
    "run_window": "doomed_window",
    "optimizer_step": "overflow_agreement",
    "AdaptiveSchedule.after_step": "schedule",
    "average": "averaging",
    "StepLog.flush": "loss",
    "check_replicas": "replica_check",
    "evaluate": "evaluation",
    "StopAgreement.poll": "stop",
    "save_checkpoint": "checkpoint",
}
# collectives outside a step's list: the gradients' own all-reduce (the engine's comm hook), the
# run's set-up and end (before the first window, after the last)
OUTSIDE = {"counting_hook": "gradients", "run_training": "setup", "build_parts": "setup",
           "StopAgreement.close": "end"}


def documented() -> list[str]:
    """The order train/loop.py's docstring gives, as its ``names``."""
    doc = loop.__doc__ or ""
    return re.findall(r"``([a-z_]+)``", doc.split("in order (tests/test_loop.py holds it):")[1])


def _name(frame) -> str:
    # the checkpoint's own flush of the rows and buffer alignment are part of it
    f, names = frame, []
    while f is not None:
        names.append(f.f_code.co_qualname)
        f = f.f_back
    if "save_checkpoint" in names:
        return "checkpoint"
    if "finish" in names and "evaluate" not in names:  # the last rows, the stop's end
        return "end"
    for q in names:
        if q in NAMES:
            return NAMES[q]
        if q in OUTSIDE:
            return OUTSIDE[q]
    return "unnamed: " + " < ".join(names[:6])


def recorded_collectives(cfg: dict, run_dir: str) -> list[str]:
    """The names of every collective a run made, in order, with "window" where each window's
    micro-batches start."""
    seen: list[str] = []
    saved = {n: getattr(dist, n) for n in COLLECTIVES}
    run_window = loop.run_window

    def wrap(name):
        fn = saved[name]

        def call(*args, **kwargs):
            seen.append(_name(sys._getframe(1)))
            return fn(*args, **kwargs)
        return call

    def window(*args, **kwargs):
        seen.append("window")
        return run_window(*args, **kwargs)

    for n in COLLECTIVES:
        setattr(dist, n, wrap(n))
    loop.run_window = window
    try:
        dist_cases.train_run(cfg, run_dir)
    finally:
        for n, fn in saved.items():
            setattr(dist, n, fn)
        loop.run_window = run_window
    return seen
