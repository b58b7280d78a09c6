"""Averaging tensors over ranks outside DDP's gradient all-reduce: the mechanism behind the
policies that synchronise parameters themselves (local SGD, DiLoCo) and, later, per-layer rules.

``average_`` turns each tensor of a list into its mean over ranks with ONE all-reduce of a flat
buffer in a chosen wire dtype, and adds that all-reduce to the run's ``CommCounts`` (the same
counters DDP's counting comm hook fills). ``Anchor`` keeps the fp32 consensus ("global") copy of
a set of tensors and averages each rank's distance from it (the pseudo-gradient
``global - local``), which is what DiLoCo's outer optimizer steps on; an outer step of
``global -= mean pseudo-gradient`` is plain model averaging, done on the small differences so
that a bf16 wire rounds the updates, never the weights themselves.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist

from gradsync.comm import CommCounts


def average_(tensors: list[torch.Tensor], wire_dtype: torch.dtype | None, counts: CommCounts,
             group: dist.ProcessGroup | None = None) -> None:
    """In place: every tensor becomes its mean over the group's ranks. One all-reduce of the
    tensors flattened into one buffer of wire_dtype (None: their own dtype, which must be
    shared), divided by the world size before it as DDP's compress hooks do; every rank ends
    with the same bits. Counted: one call, numel x wire itemsize bytes."""
    if not tensors:
        return
    world = dist.get_world_size(group)
    dtype = wire_dtype or tensors[0].dtype
    flat = torch.cat([t.detach().reshape(-1).to(dtype) for t in tensors])
    flat.div_(world)
    dist.all_reduce(flat, group=group)
    counts.allreduce_calls += 1
    counts.allreduce_bytes += flat.numel() * flat.element_size()
    offset = 0
    for t in tensors:
        n = t.numel()
        t.copy_(flat[offset:offset + n].view_as(t))
        offset += n


def float_state(model: torch.nn.Module) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """What a replica's state is made of: its parameters, and its floating-point buffers
    (running statistics; integer buffers such as BatchNorm's step counter are left alone)."""
    params: list[torch.Tensor] = list(model.parameters())
    buffers = [b for b in model.buffers() if b.is_floating_point()]
    return params, buffers


# An outer update: (global tensors, their mean pseudo-gradients) -> None, in place on global.
OuterStep = Callable[[list[torch.Tensor], list[torch.Tensor]], None]


def plain_average(global_: list[torch.Tensor], pseudo: list[torch.Tensor]) -> None:
    """global - mean(global - local) = mean(local): model averaging."""
    if global_:
        torch._foreach_sub_(global_, pseudo)


class Anchor:
    """The fp32 consensus copy of a replica's parameters and float buffers (the same on every
    rank), and the round that moves it: average the pseudo-gradients, let an outer step move the
    parameters' copy (the buffers' copy is always plainly averaged), copy the result into the
    replica. Also measures how far the replicas had drifted apart."""

    def __init__(self, params: list[torch.Tensor], buffers: list[torch.Tensor]):
        self.params = [p.detach().float().clone() for p in params]
        self.buffers = [b.detach().float().clone() for b in buffers]

    @classmethod
    def of(cls, model: torch.nn.Module) -> Anchor:
        return cls(*float_state(model))

    def sync(self, model: torch.nn.Module, outer: OuterStep, wire_dtype: torch.dtype | None,
             counts: CommCounts) -> float:
        """One averaging round (collective). Returns this rank's drift before it:
        ||theta_r - theta_mean|| / ||theta_mean|| over parameters and float buffers."""
        params, buffers = float_state(model)
        mine = self.params + self.buffers
        local = torch._foreach_sub(mine, [t.detach().float() for t in params + buffers])
        pseudo = [t.clone() for t in local]
        average_(pseudo, wire_dtype, counts)
        # theta_r - theta_mean = (g - local_pseudo_r) - (g - mean_pseudo) = mean - local
        off = torch._foreach_norm(torch._foreach_sub(pseudo, local))
        mean_state = torch._foreach_norm(torch._foreach_sub(mine, pseudo))
        num, den = torch.stack(off).norm(), torch.stack(mean_state).norm()
        drift = float(num / den) if den > 0 else float(num)
        n = len(self.params)
        outer(self.params, pseudo[:n])
        plain_average(self.buffers, pseudo[n:])
        with torch.no_grad():
            for t, g in zip(params + buffers, mine, strict=True):
                t.copy_(g)
        return drift

    def state_dict(self) -> dict[str, list[torch.Tensor]]:
        return {"params": self.params, "buffers": self.buffers}

    @classmethod
    def from_state(cls, state: dict[str, list[torch.Tensor]]) -> Anchor:
        return cls(state["params"], state["buffers"])
