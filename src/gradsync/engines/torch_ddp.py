"""trainer.engine=torch_ddp: torch's ``DistributedDataParallel``.

DDP's C++ reducer puts the gradients in buckets (reverse parameter order, the first bucket
small, then up to ``trainer.bucket_cap_mb``; rebuilt in the order gradients became ready after
the first synchronising backward) and all-reduces each bucket as soon as it is full, overlapping
the rest of the backward. ``no_sync()`` around a micro-batch's forward and backward keeps its
gradients local. The policy chooses the bucket's all-reduce (its ``comm_hook``), which runs
inside gradsync's counting hook; on CPU ranks of one host it goes through shared memory
(``trainer.allreduce``, sync/shm_allreduce.py) instead of gloo's loopback TCP.
"""

from __future__ import annotations

import inspect
from collections.abc import Iterator
from contextlib import AbstractContextManager, nullcontext
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from gradsync.sync.averaging import float_state
from gradsync.sync.comm import CommCounts, GradientProbe, install_counting_hook
from gradsync.sync.policy import SyncPolicy
from gradsync.sync.shm_allreduce import over_shared_memory, shm_hook

# torch 2.13 renamed DDP's broadcast_buffers to forward_sync_buffers; broadcast_buffers=False
# also left the buffers out of the initial broadcast, forward_sync_buffers=False does not.
_FORWARD_SYNC_BUFFERS = "forward_sync_buffers" in inspect.signature(
    DistributedDataParallel.__init__).parameters


def buffer_sync(forward: bool) -> dict[str, Any]:
    """DDP's keyword for whether the forward broadcasts rank 0's buffers, on any torch."""
    return {"forward_sync_buffers" if _FORWARD_SYNC_BUFFERS else "broadcast_buffers": forward}


class TorchDDP:
    """The engine around an already built ``DistributedDataParallel``."""

    name = "torch_ddp"

    def __init__(self, ddp: DistributedDataParallel, counts: CommCounts | None = None,
                 transport: str = "process_group", grads_to_none: bool | None = None):
        self.ddp = ddp
        self.module: nn.Module = ddp.module
        self.counts = counts if counts is not None else CommCounts()
        self.transport = transport
        # gradients that are views into DDP's buckets stay so (zeroed); set to None they come
        # back as fresh tensors that DDP copies into the buckets at every syncing backward
        self.grads_to_none = (not ddp.gradient_as_bucket_view if grads_to_none is None
                              else grads_to_none)

    def __call__(self, *inputs: Any) -> Any:
        return self.ddp(*inputs)

    def micro_batch(self, sync: bool) -> AbstractContextManager[Any]:
        # DDP decides in the forward whether the next backward reduces: the forward must run in
        # this context too, or DDP syncs anyway
        return nullcontext() if sync else self.ddp.no_sync()

    def parameters(self) -> Iterator[nn.Parameter]:
        return self.ddp.parameters()

    def zero_grad(self, optimizer: torch.optim.Optimizer) -> None:
        optimizer.zero_grad(set_to_none=self.grads_to_none)

    def state_dict(self) -> dict[str, Any]:
        return self.module.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.module.load_state_dict(state)

    def describe(self) -> dict[str, Any]:
        return {"name": self.name, "transport": self.transport,
                "bucket_cap_mb": self.ddp.bucket_bytes_cap / 2**20,
                "gradient_as_bucket_view": self.ddp.gradient_as_bucket_view}


def build_torch_ddp(model: nn.Module, policy: SyncPolicy, device: torch.device,
                    world_size: int, counts: CommCounts, bucket_cap_mb: float = 25.0,
                    gradient_as_bucket_view: bool = True,
                    allreduce: str = "auto", probe: GradientProbe | None = None) -> TorchDDP:
    """Wrap `model` (already on `device`) in DDP for `policy`: the parameters the policy keeps
    consistent itself left to it, the policy's all-reduce installed inside the counting hook,
    through shared memory where `allreduce` allows (CPU ranks of one host). probe: the noise
    scale's squared norms, taken inside the counting hook (train/noise_scale.py)."""
    ignored = policy.bind(model)
    if ignored:  # the policy syncs these itself: DDP neither broadcasts nor all-reduces them
        DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(model, ignored)
    # replicas that train apart keep their own buffers until the policy averages them
    ddp = DistributedDataParallel(
        model, device_ids=[device.index] if device.type == "cuda" else None,
        gradient_as_bucket_view=gradient_as_bucket_view, bucket_cap_mb=bucket_cap_mb,
        **buffer_sync(not policy.syncs_parameters))
    if policy.syncs_parameters and not _FORWARD_SYNC_BUFFERS and world_size > 1:
        _broadcast_buffers(model, set(ignored))  # what forward_sync_buffers=False still does
    inner = policy.comm_hook()
    if device.type == "cpu" and world_size > 1 and allreduce != "process_group":
        # a slot holds the gradients, or what a policy's averaging sends (float buffers too)
        params, buffers = float_state(model)
        inner = over_shared_memory(inner, params + buffers if policy.syncs_parameters
                                   else params, allreduce)
    install_counting_hook(ddp, inner, counts, probe)
    shared = inner.hook is shm_hook
    if shared:  # a policy that averages by itself may use the same slots
        policy.use_shared_memory(inner.state)
    # a policy that syncs parameters has (after its warm-up) no synchronising backward: None
    # spares the zeroing pass and the backward's accumulation into the zeros
    return TorchDDP(ddp, counts, "shared_memory" if shared else "process_group",
                    grads_to_none=not gradient_as_bucket_view or policy.syncs_parameters)


def _broadcast_buffers(model: nn.Module, ignored: set[str]) -> None:
    """Rank 0's buffers to every rank, once (DDP's initial sync on torch < 2.13 when buffers
    are not synchronised in the forward)."""
    for name, buf in model.named_buffers():
        if name not in ignored:
            dist.broadcast(buf.data, src=0)
