"""Functions the DDP tests run on every rank of the pool (see dist_pool.py). They use the
project's real pieces on a real gloo process group and return plain tensors/numbers."""

from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from gradsync import checkpoint
from gradsync.comm import install_counting_hook
from gradsync.data import loss_sum
from gradsync.loop import run_window
from gradsync.models import MLP
from gradsync.policies import build_policy
from gradsync.precision import Precision
from gradsync.schedules import Window
from gradsync.worker import run_training


def window_data(seed: int, world: int, micro_sizes: list[int], in_dim: int = 6, out_dim: int = 3):
    """Every rank's micro-batches of one window, [rank][micro] -> (x, y), the same everywhere."""
    g = torch.Generator().manual_seed(seed)
    return [[(torch.randn(m, in_dim, generator=g), torch.randn(m, out_dim, generator=g))
             for m in micro_sizes] for _ in range(world)]


def tiny_model(seed: int = 0):
    torch.manual_seed(seed)
    return MLP(6, [5], 3, "tanh")


def grads_per_micro_step(policy_name: str, micro_sizes: list[int]) -> dict:
    """Runs the loop's real run_window on one window and snapshots this rank's flattened
    gradient after every micro-step (the iterator is asked for micro-batch i+1 only after
    micro-step i finished)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    ddp = DistributedDataParallel(tiny_model(), gradient_as_bucket_view=True)
    counts = install_counting_hook(ddp)
    mine = window_data(0, world, micro_sizes)[rank]
    snaps: list[torch.Tensor] = []

    def flat_grad():
        return torch.cat([p.grad.detach().flatten().clone() for p in ddp.parameters()])

    def batches():
        for i, b in enumerate(mine):
            if i:
                snaps.append(flat_grad())
            yield b

    it = batches()
    window = Window(0, len(micro_sizes), sum(micro_sizes))

    run_window(ddp, it, window, build_policy({"name": policy_name}), Precision("fp32", "cpu"),
               lambda out, y: loss_sum("regression", out, y), torch.device("cpu"))
    snaps.append(flat_grad())
    return {"grads": snaps, "sync_backwards": counts.sync_backwards,
            "allreduce_calls": counts.allreduce_calls, "allreduce_bytes": counts.allreduce_bytes}


def train_run(cfg: dict, run_dir: str) -> dict:
    """The worker's real training function on the pool's process group."""
    summary = run_training(cfg, Path(run_dir))
    params = None
    if dist.get_rank() == 0:
        params = checkpoint.load(Path(run_dir) / "checkpoints" / "last.pt")["model"]
    return {"summary": summary, "params": params}
