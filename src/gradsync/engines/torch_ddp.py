"""engine=torch_ddp: torch's ``DistributedDataParallel``.

DDP's C++ reducer puts the gradients in buckets (reverse parameter order, each up to
``engine.bucket_cap_mb``: given explicitly, it caps the first bucket too; rebuilt in the order
gradients became ready after the first synchronising backward) and all-reduces each bucket as
soon as it is full, overlapping the rest of the backward. ``no_sync()`` around a micro-batch's
forward and backward keeps its gradients local. The policy's wire chooses the bucket's
all-reduce (its ``comm_hook``), which runs inside gradsync's counting hook; on CPU ranks of one
host it goes through shared memory (``engine.allreduce``, sync/shm_allreduce.py) instead of
gloo's loopback TCP.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from typing import Any

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from gradsync.core.memory import MemoryMeter, storage_bytes
from gradsync.engines.allreduce import DDPSettings, grads_to_none, policy_allreduce
from gradsync.engines.base import Capabilities, Registered
from gradsync.engines.buffers import broadcast_from_rank0, synced_batchnorm, to_sync_batchnorm
from gradsync.engines.compiled import Compile
from gradsync.engines.trace import SyncTrace
from gradsync.engines.unused import GradientWitness, unused_error
from gradsync.sync.averaging import Averager, whole_model
from gradsync.sync.comm import CommCounts, Probe, Wire, counting_hook
from gradsync.torch_compat import ddp_buffer_sync


class TorchDDP:
    """The engine around an already built ``DistributedDataParallel``."""

    name = "torch_ddp"
    # compiled: torch's DDPOptimizer splits the graph at the buckets, its first one no larger
    # than the others
    capabilities = Capabilities(gradient_probe=True, trace_sync=True, sync_batchnorm=True,
                                shared_memory=True, compile_min_bucket_mb=1.0)

    def __init__(self, ddp: DistributedDataParallel, counts: CommCounts | None = None,
                 transport: str = "process_group", grads_to_none: bool | None = None,
                 trace: SyncTrace | None = None, memory: MemoryMeter | None = None,
                 witness: GradientWitness | None = None,
                 buffers: list[torch.Tensor] | None = None):
        self.ddp = ddp
        self.module: nn.Module = ddp.module
        # the buffers DDP syncs from rank 0 (align_buffers); default: all it does not ignore
        ignored = set(getattr(ddp.module, "_ddp_params_and_buffers_to_ignore", ()))
        self.buffers = buffers if buffers is not None else [
            b for n, b in ddp.module.named_buffers() if n not in ignored]
        self.counts = counts if counts is not None else CommCounts()
        self.memory = memory if memory is not None else MemoryMeter(
            next(ddp.module.parameters()).device)
        self.transport = transport
        # engine.trace_sync: what DDP's comm hook sees of each bucket (engines/trace.py)
        self.trace = trace
        # gradients that are views into DDP's buckets stay so (zeroed); set to None they come
        # back as fresh tensors that DDP copies into the buckets at every syncing backward
        self.grads_to_none = (not ddp.gradient_as_bucket_view if grads_to_none is None
                              else grads_to_none)
        # gradient_as_bucket_view off: the reducer's buckets are a second, flat copy of the
        # gradients, allocated with it and kept (their total does not change when it rebuilds)
        self.bucket_bytes = 0 if ddp.gradient_as_bucket_view else bucket_bytes(ddp)
        # without find_unused_parameters: which parameters the synchronising backward reached
        # (DDP itself would only fail at the next forward, naming none: engines/unused.py)
        self.witness = witness
        self.compiled: Compile | None = None  # compile.enabled (build_torch_ddp)
        self.forward: Any = ddp  # what a training micro-batch runs (compiled or not)

    def __call__(self, *inputs: Any, **kwargs: Any) -> Any:
        return self.forward(*inputs, **kwargs)

    @contextmanager
    def micro_batch(self, sync: bool) -> Iterator[None]:
        # DDP decides in the forward whether the next backward reduces: the forward must run in
        # this context too, or DDP syncs anyway
        witness = self.witness if sync else None
        if witness:
            witness.start()
        with nullcontext() if sync else self.ddp.no_sync(), \
                self.trace.micro_batch(sync) if self.trace else nullcontext():
            yield
        missing = witness.missing() if witness else None
        if missing:  # before the optimizer steps on gradients whose buckets never went out
            raise unused_error(missing, "their buckets were never all-reduced (torch's DDP "
                               "would stop at the next forward)")

    def parameters(self) -> Iterator[nn.Parameter]:
        return self.ddp.parameters()

    def align_buffers(self) -> None:
        broadcast_from_rank0(self.buffers)

    def zero_grad(self, optimizer: torch.optim.Optimizer) -> None:
        # once per window, before they go: the most gradient bytes the window held (a window's
        # gradients only accumulate). Every rank holds whole gradients (views into DDP's
        # buckets: each bucket once; else the gradients and the buckets)
        self.memory.record(storage_bytes(q.grad for q in self.module.parameters())
                           + self.bucket_bytes, 0)
        optimizer.zero_grad(set_to_none=self.grads_to_none)
        if self.trace:
            self.trace.step_end()

    def state_dict(self) -> dict[str, Any]:
        return self.module.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.module.load_state_dict(state)

    def describe(self) -> dict[str, Any]:
        return {"name": self.name, "transport": self.transport,
                "bucket_cap_mb": self.ddp.bucket_bytes_cap / 2**20,
                "gradient_as_bucket_view": self.ddp.gradient_as_bucket_view,
                "find_unused_parameters": self.ddp.find_unused_parameters,
                "sync_batchnorm": synced_batchnorm(self.module)}


def bucket_bytes(ddp: DistributedDataParallel) -> int:
    """Bytes of the reducer's bucket buffers (the shapes of its buckets, as the comm hook gets
    them: ``_get_zeros_like_grad_buckets`` allocates their like once)."""
    return sum(b.buffer().nbytes for b in ddp.reducer._get_zeros_like_grad_buckets())


def build_torch_ddp(model: nn.Module, wire: Wire, averager: Averager | None,
                    device: torch.device,
                    world_size: int, counts: CommCounts, bucket_cap_mb: float = 25.0,
                    gradient_as_bucket_view: bool = True, allreduce: str = "auto",
                    find_unused_parameters: bool = False,
                    trace: SyncTrace | None = None, trace_sync: bool = False,
                    rank: int = 0,
                    memory: MemoryMeter | None = None,
                    probe: Probe | None = None,
                    sync_batchnorm: bool = False,
                    compile: Compile | None = None) -> TorchDDP:
    """Wrap `model` (already on `device`) in DDP for a policy's `wire` and `averager`: the
    parameters the averager keeps left to it, the wire's all-reduce installed inside the
    counting hook, through shared memory where `allreduce` allows (CPU ranks of one host).
    probe: the noise scale's squared norms, taken inside the counting hook
    (train/noise_scale.py)."""
    if trace is None and trace_sync:  # engine.trace_sync: this rank's recorder
        trace = SyncTrace(rank)
    if sync_batchnorm:  # before the policy names parameters and the engine wraps the model
        model = to_sync_batchnorm(model)
    ignored = wire.bind(model)
    if ignored:  # the averager syncs these: DDP neither broadcasts nor all-reduces them
        DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(model, ignored)
    if trace:
        trace.watch(model)
    # replicas that train apart keep their own buffers until the policy averages them
    ddp = DistributedDataParallel(
        model, device_ids=[device.index] if device.type == "cuda" else None,
        gradient_as_bucket_view=gradient_as_bucket_view, bucket_cap_mb=bucket_cap_mb,
        find_unused_parameters=find_unused_parameters,
        **ddp_buffer_sync(not whole_model(averager)))
    state, transport = policy_allreduce(model, wire, averager, device, world_size, allreduce,
                                        counts, trace, probe)
    ddp.register_comm_hook(state, counting_hook)
    witness = None if find_unused_parameters else GradientWitness(
        (n, q) for n, q in model.named_parameters() if n not in ignored)
    buffers = [] if whole_model(averager) else [b for n, b in model.named_buffers()
                                                if n not in ignored]
    engine = TorchDDP(ddp, counts, transport,
                      grads_to_none=grads_to_none(averager, gradient_as_bucket_view),
                      trace=trace, memory=memory, witness=witness, buffers=buffers)
    if compile:  # the wrapper: DDP's graph split at its buckets (engines/compiled.py)
        engine.compiled, engine.forward = compile, compile.wrap(ddp)
    return engine


# engine=<name> (conf/engine/<name>.yaml): gradsync.engines collects these
ENGINES = {"torch_ddp": Registered(TorchDDP, build_torch_ddp, DDPSettings)}
