"""Functions the per-layer sync tests run on every rank of the pool (dist_pool.py): the worker's
real run_training on the pool's gloo group, with this rank's parameters recorded after every
window (after the policy's after_window: an averaging, if one was due) and after finish()."""

from __future__ import annotations

from pathlib import Path

import torch
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

import dist_cases
from gradsync.sync.averaging import Averager
from gradsync.train import checkpoint, loop


def recorded_run(cfg: dict, run_dir: str, inf_rank: int = -1, inf_window: int = -1,
                 inf_param: str = "") -> dict:
    """run_training; snaps: [(windows_done or "finish", {name: this rank's parameter})]. Rank 0
    also returns metrics.jsonl's rows and the last checkpoint's model. On inf_rank the gradient
    of inf_param becomes inf during window inf_window (from 1): an fp16 overflow in one
    parameter on one rank only."""
    snaps: list[tuple] = []

    def recording(p):
        averager = p.policy.averager  # sync.groups with `every`: the LayerSync
        if torch.distributed.get_rank() == inf_rank:
            param = dict(p.engine.module.named_parameters())[inf_param]
            param.register_hook(lambda g: g * float("inf") if len(snaps) + 1 == inf_window
                                else g)

        def params() -> dict[str, torch.Tensor]:
            return {n: q.detach().clone() for n, q in p.engine.module.named_parameters()}

        if averager is None:  # nothing averaged: the loop's stand-in averager records
            class Recording(Averager):
                def after_window(self, model, windows_done):
                    snaps.append((windows_done, params()))

                def finish(self, model):  # the run's end: nothing left to average
                    snaps.append(("finish", params()))

            loop.Averager = Recording  # what train() averages with when the policy has none
            return p
        after_window, finish = averager.after_window, averager.finish

        def after(model, windows_done):
            after_window(model, windows_done)
            snaps.append((windows_done, params()))

        def done(model):
            finish(model)
            snaps.append(("finish", params()))

        averager.after_window, averager.finish = after, done  # type: ignore[method-assign]
        return p

    try:
        summary, rows = dist_cases.run_training_with(recording, cfg, run_dir)
    finally:
        loop.Averager = Averager
    out: dict = {"summary": summary, "snaps": snaps}
    if torch.distributed.get_rank() == 0:
        out["rows"] = rows
        out["params"] = checkpoint.load(Path(run_dir) / "checkpoints" / "last.pt")["model"]
        acc = EventAccumulator(str(Path(run_dir) / "tb"))
        acc.Reload()
        out["tb"] = {tag: [(e.step, e.value) for e in acc.Scalars(tag)]
                     for tag in acc.Tags()["scalars"] if tag.startswith("comm/")}
    return out
