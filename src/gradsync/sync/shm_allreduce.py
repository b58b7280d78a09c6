"""Gradient all-reduce through shared memory, for CPU ranks that share one host.

gloo all-reduces over loopback TCP: the benchmark's 12.6 MB of gradients take it ~19 ms per
synchronising backward on 2 cores; through shared memory ~9 (README, Benchmark).
Every rank copies its bucket, divided by the world size as DDP's own hooks do, into its slot
of one shared buffer; a 1-element gloo all-reduce is the barrier; then every rank sums the
slots in rank order into its bucket. The same sum in the same order on every rank keeps the
replicas bitwise identical, and for two ranks it is gloo's result bit for bit. A backward's
buckets lie side by side in the slots; after its last bucket a second barrier makes sure every
rank has read them before any rank writes the next backward's. The barriers run on the default
group, whose timeout also ends a rank waiting for a dead peer.

The buffer has no name anywhere: rank 0 creates it with memfd_create, the other ranks open it
through /proc/<rank 0's pid>/fd/<its descriptor> (which only processes of the same user may
open), and the kernel frees it when the last process that maps it ends. No kill, of any
process at any moment, leaves anything in /dev/shm.
"""

from __future__ import annotations

import os
import socket
import uuid
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from gradsync.sync.comm import InnerHook

ALIGN = 64  # bytes: every bucket's region starts on a cache line


@dataclass
class SharedSlots:
    slots: torch.Tensor  # uint8 [world, capacity bytes], mapped by every rank
    rank: int
    world_size: int
    wire_dtype: torch.dtype | None  # None: the bucket's own dtype (exact)
    offset: int = 0  # bytes of the current backward's buckets already placed
    flag: torch.Tensor = field(default_factory=lambda: torch.zeros(1))

    def region(self, rank: int, numel: int, dtype: torch.dtype) -> torch.Tensor:
        return self.slots[rank, self.offset:self.offset + numel * dtype.itemsize].view(dtype)

    def barrier(self) -> None:
        dist.all_reduce(self.flag)


def shm_hook(state: SharedSlots, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """A DDP comm hook: the mean of the bucket over ranks, summed in the wire dtype."""
    buf = bucket.buffer()
    dtype = state.wire_dtype or buf.dtype
    nbytes = buf.numel() * dtype.itemsize
    if state.offset + nbytes > state.slots.shape[1]:
        raise RuntimeError(f"shared-memory all-reduce: a backward's buckets exceed the "
                           f"{state.slots.shape[1]} bytes reserved for the gradients")
    _mean_into(state, [buf], dtype, [buf])
    state.offset += -(-nbytes // ALIGN) * ALIGN
    if bucket.is_last():
        state.barrier()  # every slot is read: the next backward may write
        state.offset = 0
    fut: torch.futures.Future[torch.Tensor] = torch.futures.Future()
    fut.set_result(buf)
    return fut


def mean_through_slots(state: SharedSlots, src: torch.Tensor,
                       wire_dtype: torch.dtype | None) -> torch.Tensor | None:
    """The mean over ranks of every rank's `src` (flat), summed in wire_dtype (None: src's) as
    the hook sums a bucket, into a new tensor of src's dtype; None when it does not fit in a
    slot (the caller all-reduces instead). Between backwards only (a policy's averaging)."""
    dtype = wire_dtype or src.dtype
    if not _fits(state, src.numel(), dtype):
        return None
    out = torch.empty_like(src)
    _mean_into(state, [src], dtype, [out])
    state.barrier()  # every slot is read
    return out


def average_through_slots(state: SharedSlots, tensors: list[torch.Tensor]) -> torch.Tensor | None:
    """In place: each of `tensors` (one dtype) becomes its mean over ranks, summed as the hook
    sums a bucket (the process group's bits). Returns this rank's slot, flat, which still holds
    its tensors divided by the world size and is this rank's to overwrite until the slots are
    next used; None when they do not fit (the caller all-reduces instead). Between backwards
    only (a policy's averaging)."""
    numel, dtype = sum(t.numel() for t in tensors), tensors[0].dtype
    if not _fits(state, numel, dtype):
        return None
    _mean_into(state, tensors, dtype, tensors)  # each read into the slot before it is written
    state.barrier()  # every slot is read
    return state.region(state.rank, numel, dtype)


def _fits(state: SharedSlots, numel: int, dtype: torch.dtype) -> bool:
    """Between backwards (no bucket placed) and within a slot."""
    return not state.offset and numel * dtype.itemsize <= state.slots.shape[1]


def views(flat: torch.Tensor, like: list[torch.Tensor]) -> list[torch.Tensor]:
    """Consecutive views of `flat` shaped as the tensors of `like`."""
    out, offset = [], 0
    for t in like:
        out.append(flat[offset:offset + t.numel()].view(t.shape))
        offset += t.numel()
    return out


def _mean_into(state: SharedSlots, srcs: list[torch.Tensor], dtype: torch.dtype,
               outs: list[torch.Tensor]) -> None:
    """Each src / world_size into this rank's slot (in dtype, side by side), then, once every
    rank has written, the slots summed in rank order into the outs (shaped as the srcs): the
    same bits on every rank."""
    numel = sum(t.numel() for t in srcs)
    mine = views(state.region(state.rank, numel, dtype), srcs)
    for m, src in zip(mine, srcs, strict=True):
        if dtype == src.dtype:
            torch.div(src, state.world_size, out=m)  # one pass: the copy is the division
        else:  # as DDP's compress hooks: cast, then divide in the wire dtype
            m.copy_(src)
            m.div_(state.world_size)
    state.barrier()  # every slot is written
    slots = [views(state.region(r, numel, dtype), srcs) for r in range(state.world_size)]
    for i, out in enumerate(outs):
        total = out if out.dtype == dtype else torch.empty_like(mine[i])
        torch.add(slots[0][i], slots[1][i], out=total)
        for s in slots[2:]:
            total.add_(s[i])
        if total is not out:
            out.copy_(total)


def host_id() -> str:
    boot = Path("/proc/sys/kernel/random/boot_id")
    return f"{socket.gethostname()}/{boot.read_text().strip() if boot.is_file() else ''}"


def map_slots(capacity: int) -> torch.Tensor | None:
    """Collective: one shared buffer of [world, capacity] bytes mapped on every rank, or None on
    every rank when they are not all on one host or one of them cannot map rank 0's buffer. The
    buffer is a memfd of rank 0's (see the module's docstring): nameless, freed with the last
    process that maps it."""
    rank, world = dist.get_rank(), dist.get_world_size()
    hosts: list[Any] = [None] * world
    dist.all_gather_object(hosts, host_id())
    if len(set(hosts)) != 1:
        return None
    size = ALIGN + world * capacity  # a header: the token rank 0 writes, proof of one mapping
    where: list[Any] = [None, uuid.uuid4().int >> 65]  # rank 0's: where to open it, the token
    fd = None
    if rank == 0:
        try:
            fd = os.memfd_create("gradsync-slots", os.MFD_CLOEXEC)
            # reserved now: a memory limit fails here, not with SIGBUS mid-backward
            os.posix_fallocate(fd, 0, size)
            where[0] = f"/proc/{os.getpid()}/fd/{fd}"
        except (OSError, AttributeError):  # no memfd here, or no memory for it
            if fd is not None:
                os.close(fd)
                fd = None
    dist.broadcast_object_list(where, src=0)
    path, token = where
    mapped = None
    if path is not None:
        try:
            mapped = torch.from_file(path, shared=True, size=size, dtype=torch.uint8)
            if rank == 0:
                mapped[:8].view(torch.int64)[0] = token
        except (OSError, RuntimeError):
            mapped = None
    dist.barrier()  # every rank has mapped it or failed: rank 0's descriptor can go
    if fd is not None:
        os.close(fd)
    ok = mapped is not None and int(mapped[:8].view(torch.int64)[0]) == token
    oks: list[Any] = [None] * world
    dist.all_gather_object(oks, ok)
    return mapped[ALIGN:].view(world, capacity) if all(oks) and mapped is not None else None


def over_shared_memory(inner: InnerHook, params: list[torch.Tensor], mode: str) -> InnerHook:
    """The policy's all-reduce (inner: exact or a compress hook's wire dtype) done through
    shared memory. mode: auto (when every rank is on this host, else inner unchanged) or
    shared_memory (an error otherwise). Collective over the default group."""
    if inner.sent is not None:  # not a plain all-reduce of the bucket (PowerSGD, sync.groups
        if mode == "shared_memory":  # of several wire dtypes)
            raise RuntimeError("engine.allreduce=shared_memory all-reduces whole buckets in one "
                               "dtype; this policy's all-reduce needs process_group or auto")
        return inner
    grads = sum(p.numel() * p.element_size() for p in params)
    capacity = (-(-grads // ALIGN) + len(params) + 1) * ALIGN  # each bucket padded to ALIGN
    slots = map_slots(capacity)
    if slots is None:
        if mode == "shared_memory":
            raise RuntimeError("engine.allreduce=shared_memory needs every rank on one host, "
                               "able to map rank 0's shared memory (memfd_create, "
                               "/proc/<pid>/fd; auto falls back to gloo)")
        return inner
    state = SharedSlots(slots, dist.get_rank(), dist.get_world_size(), inner.wire_dtype)
    return replace(inner, hook=shm_hook, state=state)  # per-group counting stays
