"""gradsync's own loop on the benchmark workload: the worker's real build_parts and loop.train
(sync policy, counting comm hook, per-sample normalisation, rank-0 metrics.jsonl and
TensorBoard logging every 10 steps), with no held-out evaluation (no other variant has one)."""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

import torch
import torch.distributed as dist

import workload as w
from gradsync.loop import Progress, train
from gradsync.metrics import RunLog
from gradsync.worker import build_parts


def config(accum: int, sync: str, trainer: dict | None = None) -> dict:
    return {
        "seed": w.SEED,
        "model": {"name": "mlp", "hidden_sizes": w.HIDDEN, "activation": "relu"},
        "optimizer": {"_target_": "torch.optim.SGD", "_partial_": True, "lr": w.LR,
                      "momentum": w.MOMENTUM, "weight_decay": 0.0, "nesterov": False},
        "schedule": {"name": "constant", "accum_steps": accum},
        "sync": {"name": sync},
        "precision": {"name": "fp32", "init_scale": 65536.0, "growth_interval": 2000},
        "data": dict(w.DATA_CFG),
        "trainer": {"devices": w.WORLD, "max_steps": -1, "max_epochs": 2, "log_every": 10,
                    "eval_every": 0, "backend": "gloo", "threads_per_worker": 1,
                    "progress_bar": False, "clip_grad_norm": 0.0,
                    "gradient_as_bucket_view": True, "bucket_cap_mb": 25.0, "timeout_s": 120,
                    **(trainer or {})},
        "lr_scheduler": {"name": "none"},
    }


def run(accum: int, sync: str = "accumulate", trainer: dict | None = None,
        count_hook=None) -> dict:
    w.init()
    rank = dist.get_rank()
    p = build_parts(config(accum, sync, trainer), rank, w.WORLD, torch.device("cpu"))
    p.evaluate = dict
    with tempfile.TemporaryDirectory() as tmp:
        log = RunLog(Path(tmp), active=rank == 0)
        state = Progress()
        p.max_steps = w.WARMUP_MICRO // accum  # warm-up: the start of epoch 0
        train(p, state, log)
        state.epoch, p.max_steps = 1, -1  # then all of epoch 1, timed
        calls, nbytes, steps = p.counts.allreduce_calls, p.counts.allreduce_bytes, state.step
        w.start_clock()
        train(p, state, log)
        samples_per_s = w.stop_clock()
        log.close()
        losses = []
        if rank == 0:
            rows = [json.loads(x) for x in (Path(tmp) / "metrics.jsonl").read_text().splitlines()]
            losses = [r["loss"] for r in rows if r["epoch"] == 1]
    timed_steps = state.step - steps
    return w.result(samples_per_s, sum(losses), len(losses),
                    allreduce_calls=(p.counts.allreduce_calls - calls) / timed_steps,
                    allreduce_bytes=(p.counts.allreduce_bytes - nbytes) / timed_steps)
