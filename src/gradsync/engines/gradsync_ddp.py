"""engine=gradsync: gradsync's own data-parallel engine, in one module.

What torch's ``DistributedDataParallel`` does in its C++ reducer, written out so that it can be
read in one sitting, traced (engine.trace_sync) and extended: with the same bucket partition
and the same all-reduce it trains the same bits as torch_ddp (tests/test_gradsync_ddp.py).
Its life, each step below commented once where the code does it:

1. **Start**: rank 0's parameters and buffers are broadcast, so every replica starts alike;
   the parameters the policy's averager keeps (``wire.bind``) are left alone.
2. **Buckets**: the gradients are assigned to flat buffers as torch's DDP assigns them, by its
   own function (``dist._compute_bucket_assignment_by_size``): for the first synchronising
   backward all in one bucket (per dtype), then rebuilt once in the order the gradients became
   ready, every bucket up to ``bucket_cap_mb``. With ``find_unused_parameters`` the buckets are
   cut in reverse parameter order and never rebuilt, as torch does.
3. **Forward**: the micro-batch's ``sync`` decides whether the next backward synchronises (so
   the forward must run inside ``micro_batch`` too, as with ``no_sync()``); rank 0's buffers
   are broadcast before a forward that follows a synchronising one (torch's rule), unless the
   averager keeps the whole model (local SGD keeps each rank's buffers until it averages).
4. **Backward**: autograd accumulates each gradient (into its bucket view); the parameter's
   post-accumulate-grad hook then does nothing more in a no_sync backward, and in a
   synchronising one moves the gradient into its bucket; a bucket whose gradients are all in
   has its all-reduce launched at once, asynchronously, in bucket order (every rank issues the
   collectives in the same order), overlapping the rest of the backward. The all-reduce is the
   wire's comm hook inside the counting hook (engines/allreduce.py), handed a bucket object
   with the methods of torch's ``dist.GradBucket`` (``HookBucket``). A bucket the wire keeps
   local (``wire.sync_bucket``) is left as it is: its gradients accumulate on.
5. **End of the backward** (autograd's final callback, as torch's reducer): parameters that got
   no gradient are an error, or with find_unused_parameters go out as zeros (a parameter unused
   on every rank keeps its gradient); then each bucket's future is waited on (on CUDA a stream
   wait: nccl's work is done for the host once enqueued, so what it reduced is read only after
   the current stream waits for it) and its result copied back where the hook returned another
   tensor. The backward returns with every gradient synchronised.
6. **Step**: the loop steps the optimizer on the gradients; ``zero_grad`` zeroes them in place
   (they stay views of the buckets) or sets them to None.
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from typing import Any, cast

import torch
import torch.distributed as dist
from torch import nn

from gradsync.core.memory import MemoryMeter, storage_bytes
from gradsync.engines.allreduce import DDPSettings, grads_to_none, policy_allreduce
from gradsync.engines.base import Capabilities, Registered
from gradsync.engines.buffers import broadcast_from_rank0, synced_batchnorm, to_sync_batchnorm
from gradsync.engines.compiled import Compile
from gradsync.engines.trace import SyncTrace
from gradsync.engines.unused import unused_error
from gradsync.sync.averaging import Averager, whole_model
from gradsync.sync.comm import (
    CommCounts,
    CountingState,
    Probe,
    Wire,
    counting_hook,
    decides_per_bucket,
    to_device,
)


@dataclass(eq=False)
class Bucket:
    """One flat gradient buffer and the parameters whose gradients are views of it."""

    index: int
    indices: list[int]  # the parameters' positions in the engine's list
    params: list[torch.Tensor]
    names: list[str]
    buffer: torch.Tensor
    views: list[torch.Tensor]  # each parameter's gradient, shaped like it
    # --- per synchronising backward
    reduce: bool = True  # the wire's sync_bucket
    pending: int = 0  # gradients not yet in
    future: torch.futures.Future | None = None


class HookBucket:
    """A bucket as a DDP comm hook sees it: the methods of torch's ``dist.GradBucket``. torch's
    own is the reducer's C++ object and cannot be built from Python ("No constructor defined"),
    and the hooks (DDP's default and compress hooks, PowerSGD, sync.groups' grouped all-reduce,
    the shared-memory transport, the counting hook) call only these methods. ``is_last`` is the
    last bucket this backward all-reduces (buckets the policy keeps local do not count)."""

    __slots__ = ("_bucket", "_buffer", "_last")

    def __init__(self, bucket: Bucket, last: bool):
        self._bucket, self._buffer, self._last = bucket, bucket.buffer, last

    def index(self) -> int:
        return self._bucket.index

    def buffer(self) -> torch.Tensor:
        return self._buffer

    def gradients(self) -> list[torch.Tensor]:
        return list(self._bucket.views)

    def parameters(self) -> list[torch.Tensor]:
        return list(self._bucket.params)

    def is_last(self) -> bool:
        return self._last

    def set_buffer(self, buffer: torch.Tensor) -> None:
        self._buffer = buffer


class GradsyncDDP:
    """The engine (engines/base.py's interface); built by ``build_gradsync_ddp``."""

    name = "gradsync"
    capabilities = Capabilities(per_bucket=True, gradient_probe=True, trace_sync=True,
                                sync_batchnorm=True, shared_memory=True)

    def __init__(self, model: nn.Module, wire: Wire, averager: Averager | None,
                 ignored: list[str],
                 allreduce: CountingState, transport: str, bucket_cap_mb: float = 25.0,
                 gradient_as_bucket_view: bool = True, find_unused_parameters: bool = False,
                 trace: SyncTrace | None = None, memory: MemoryMeter | None = None):
        self.module = model
        self.compiled: Compile | None = None  # compile.enabled (build_gradsync_ddp)
        self.forward: Any = model  # what a micro-batch runs (compiled or not)
        # the gradient bytes held after each backward (core/memory.py)
        self.memory = memory if memory is not None else MemoryMeter(
            next(model.parameters()).device)
        self.wire = wire
        self.allreduce, self.transport = allreduce, transport
        self.counts: CommCounts = allreduce.counts
        self.trace = trace
        self.gradient_as_bucket_view = gradient_as_bucket_view
        self.find_unused = find_unused_parameters
        self.grads_to_none = grads_to_none(averager, gradient_as_bucket_view)
        self.cap = int(bucket_cap_mb * 2**20)
        skip = set(ignored)
        named = [(n, p) for n, p in model.named_parameters() if p.requires_grad and n not in skip]
        self.names = [n for n, _ in named]
        self.params: list[torch.Tensor] = [p for _, p in named]
        self.buffers = [b for n, b in model.named_buffers() if n not in skip]

        # 1. Start: every replica gets rank 0's parameters and buffers.
        broadcast_from_rank0([p.detach() for n, p in model.named_parameters() if n not in skip]
                             + [b.detach() for b in self.buffers])
        self.sync_buffers = bool(self.buffers) and not whole_model(averager)

        # 2. Buckets, as torch's DDP cuts them before its first synchronising backward.
        self.slot: list[tuple[Bucket, int]] = []
        self.buckets = self._make_buckets(self._assign(None))
        self.rebuilt = find_unused_parameters  # torch never rebuilds when it looks for those
        self.rebuild_due = False
        self.ready_order: list[int] = []  # in the first synchronising backward
        for i, param in enumerate(self.params):
            param.register_post_accumulate_grad_hook(functools.partial(self._grad_ready, i))

        self.per_bucket = decides_per_bucket(wire)
        self.require_sync = True  # micro_batch's sync (True outside one, as torch's DDP)
        self.forward_synced = True  # the last forward synchronised (buffers follow rank 0)
        self.backward_syncs = False  # decided by the forward
        self.in_backward = False
        self.next_bucket = 0  # the next bucket to launch
        self.last_reduced = -1  # the last bucket this backward all-reduces
        self.fired = bytearray(len(self.params))  # hooks run in this synchronising backward
        self.used = bytearray(len(self.params))  # gradients since the last synchronisation

    # --- 2. the bucket partition ------------------------------------------------------------
    def _assign(self, order: list[int] | None) -> list[list[int]]:
        """The parameters' positions per bucket: before the rebuild (order None) in one bucket
        per dtype and device (by parameter size and in reverse order with find_unused), after
        it in `order`, the order their gradients became ready."""
        n = len(self.params)
        if order is None:
            limits = [sys.maxsize] if not self.find_unused else [self.cap]
            indices, _ = dist._compute_bucket_assignment_by_size(self.params, limits, [False] * n)
            return list(reversed(indices))
        indices, _ = dist._compute_bucket_assignment_by_size(
            [self.params[i] for i in order], [self.cap], [False] * n, order)
        return indices

    def _make_buckets(self, assignment: list[list[int]]) -> list[Bucket]:
        """Flat buffers for `assignment`; gradients already in hand move into them (torch's
        initialize_bucket_views)."""
        buckets = []
        self.slot = [None] * len(self.params)  # type: ignore[list-item]
        for b, indices in enumerate(assignment):
            params = [self.params[i] for i in indices]
            buffer = torch.zeros(sum(p.numel() for p in params), dtype=params[0].dtype,
                                 device=params[0].device)
            views, offset = [], 0
            for p in params:
                views.append(_view(buffer, p, offset))
                offset += p.numel()
            bucket = Bucket(b, list(indices), params, [self.names[i] for i in indices], buffer,
                            views)
            buckets.append(bucket)
            for pos, i in enumerate(indices):
                self.slot[i] = (bucket, pos)
                grad = self.params[i].grad
                if self.gradient_as_bucket_view and grad is not None:
                    views[pos].copy_(grad)
                    self.params[i].grad = views[pos]
        return buckets

    def _rebuild(self) -> None:
        """After the first synchronising backward: buckets in the order the gradients became
        ready, rank 0's partition on every rank (torch's sync_bucket_indices)."""
        n = len(self.params)
        mine = self._assign(self.ready_order)
        flat = torch.zeros(2 * n + 1, dtype=torch.int64)
        flat[0] = len(mine)
        flat[1:1 + len(mine)] = torch.tensor([len(b) for b in mine])
        flat[n + 1:] = torch.tensor([i for b in mine for i in b])
        device = self.params[0].device
        if dist.get_world_size() > 1:
            on_device = flat.to(device)
            dist.broadcast(on_device, src=0)
            flat = on_device.cpu()
        sizes, order = flat[1:1 + int(flat[0])].tolist(), flat[n + 1:].tolist()
        assignment, start = [], 0
        for size in sizes:
            assignment.append(order[start:start + size])
            start += size
        self.buckets = self._make_buckets(assignment)
        self.rebuilt, self.rebuild_due, self.ready_order = True, False, []

    # --- 3. forward ---------------------------------------------------------------------------
    def __call__(self, *inputs: Any, **kwargs: Any) -> Any:
        grad = torch.is_grad_enabled()
        if grad and self.rebuild_due:
            self._rebuild()
        if self.forward_synced and self.sync_buffers:  # rank 0's buffers, as torch's DDP
            broadcast_from_rank0(self.buffers)
        out = self.forward(*inputs, **kwargs)
        self.forward_synced = self.backward_syncs = grad and self.require_sync
        return out

    @contextmanager
    def micro_batch(self, sync: bool) -> Iterator[None]:
        previous, self.require_sync = self.require_sync, sync
        try:
            with self.trace.micro_batch(sync) if self.trace else nullcontext():
                yield
        finally:
            self.require_sync = previous

    # --- 4. backward: one parameter's gradient is ready ---------------------------------------
    def _grad_ready(self, index: int, param: torch.Tensor) -> None:
        self.used[index] = 1
        if not self.backward_syncs:
            return  # no_sync: autograd accumulated the gradient, which stays local
        if not self.in_backward:
            self._begin_backward()
        self.fired[index] = 1
        if not self.rebuilt:
            self.ready_order.append(index)
        bucket, pos = self.slot[index]
        if not bucket.reduce:
            return  # kept local by the policy: it accumulates on
        self._into_bucket(bucket, pos, param)
        bucket.pending -= 1
        if bucket.pending == 0:
            self._launch_ready()

    def _begin_backward(self) -> None:
        """The first gradient of a synchronising backward: the policy's per-bucket decisions,
        the end-of-backward callback queued."""
        self.in_backward = True
        self.fired = bytearray(len(self.params))
        self.last_reduced = -1
        for b in self.buckets:
            b.reduce = self.wire.sync_bucket(b.names) if self.per_bucket else True
            b.pending = len(b.params) if b.reduce else 0
            b.future = None
            if b.reduce:
                self.last_reduced = b.index
        self.next_bucket = 0
        torch.autograd.Variable._execution_engine.queue_callback(self._finish_backward)

    def _into_bucket(self, bucket: Bucket, pos: int, param: torch.Tensor) -> None:
        """The gradient into its place in the bucket, unless it already is that place; no
        gradient (an unused parameter) sends zeros."""
        view, grad = bucket.views[pos], param.grad
        if grad is None:
            view.zero_()
        elif grad.data_ptr() != view.data_ptr():
            view.copy_(grad)
            if self.gradient_as_bucket_view:
                param.grad = view  # from now on autograd accumulates in the bucket itself

    def _launch_ready(self) -> None:
        """Launch, in bucket order, every bucket whose gradients are all in."""
        while (self.next_bucket < len(self.buckets)
               and self.buckets[self.next_bucket].pending == 0):
            b = self.buckets[self.next_bucket]
            self.next_bucket += 1
            if b.reduce:
                # the hooks are typed for torch's GradBucket; HookBucket has its methods
                hook_bucket = cast(dist.GradBucket, HookBucket(b, b.index == self.last_reduced))
                b.future = counting_hook(self.allreduce, hook_bucket)

    # --- 5. end of the backward ---------------------------------------------------------------
    def _finish_backward(self) -> None:
        try:
            missing = [i for i, fired in enumerate(self.fired)
                       if not fired and self.slot[i][0].reduce]
            if missing:
                self._unused(missing)
            used = self._used_anywhere() if self.find_unused else None
            copy_back = used is not None or not self.gradient_as_bucket_view
            for b in self.buckets:
                if not b.reduce:
                    if self.trace:
                        self.trace.skipped(b.index, b.params)
                    continue
                assert b.future is not None
                result = b.future.wait()  # on CUDA: the current stream waits for the work
                reduced = result[0] if isinstance(result, list) else result
                if reduced.data_ptr() != b.buffer.data_ptr():
                    b.buffer.copy_(reduced)
                if copy_back:
                    self._to_grads(b, used)
            # every gradient came in: the next forward rebuilds the buckets in this order
            self.rebuild_due = not self.rebuilt and len(self.ready_order) == len(self.params)
        finally:
            self.in_backward = self.backward_syncs = False
            self.used = bytearray(len(self.params))
            if not self.rebuild_due:
                self.ready_order = []

    def _unused(self, missing: list[int]) -> None:
        """Parameters that got no gradient in this synchronising backward: an error, or with
        find_unused_parameters their buckets go out with what they hold (zeros if nothing)."""
        if not self.find_unused:
            names = [self.names[i] for i in missing]
            if self.trace:
                for b in {self.slot[i][0] for i in missing}:
                    self.trace.skipped(b.index, b.params, "never launched: no gradient for "
                                       + ", ".join(self.names[i] for i in missing
                                                   if self.slot[i][0] is b))
            raise unused_error(names, "their buckets would never be all-reduced")
        for i in missing:
            bucket, pos = self.slot[i]
            self._into_bucket(bucket, pos, self.params[i])
            bucket.pending -= 1
        self._launch_ready()

    def _used_anywhere(self) -> list[int]:
        """Which parameters got a gradient on some rank since the last synchronisation (one
        MAX all-reduce, after the buckets': every rank issues it in the same order; one host
        read, the flags sent without one)."""
        flags = to_device(torch.tensor(list(self.used), dtype=torch.int32),
                          self.params[0].device)
        dist.all_reduce(flags, op=dist.ReduceOp.MAX)
        return flags.tolist()

    def _to_grads(self, b: Bucket, used: list[int] | None) -> None:
        """The reduced bucket into the parameters' gradients: a copy (gradient_as_bucket_view
        off), or the view itself for a gradient that was None (unused here, used elsewhere). A
        parameter unused on every rank keeps its gradient as it was."""
        for pos, (i, p) in enumerate(zip(b.indices, b.params, strict=True)):
            if used is not None and not used[i]:
                continue
            view = b.views[pos]
            if p.grad is None:
                p.grad = view if self.gradient_as_bucket_view else view.clone()
            elif p.grad.data_ptr() != view.data_ptr():
                p.grad.copy_(view)

    # --- 6. the step, and the rest of the interface ----------------------------------------------
    def zero_grad(self, optimizer: torch.optim.Optimizer) -> None:
        # once per window, before they go: the most gradient bytes the window held (a window's
        # gradients only accumulate). Every rank holds whole gradients (views into the
        # buckets: each bucket once; else the gradients and the buckets, a second copy)
        copies = [] if self.gradient_as_bucket_view else [b.buffer for b in self.buckets]
        self.memory.record(storage_bytes([*(q.grad for q in self.module.parameters()),
                                          *copies]), 0)
        optimizer.zero_grad(set_to_none=self.grads_to_none)
        if self.trace:
            self.trace.step_end()

    def parameters(self) -> Iterator[nn.Parameter]:
        return self.module.parameters()

    def align_buffers(self) -> None:
        if self.sync_buffers:
            broadcast_from_rank0(self.buffers)

    def state_dict(self) -> dict[str, Any]:
        return self.module.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.module.load_state_dict(state)

    def describe(self) -> dict[str, Any]:
        return {"name": self.name, "transport": self.transport,
                "bucket_cap_mb": self.cap / 2**20,
                "gradient_as_bucket_view": self.gradient_as_bucket_view,
                "find_unused_parameters": self.find_unused,
                "sync_batchnorm": synced_batchnorm(self.module),
                "buckets": [len(b.params) for b in self.buckets]}


def _view(buffer: torch.Tensor, param: torch.Tensor, offset: int) -> torch.Tensor:
    """The param's gradient inside `buffer` from `offset`: in the param's own layout when it is
    dense (channels_last, say), as autograd lays out its gradient; else C-contiguous."""
    if param.is_contiguous() or param.is_contiguous(memory_format=torch.channels_last):
        return buffer.as_strided(param.size(), param.stride(), offset)
    return buffer[offset:offset + param.numel()].view(param.size())


def build_gradsync_ddp(model: nn.Module, wire: Wire, averager: Averager | None,
                       device: torch.device,
                       world_size: int, counts: CommCounts, bucket_cap_mb: float = 25.0,
                       gradient_as_bucket_view: bool = True, allreduce: str = "auto",
                       find_unused_parameters: bool = False,
                       trace: SyncTrace | None = None, trace_sync: bool = False,
                       rank: int = 0,
                       memory: MemoryMeter | None = None,
                       probe: Probe | None = None,
                       sync_batchnorm: bool = False,
                       compile: Compile | None = None) -> GradsyncDDP:
    """The engine for `model` (already on `device`) and a policy's `wire` and `averager`, with
    the wire's all-reduce inside the counting hook, through shared memory where `allreduce`
    allows; probe: the noise scale's squared norms, taken inside the counting hook
    (train/noise_scale.py)."""
    if trace is None and trace_sync:  # engine.trace_sync: this rank's recorder
        trace = SyncTrace(rank)
    if sync_batchnorm:  # before the policy names parameters and the engine wraps the model
        model = to_sync_batchnorm(model)
    ignored = wire.bind(model)
    if trace:
        trace.watch(model)  # before the engine's hooks: a gradient's time comes first
    state, transport = policy_allreduce(model, wire, averager, device, world_size, allreduce,
                                        counts, trace, probe)
    engine = GradsyncDDP(model, wire, averager, ignored, state, transport, bucket_cap_mb,
                         gradient_as_bucket_view, find_unused_parameters, trace, memory)
    if compile:  # the engine's hooks see the compiled backward's gradients (compiled.py)
        engine.compiled, engine.forward = compile, compile.wrap(model)
    return engine


# engine=<name> (conf/engine/<name>.yaml): gradsync.engines collects these
ENGINES = {"gradsync": Registered(GradsyncDDP, build_gradsync_ddp, DDPSettings)}
