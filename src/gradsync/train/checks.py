"""What stops a run that went wrong: replicas that should be equal and are not
(trainer.check_replicas), parameters that are no longer finite (before a checkpoint, fp32).
Both are collectives, run by every rank alike."""

from __future__ import annotations

import torch
import torch.distributed as dist

from gradsync.core.devices import on_device
from gradsync.core.memory import local


def require_finite_parameters(model: torch.nn.Module, step: int) -> None:
    """No checkpoint of a diverged model: the step's loss may still have been finite. Collective
    where a process group is up: replicas that train apart (local SGD, DiLoCo, `every` groups)
    differ between averagings, so one rank's parameters may go non-finite alone; every rank's
    verdict goes into one all-reduce (a slot per rank: who diverged), so all ranks stop together
    with the same line instead of the others waiting in the checkpoint's gather. A sharded
    engine's rank checks its shards."""
    finite = torch.stack([torch.isfinite(t).all() for q in model.parameters()
                          if (t := local(q)) is not None]).all()
    world = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
    bad = torch.zeros(world, dtype=torch.int32, device=finite.device)
    bad[dist.get_rank() if world > 1 else 0] = ~finite
    if world > 1:
        dist.all_reduce(bad)
    ranks = [r for r, b in enumerate(bad.tolist()) if b]  # one read of the GPU
    if ranks:
        where = f" on rank {', '.join(map(str, ranks))}" if world > 1 else ""
        raise FloatingPointError(f"non-finite parameters{where} after optimizer step {step} "
                                 "(fp32); stopped, the last good checkpoint stays in "
                                 "checkpoints/")


def check_replicas(model: torch.nn.Module, step: int) -> None:
    """A cheap cross-rank checksum of every parameter (its sum and sum of squares in float64,
    gathered from every rank): replicas that should be equal are bitwise equal, so any
    difference names a parameter that drifted (trainer.check_replicas). Gathered on the
    parameters' device (nccl serves no CPU tensor), read on the host once."""
    named = list(model.named_parameters())
    mine = torch.stack([torch.stack([q.detach().double().sum(), q.detach().double().square().sum()])
                        for _, q in named])
    world = dist.get_world_size()
    every = [torch.empty_like(mine) for _ in range(world)]
    dist.all_gather(every, on_device(mine, named[0][1].device))
    every = list(torch.stack(every).cpu())
    for rank in range(1, world):
        differs = (every[rank] != every[0]).any(dim=1).nonzero()
        if len(differs):
            name = named[int(differs[0])][0]
            raise RuntimeError(f"replicas differ after optimizer step {step}: parameter {name!r} "
                               f"on rank {rank} is not rank 0's (trainer.check_replicas)")
