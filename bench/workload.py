"""The one workload every benchmark variant runs, so differences are the variants' own:
deterministic synthetic regression (8192 x 512 -> 512; bench/run.py --samples changes the 8192),
an MLP 512-1024-1024-1024-512 (3.2 M parameters), MSE, SGD(lr 0.01, momentum 0.9), 32 samples
per rank per micro-batch, 2 processes on gloo with one intra-op thread each, a seeded
DistributedSampler, loss / N.

Protocol (every variant): a warm-up of WARMUP_MICRO micro-batches of epoch 0 (not timed), then
epoch 1 in full, timed between two barriers: 128 micro-batches per rank, 128 / N optimizer steps.
"""

from __future__ import annotations

import os
import resource
import time
from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from gradsync.data.synthetic import synthetic
from gradsync.models import MLP

SEED = 0
WORLD = 2
MICRO = 32
# bench/run.py --samples sets it for its ranks (a smaller epoch for tests/test_bench.py)
SAMPLES = int(os.environ.get("GRADSYNC_BENCH_SAMPLES", "8192"))
IN_DIM, OUT_DIM, HIDDEN = 512, 512, [1024, 1024, 1024]
LR, MOMENTUM = 0.01, 0.9
WARMUP_MICRO = 16
DATA_CFG = {"num_samples": SAMPLES, "eval_samples": 64, "in_dim": IN_DIM, "out_dim": OUT_DIM,
            "noise": 0.05}


def dataset() -> TensorDataset:
    return synthetic(SEED, **DATA_CFG).train


def model() -> torch.nn.Module:
    torch.manual_seed(SEED)
    return MLP(IN_DIM, OUT_DIM, HIDDEN, "relu")


def optimizer(params) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=LR, momentum=MOMENTUM)


def loader(ds: TensorDataset) -> tuple[DataLoader, DistributedSampler]:
    sampler: DistributedSampler = DistributedSampler(ds, shuffle=True, seed=SEED)
    return DataLoader(ds, batch_size=MICRO, sampler=sampler), sampler


def loss_fn(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.mse_loss(out, y)


def init() -> None:
    """Join the group from the harness's env:// variables; one intra-op thread per process."""
    torch.set_num_threads(1)
    if not dist.is_initialized():
        dist.init_process_group("gloo")


def result(samples_per_s: float, loss_sum: float, loss_count: int, **extra) -> dict:
    """What every variant reports: global samples/s of the timed epoch, the mean micro-batch
    loss over the timed epoch and all ranks, and this process's peak RSS."""
    t = torch.tensor([loss_sum, float(loss_count)], dtype=torch.float64)
    dist.all_reduce(t)
    return {"samples_per_s": samples_per_s, "epoch_loss": (t[0] / t[1]).item(),
            "cpu_ms_per_micro": _clock.get("cpu_ms_per_micro", float("nan")),
            "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0,
            "pid": os.getpid(), **extra}


def timed_epoch(epoch: Callable[[int, int], tuple[float, int]], micro_batches: int) -> dict:
    """The protocol for loops written out in full: epoch(e, limit) runs the first `limit`
    micro-batches of epoch e and returns their (loss sum, count); the warm-up is untimed."""
    epoch(0, WARMUP_MICRO)
    start_clock()
    loss_sum, count = epoch(1, micro_batches)
    return result(stop_clock(), loss_sum, count)


_clock: dict[str, float] = {}
on_clock_start: list = []  # the accounting runs reset their counters here


def _cpu_s() -> float:
    """This process's CPU seconds, every thread (gloo's included): what the rank computed,
    not what it waited, so a loaded machine moves it far less than samples/s."""
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def start_clock() -> None:
    dist.barrier()
    for fn in on_clock_start:
        fn()
    _clock["cpu0"] = _cpu_s()
    _clock["t0"] = time.perf_counter()


def stop_clock() -> float:
    """Global samples/s of the timed epoch (one epoch over all ranks); also records this rank's
    CPU milliseconds per micro-batch of it (result's cpu_ms_per_micro)."""
    _clock["cpu_ms_per_micro"] = (_cpu_s() - _clock["cpu0"]) * 1e3 / (SAMPLES / WORLD / MICRO)
    dist.barrier()
    return SAMPLES / (time.perf_counter() - _clock["t0"])
