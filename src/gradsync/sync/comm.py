"""Communication accounting: a DDP comm hook that counts what really crosses the wire.

Hooks only fire on a synchronising backward, once per bucket; ``bucket.is_last()`` marks the
end of one synchronising backward. Policies that want another all-reduce (low precision, say)
pass it as the inner hook and keep these counts.
"""

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

from gradsync.components import ConfigError

# No `from __future__ import annotations` here: DDP checks the hook's annotations at runtime.
Hook = Callable[[Any, dist.GradBucket], torch.futures.Future]


def to_device(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A CPU tensor of host numbers onto `device` without a host sync: from pinned memory,
    non_blocking, on CUDA (a copy from pageable memory waits for the stream); itself on the
    CPU."""
    if device.type == "cpu":
        return host
    return (host.pin_memory() if device.type == "cuda" else host).to(device, non_blocking=True)


# The collectives of a sharded engine (engines/fsdp.py), as counted by CommCounts.add_collective.
COLLECTIVES = ("reduce_scatter", "all_gather", "all_reduce")


@dataclass
class CommCounts:
    allreduce_calls: int = 0
    allreduce_bytes: int = 0
    sync_backwards: int = 0
    # per parameter group of sync.groups (layer_sync.py): name -> [calls, bytes]; a call counts
    # for every group whose tensors it carried
    groups: dict[str, list[int]] = field(default_factory=dict)
    # a sharded engine's reduce-scatters and all-gathers (its all-reduces across HSDP replicas
    # count as all-reduces above): calls, and bytes of the whole (unsharded, padded) tensor
    reduce_scatter_calls: int = 0
    reduce_scatter_bytes: int = 0
    all_gather_calls: int = 0
    all_gather_bytes: int = 0
    # a sharded engine's reduce-scatters and all-gathers per group: collective -> name ->
    # [calls, bytes] (its all-reduces per group are in `groups`)
    sharded_groups: dict[str, dict[str, list[int]]] = field(default_factory=dict)

    @property
    def sent_bytes(self) -> int:
        """Every collective's bytes: all-reduces, and a sharded engine's reduce-scatters and
        all-gathers (the x-axis on which a sweep compares jobs of any engine)."""
        return self.allreduce_bytes + self.reduce_scatter_bytes + self.all_gather_bytes

    def add(self, calls: int, nbytes: int, group: str | None = None) -> None:
        """Count all-reduces made outside the counting hook (a policy's averaging)."""
        self.allreduce_calls += calls
        self.allreduce_bytes += nbytes
        if group is not None:
            self.add_to_group(group, calls, nbytes)

    def add_to_group(self, group: str, calls: int, nbytes: int) -> None:
        row = self.groups.setdefault(group, [0, 0])
        row[0] += calls
        row[1] += nbytes

    def add_collective(self, kind: str, group: str, nbytes: int) -> None:
        """One collective of a sharded engine (kind: one of COLLECTIVES) over a unit of `group`,
        `nbytes` the whole tensor it reduced or gathered."""
        if kind == "all_reduce":
            self.add(1, nbytes, group)
            return
        setattr(self, f"{kind}_calls", getattr(self, f"{kind}_calls") + 1)
        setattr(self, f"{kind}_bytes", getattr(self, f"{kind}_bytes") + nbytes)
        row = self.sharded_groups.setdefault(kind, {}).setdefault(group, [0, 0])
        row[0] += 1
        row[1] += nbytes

    @property
    def sharded(self) -> bool:
        """Whether a sharded engine's collectives were counted."""
        return bool(self.reduce_scatter_calls or self.all_gather_calls)

    def sharded_scalars(self) -> dict[str, float]:
        """TensorBoard's comm/ scalars of a sharded engine's reduce-scatters and all-gathers
        (none when it counted none), per group too."""
        if not self.sharded:
            return {}
        out: dict[str, float] = {}
        for kind in COLLECTIVES[:2]:
            out[f"comm/{kind}_calls"] = getattr(self, f"{kind}_calls")
            out[f"comm/{kind}_bytes"] = getattr(self, f"{kind}_bytes")
            for group, (_, nbytes) in self.sharded_groups.get(kind, {}).items():
                out[f"comm/{kind}_bytes/{group}"] = nbytes
        return out


@dataclass(frozen=True)
class Traffic:
    """What one call of a comm hook put on the wire: all-reduce calls, bytes, and per group."""

    calls: int
    nbytes: int
    groups: dict[str, tuple[int, int]]


@dataclass(frozen=True)
class InnerHook:
    """The all-reduce the counting hook wraps, and the dtype it puts on the wire."""

    hook: Hook = default_hooks.allreduce_hook
    state: Any = None  # the default hooks' state: the process group (None: the default group)
    wire_dtype: torch.dtype | None = None  # None: the bucket's own dtype
    # bytes the last call put on the wire (PowerSGD); None: the whole bucket in wire_dtype,
    # an all-reduce that the shared-memory transport can do instead
    sent: Callable[[Any, dist.GradBucket], int] | None = None
    # per-group accounting of a bucket (sync.groups); None: one call, counted as sent says
    traffic: Callable[[dist.GradBucket], Traffic] | None = None
    # True: the hook issues further collectives from its future's callbacks (PowerSGD), which
    # run on the backend's thread: a bucket's hook starts only once the previous bucket's
    # future is done, or the ranks could interleave the collectives of two buckets differently
    sequential: bool = False


# How a sharded engine's unit accumulates between synchronising micro-batches (sync.reduce_scatter
# and sync.replica_all_reduce, per group through sync.groups): `boundary` waits for the policy's
# synchronising micro-batch, `every` runs on every backward.
FLAVOURS = ("boundary", "every")


def check_flavours(reduce_scatter: str, replica_all_reduce: str, where: str = "",
                   key: str = "sync.", detail: str = "") -> None:
    """The one rule between the two flavours, for the policy's options (key "sync.") and a
    sync.groups rule's (where "sync.groups rule 'x': ", key "", detail " (parameter 'p')"): the
    all-reduce across replicas follows a reduce-scatter, so it cannot run more often."""
    if reduce_scatter == "boundary" and replica_all_reduce == "every":
        raise ConfigError(f"{where}{key}replica_all_reduce=every with {key}reduce_scatter=boundary"
                          f"{detail}: the all-reduce across replicas follows a reduce-scatter, "
                          f"so it cannot run more often; set {key}reduce_scatter=every or "
                          f"{key}replica_all_reduce=boundary")


@dataclass(frozen=True)
class ShardedSync:
    """What a sharded engine (engines/fsdp.py) does with one parameter's gradients: its
    counterpart of InnerHook. `reduce_scatter`: boundary (gradients accumulate unsharded,
    without traffic, and are reduce-scattered on the policy's synchronising micro-batch) or
    every (reduce-scattered after every backward: sharded gradients accumulate). On HSDP,
    `replica_all_reduce`: the all-reduce of the shards across replicas on the synchronising
    micro-batch only (boundary) or after every reduce-scatter (every)."""

    group: str = "rest"  # the sync.groups label its collectives are counted under
    wire: torch.dtype | None = None  # the reduction's dtype; None: the gradients' own
    reduce_scatter: str = "boundary"
    replica_all_reduce: str = "boundary"


# DDP's own low-precision all-reduces: cast the bucket, all-reduce, cast the mean back.
COMPRESS_HOOKS: dict[torch.dtype, Hook] = {
    torch.bfloat16: default_hooks.bf16_compress_hook,
    torch.float16: default_hooks.fp16_compress_hook,
}


def allreduce_in(wire_dtype: torch.dtype | None) -> InnerHook:
    """DDP's all-reduce in wire_dtype (bf16 or fp16), or in the gradients' own dtype (None)."""
    if wire_dtype is None:
        return InnerHook()
    return InnerHook(COMPRESS_HOOKS[wire_dtype], None, wire_dtype)


class Probe(Protocol):
    """A measurement around each bucket's all-reduce of one synchronising backward (the noise
    scale's GradientProbe, train/noise_scale.py): the counting hook asks it while it is armed
    and disarms it after the backward's last bucket."""

    armed: bool

    def before(self, bucket: dist.GradBucket) -> Callable[[torch.futures.Future[torch.Tensor]],
                                                          torch.Tensor]:
        """Measure the bucket before the all-reduce; returns the callback that measures what
        the all-reduce returns."""
        ...


@dataclass
class CountingState:
    counts: CommCounts
    inner: InnerHook
    # engine.trace_sync: records each bucket's all-reduce (engines/trace.py SyncTrace)
    trace: Any = None
    previous: Any = None  # the last bucket's future in this backward (inner.sequential)
    probe: Probe | None = None  # the noise scale's measurement (None: not measured)


def counting_hook(
    state: CountingState, bucket: dist.GradBucket
) -> torch.futures.Future[torch.Tensor]:
    """Runs the inner all-reduce on the bucket and counts it. Called by torch's DDP reducer and
    by gradsync's own engine (engines/gradsync_ddp.py) alike."""
    inner, buf = state.inner, bucket.buffer()
    wire = inner.wire_dtype or buf.dtype
    if inner.sequential and state.previous is not None:
        state.previous.wait()  # every collective of the previous bucket issued (and done)
    probe = state.probe if state.probe is not None and state.probe.armed else None
    # measured before the inner hook changes the bucket in place
    measure_reduced = probe.before(bucket) if probe is not None else None
    launched = state.trace.now() if state.trace is not None else 0
    fut = inner.hook(inner.state, bucket)
    if probe is not None and measure_reduced is not None:
        fut = fut.then(measure_reduced)
        if bucket.is_last():
            probe.armed = False
    if inner.sequential:
        state.previous = None if bucket.is_last() else fut
    t = inner.traffic(bucket) if inner.traffic is not None else None
    if t is not None:
        state.counts.add(t.calls, t.nbytes)
        for group, (calls, nbytes) in t.groups.items():
            state.counts.add_to_group(group, calls, nbytes)
        nbytes = t.nbytes
    else:
        nbytes = (buf.numel() * wire.itemsize if inner.sent is None
                  else inner.sent(inner.state, bucket))
        state.counts.allreduce_calls += 1
        state.counts.allreduce_bytes += nbytes
    if bucket.is_last():
        state.counts.sync_backwards += 1
    if state.trace is not None:  # one all-reduce per wire dtype (sync.groups): "mixed"
        wire_name = ("mixed" if t is not None and t.calls > 1
                     else str(wire).removeprefix("torch."))
        state.trace.bucket(bucket, launched, fut, nbytes, wire_name,
                           t.groups if t is not None else {})
    return fut


def install_counting_hook(ddp, inner: InnerHook | None = None,
                          counts: CommCounts | None = None,
                          probe: Probe | None = None) -> CommCounts:
    """counts: counters that other all-reduces of the run (a policy's averaging) also fill;
    probe: where the noise scale's squared norms go (train/noise_scale.py)."""
    counts = counts if counts is not None else CommCounts()
    ddp.register_comm_hook(CountingState(counts, inner or InnerHook(), probe=probe),
                           counting_hook)
    return counts


class Wire:
    """A policy's wire (``policy.wire``): the role the engine is given, what the gradients of a
    synchronising backward cross the wire as. This class is the plain all-reduce (``PLAIN``,
    what a policy without a wire gets): DDP's, in the gradients' own dtype, of every
    parameter. Each member is asked by the engine (the ones named), ``after_step`` by the
    loop."""

    # amp_aware's sync.overflow_consensus: with fp16's GradScaler, a window that overflows on
    # some rank ends early on every rank (train/precision.py OverflowConsensus reads this)
    overflow_consensus: bool = False

    def bind(self, model: Any) -> list[str]:
        """Before the engine wraps the model: the names of parameters the engine must leave
        alone (neither broadcast nor all-reduce them): the policy's averager keeps them."""
        return []

    def comm_hook(self) -> InnerHook:
        """The all-reduce the DDP engines (torch_ddp, gradsync) run on a synchronising
        backward, counted around it (counting_hook)."""
        return allreduce_in(None)

    def sharded_sync(self, names: list[str]) -> dict[str, ShardedSync]:
        """The sharded engines (fsdp, hsdp), instead of comm_hook: how each named parameter's
        gradients are reduced. By default in the dtype of comm_hook()'s all-reduce,
        reduce-scattered (and all-reduced across HSDP replicas) on the synchronising
        micro-batches only. ConfigError if comm_hook() is an all-reduce of the wire's own, which
        a sharded engine cannot run."""
        inner = self.comm_hook()
        if inner.hook is not allreduce_in(None).hook and inner.hook not in COMPRESS_HOOKS.values():
            raise ConfigError(f"the sync policy's wire ({type(self).__name__}) all-reduces "
                              "through a comm hook of its own, which sharded engines (fsdp, "
                              "hsdp) cannot run: use engine=torch_ddp")
        return {n: ShardedSync(wire=inner.wire_dtype) for n in names}

    def sync_bucket(self, params: list[str]) -> bool:
        """engine=gradsync only: asked once per gradient bucket in each synchronising backward
        (params: the names of the parameters the bucket holds). False keeps that bucket's
        gradients local: they accumulate into the next synchronising backward, as no_sync()
        keeps a whole backward's. Must answer alike on every rank. A bucket kept local in a
        window's last micro-batch leaves its parameters different across ranks: the policy's
        averager then keeps them consistent."""
        return True

    def after_step(self, stepped: bool) -> None:
        """The loop, after each window's optimizer step (stepped: False when fp16 skipped it)."""


PLAIN = Wire()  # the wire of a policy without one


def decides_per_bucket(wire: Wire) -> bool:
    """The wire answers sync_bucket itself: only an engine with per-bucket decisions
    (engine=gradsync) can carry that out."""
    return getattr(wire.sync_bucket, "__func__", None) is not Wire.sync_bucket
