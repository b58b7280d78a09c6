"""Functions the shared-memory all-reduce tests run on every rank of the pool."""

from __future__ import annotations

import os
from pathlib import Path

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from gradsync.models import MLP
from gradsync.sync import shm_allreduce
from gradsync.sync.comm import allreduce_in, install_counting_hook
from gradsync.sync.shm_allreduce import over_shared_memory

SHM_DIR = Path("/dev/shm")  # where named shared memory would appear (the buffer has no name)


def leftovers() -> set[str]:
    return {p.name for p in SHM_DIR.glob("gradsync-*")}


def synced_grads(transport: str, wire: str | None, windows: int = 3) -> dict:
    """A few accumulate windows (2 micro-batches, the second syncs) of an MLP split into
    several small buckets, each rank on its own data; the gradients after every synchronising
    backward (before the optimizer step), flattened, plus this rank's raw local gradients of
    the same backwards so the test can form the mean itself."""
    rank = dist.get_rank()
    before = leftovers()
    torch.manual_seed(0)
    model = MLP(16, 8, [64, 64], "tanh")
    ddp = DistributedDataParallel(model, gradient_as_bucket_view=True, bucket_cap_mb=0.005)
    wire_dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, None: None}[wire]
    inner = allreduce_in(wire_dtype)
    if transport == "shm":
        inner = over_shared_memory(inner, list(ddp.parameters()), "shared_memory")
    counts = install_counting_hook(ddp, inner)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(100 + rank)
    synced, local = [], []
    for _ in range(windows):
        batches = [(torch.randn(5, 16, generator=g), torch.randn(5, 8, generator=g))
                   for _ in range(2)]
        with ddp.no_sync():
            ((ddp(batches[0][0]) - batches[0][1]) ** 2).sum().backward()
        # what this rank alone would hold after the window: its own full local gradient
        ref = MLP(16, 8, [64, 64], "tanh")
        ref.load_state_dict(model.state_dict())
        for x, y in batches:
            ((ref(x) - y) ** 2).sum().backward()
        local.append(torch.cat([p.grad.flatten() for p in ref.parameters()]))
        ((ddp(batches[1][0]) - batches[1][1]) ** 2).sum().backward()
        synced.append(torch.cat([p.grad.flatten().clone() for p in ddp.parameters()]))
        opt.step()
        opt.zero_grad(set_to_none=False)
    return {"synced": synced, "local": local, "calls": counts.allreduce_calls,
            "bytes": counts.allreduce_bytes, "hook": inner.hook.__name__,
            "new_files": leftovers() - before}


def refused_across_hosts(mode: str) -> str:
    """Each rank claims its own host: auto falls back to the process group (the inner hook
    comes back unchanged), shared_memory raises on every rank alike."""
    own = shm_allreduce.host_id
    shm_allreduce.host_id = lambda: f"host-{dist.get_rank()}"  # type: ignore[assignment]
    try:
        inner = allreduce_in(None)
        out = over_shared_memory(inner, list(MLP(4, 2, [4], "tanh").parameters()), mode)
        return "unchanged" if out is inner else out.hook.__name__
    except RuntimeError as e:
        return f"error: {e}"
    finally:
        shm_allreduce.host_id = own  # type: ignore[assignment]


def shm_files() -> list[str]:
    return sorted(str(p) for p in Path(SHM_DIR).glob("gradsync-*"))


def map_and_look() -> dict:
    """Map a small shared buffer and say what backs it: this rank's mapping of it (the line of
    /proc/self/maps), the descriptors this process still has open on a memfd, what appeared in
    /dev/shm meanwhile, and whether a byte rank 0 writes is seen by every rank."""
    before = leftovers()
    slots = shm_allreduce.map_slots(1024)
    assert slots is not None
    start = slots.data_ptr() - shm_allreduce.ALIGN
    line = next(ln for ln in Path("/proc/self/maps").read_text().splitlines()
                if int(ln.split("-")[0], 16) <= start < int(ln.split()[0].split("-")[1], 16))
    open_memfds = [os.readlink(fd) for fd in Path("/proc/self/fd").iterdir()
                   if "memfd:" in _readlink(fd)]
    if dist.get_rank() == 0:
        slots[1, 0] = 42
    dist.barrier()
    return {"mapping": line.split(maxsplit=5)[-1], "open_memfds": open_memfds,
            "new_files": leftovers() - before, "seen": int(slots[1, 0])}


def _readlink(path: Path) -> str:
    try:
        return os.readlink(path)
    except OSError:
        return ""
