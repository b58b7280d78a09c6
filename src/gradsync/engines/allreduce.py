"""The policy's gradient all-reduce, as the data-parallel engines run it (torch_ddp and gradsync
alike): the wire's comm hook (``policy.wire.comm_hook()``: DDP's all-reduce in the bucket's dtype
or a wire dtype, PowerSGD, sync.groups' per-group wires), through the shared-memory transport
where ``engine.allreduce`` allows it (CPU ranks of one host, sync/shm_allreduce.py), inside
gradsync's counting hook (sync/comm.py), which also feeds the sync trace."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from gradsync.components import ConfigError, require
from gradsync.config.schema import check_types, finite
from gradsync.engines.trace import SyncTrace
from gradsync.sync.averaging import Averager, float_state, whole_model
from gradsync.sync.comm import CommCounts, CountingState, Probe, Wire
from gradsync.sync.shm_allreduce import over_shared_memory, shm_hook

ALLREDUCE = ("auto", "shared_memory", "process_group")  # engine.allreduce
MAX_BUCKET_CAP_MB = 2**20  # a 1 TiB bucket: more than any model's gradients on one rank


@dataclass
class DDPSettings:
    """engine=torch_ddp and engine=gradsync: the DDP engines' settings (docs/engines.md)."""

    gradient_as_bucket_view: bool = True
    bucket_cap_mb: float = 25.0
    allreduce: str = "auto"  # auto | shared_memory | process_group: how CPU ranks all-reduce
    trace_sync: bool = False  # trace.json: every bucket's all-reduce, per rank (docs/debugging.md)
    # BatchNorm layers become torch.nn.SyncBatchNorm: batch statistics over every rank's
    # micro-batch (CUDA ranks: docs/exactness.md); off: each rank's own
    sync_batchnorm: bool = False
    # parameters may get no gradient in a synchronising backward (docs/debugging.md); off: such
    # a parameter is an error
    find_unused_parameters: bool = False

    def check(self, device_type: str) -> None:
        check_types(self, "engine")
        require(finite(self.bucket_cap_mb) and 0 < self.bucket_cap_mb <= MAX_BUCKET_CAP_MB,
                "engine.bucket_cap_mb", f"a finite number > 0 (at most {MAX_BUCKET_CAP_MB})",
                self.bucket_cap_mb)
        require(self.allreduce in ALLREDUCE, "engine.allreduce",
                f"one of {', '.join(ALLREDUCE)}", self.allreduce)
        if self.sync_batchnorm and device_type != "cuda":
            raise ConfigError("engine.sync_batchnorm=true needs CUDA ranks: torch's "
                              "SyncBatchNorm computes its statistics on the GPU only (no CPU "
                              "kernel); on CPU ranks each rank keeps its own batch statistics")
        if self.allreduce == "shared_memory" and device_type == "cuda":
            raise ConfigError("engine.allreduce=shared_memory is for CPU ranks on gloo; on "
                              "CUDA nccl all-reduces: use auto or process_group")


def grads_to_none(averager: Averager | None, gradient_as_bucket_view: bool) -> bool:
    """Whether zero_grad sets the gradients to None: when they are not views into the buckets,
    or when an averager keeps the whole model, which has (after its warm-up) no synchronising
    backward: None spares the zeroing pass and the backward's accumulation into the zeros."""
    return not gradient_as_bucket_view or whole_model(averager)


def policy_allreduce(model: nn.Module, wire: Wire, averager: Averager | None,
                     device: torch.device,
                     world_size: int, allreduce: str, counts: CommCounts,
                     trace: SyncTrace | None = None,
                     probe: Probe | None = None) -> tuple[CountingState, str]:
    """The counting hook's state around the wire's all-reduce, and the transport it takes:
    shared_memory or process_group. Collective (the shared-memory slots are mapped by every
    rank)."""
    inner = wire.comm_hook()
    if device.type == "cpu" and world_size > 1 and allreduce != "process_group":
        # a slot holds the gradients, or what a policy's averaging sends (float buffers too)
        params, buffers = float_state(model)
        inner = over_shared_memory(inner, params + buffers if whole_model(averager)
                                   else params, allreduce)
    shared = inner.hook is shm_hook
    if shared and averager is not None:  # the averager may use the same slots
        averager.use_shared_memory(inner.state)
    transport = "shared_memory" if shared else "process_group"
    return CountingState(counts, inner, trace, probe=probe), transport
