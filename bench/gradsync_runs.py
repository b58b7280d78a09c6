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
from gradsync.config.schema import RunConfig
from gradsync.core import numerics
from gradsync.run.worker import build_parts
from gradsync.train.loop import Progress, train
from gradsync.train.metrics import RunLog


def config(accum: int, sync: str, overrides: list[str]) -> dict:
    """The workload as a gradsync config, composed by Hydra exactly as the command line would."""
    from gradsync.run.main import compose_plain
    from gradsync.run.preflight import preflight

    workload = [
        f"seed={w.SEED}", "data=synthetic", f"data.num_samples={w.SAMPLES}",
        f"data.eval_samples={w.DATA_CFG['eval_samples']}", f"data.in_dim={w.IN_DIM}",
        f"data.out_dim={w.OUT_DIM}", f"data.noise={w.DATA_CFG['noise']}",
        f"schedule.micro_batch_size={w.MICRO}", "model=mlp", f"model.hidden_sizes={w.HIDDEN}",
        "model.activation=relu", "optimizer=sgd", f"optimizer.lr={w.LR}",
        f"optimizer.momentum={w.MOMENTUM}", "lr_scheduler=none",
        f"schedule.window_size={accum}", f"sync={sync}", f"trainer.devices={w.WORLD}",
        "trainer.backend=gloo", "trainer.threads_per_worker=1", "trainer.progress_bar=false",
    ]
    cfg = compose_plain(workload + overrides)
    preflight(cfg)
    return cfg


def run(accum: int, sync: str = "accumulate", overrides: tuple[str, ...] = (),
        count_hook=None) -> dict:
    cfg = config(accum, sync, list(overrides))
    w.init()
    rank = dist.get_rank()
    bits = cfg["trainer"]["bits"]
    if bits == "portable":  # as a worker checks and applies them (run/worker.py)
        assert not numerics.pins_missing(), numerics.pins_missing()
    numerics.apply(bits, "cpu")
    p = build_parts(RunConfig.from_plain(cfg), rank, w.WORLD, torch.device("cpu"))
    p.evaluate = dict
    with tempfile.TemporaryDirectory() as tmp:
        log = RunLog(Path(tmp), active=rank == 0)
        if p.engine.trace:  # written as run_training writes it (engine.trace_sync)
            p.engine.trace.open(Path(tmp) / "trace" / f"rank{rank}.jsonl")
        state = Progress()
        p.trainer.max_steps = w.WARMUP_MICRO // accum  # warm-up: the start of epoch 0
        train(p, state, log)
        state.epoch, state.epoch_windows, state.epoch_micro = 1, 0, 0  # then all of epoch 1, timed
        p.trainer.max_steps, p.trainer.max_epochs = -1, 2
        c = p.counts
        calls, nbytes, steps = c.allreduce_calls, c.allreduce_bytes, state.step
        sharded = c.reduce_scatter_bytes + c.all_gather_bytes  # fsdp: what else went out
        w.start_clock()
        train(p, state, log)
        samples_per_s = w.stop_clock()
        log.close()
        if p.engine.trace:
            p.engine.trace.close()
        losses = []
        if rank == 0:
            rows = [json.loads(x) for x in (Path(tmp) / "metrics.jsonl").read_text().splitlines()]
            losses = [r["loss"] for r in rows if r["epoch"] == 1]
    timed_steps = state.step - steps
    return w.result(samples_per_s, sum(losses), len(losses),
                    allreduce_calls=(c.allreduce_calls - calls) / timed_steps,
                    allreduce_bytes=(c.allreduce_bytes - nbytes) / timed_steps,
                    sharded_bytes=(c.reduce_scatter_bytes + c.all_gather_bytes - sharded)
                    / timed_steps,
                    grad_held_bytes=p.engine.memory.grads.held_bytes)
