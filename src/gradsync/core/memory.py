"""What a rank's memory holds while it trains: the gradient bytes held between micro-batches,
counted from the gradient tensors that exist after each backward (unsharded: a whole
parameter's gradient; sharded: a rank's shard of it, as FSDP keeps them), and the rank's peak
memory during training.

The engine counts its gradients after every micro-batch's backward (``MemoryMeter.record``): the
maximum over the run of the unsharded bytes, of the sharded bytes and of their sum. Tensors are
counted by their storage, once each (DDP's gradients are views into its buckets: a bucket
counts once, whole; FSDP's sharded gradients of one unit share one flat buffer, padding
included).

Peak memory, from counters the system and torch keep, no tracing: on a GPU, torch's
``torch.cuda.max_memory_allocated`` since training started (what the caching allocator handed
out: parameters, gradients, optimizer state, activations, communication buffers); on a CPU, the
rank process's peak resident set since training started (Linux's ``VmHWM``, reset when training
starts through ``/proc/self/clear_refs``; where that cannot be reset, ``getrusage``'s
``ru_maxrss``, the peak since the process started). The CPU's number counts everything the
process holds (interpreter, libraries, allocator's retained blocks, tensors): it is at least the
tensor bytes, and hundreds of MB more for torch itself.
"""

from __future__ import annotations

import resource
from collections.abc import Iterable
from dataclasses import dataclass

import torch


def storage_bytes(tensors: Iterable[torch.Tensor | None]) -> int:
    """Bytes of the storages behind `tensors`, each storage once (None and freed ones: 0)."""
    seen: set[int] = set()
    total = 0
    for t in tensors:
        if t is None:
            continue
        storage = t.untyped_storage()
        if storage.data_ptr() in seen or storage.nbytes() == 0:
            continue
        seen.add(storage.data_ptr())
        total += storage.nbytes()
    return total


def local(t: torch.Tensor | None) -> torch.Tensor | None:
    """A DTensor's local shard (what this rank holds), any other tensor itself."""
    return getattr(t, "_local_tensor", t)


def resident_peak_bytes() -> int:
    """The process's peak resident set: Linux's VmHWM (since the last reset_resident_peak),
    else getrusage's ru_maxrss (since the process started)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux: KiB


def reset_resident_peak() -> bool:
    """Resets the process's peak resident set to its current one (Linux >= 4.0: writing 5 to
    /proc/self/clear_refs); False where it cannot."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


@dataclass
class GradientMemory:
    """Gradient bytes a rank held after a backward: the maximum over the run of each."""

    unsharded_bytes: int = 0  # whole gradients (DDP's; FSDP's while accumulating unsharded)
    sharded_bytes: int = 0  # shards of gradients (FSDP's after a reduce-scatter)
    held_bytes: int = 0  # both at once


class MemoryMeter:
    """A rank's gradient memory (recorded by its engine) and its peak memory during training
    (see the module's docstring)."""

    def __init__(self, device: torch.device):
        self.device = device
        self.grads = GradientMemory()
        self.measure = "cuda_max_allocated" if device.type == "cuda" else "cpu_peak_rss"

    def record(self, unsharded: int, sharded: int) -> None:
        """After a backward: the gradient bytes the rank holds now."""
        g = self.grads
        g.unsharded_bytes = max(g.unsharded_bytes, unsharded)
        g.sharded_bytes = max(g.sharded_bytes, sharded)
        g.held_bytes = max(g.held_bytes, unsharded + sharded)

    def start(self) -> None:
        """When training starts (after set-up and any restore): the peak counts from here."""
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
        elif not reset_resident_peak():
            self.measure = "cpu_peak_rss_since_process_start"

    def peak_mb(self) -> float | None:
        """The peak (see the module's docstring), in MiB."""
        if self.device.type == "cuda":
            return peak_memory_mb(self.device)
        return resident_peak_bytes() / 2**20

    def scalars(self) -> dict[str, float]:
        """TensorBoard's mem/ scalars (rank 0's)."""
        out: dict[str, float] = {"mem/grad_unsharded_bytes": self.grads.unsharded_bytes,
                                 "mem/grad_sharded_bytes": self.grads.sharded_bytes,
                                 "mem/grad_held_bytes": self.grads.held_bytes}
        peak = self.peak_mb()
        if peak is not None:
            out["mem/peak_mb"] = peak
        return out

    def summary(self) -> dict[str, float | int | str | None]:
        """This rank's part of summary.json's `memory` entry."""
        return {"grad_unsharded_bytes": self.grads.unsharded_bytes,
                "grad_sharded_bytes": self.grads.sharded_bytes,
                "grad_held_bytes": self.grads.held_bytes, "peak_mb": self.peak_mb(),
                "peak_measure": self.measure}


def peak_memory_mb(device: torch.device) -> float | None:
    """The peak of memory torch allocated on this rank's GPU (None on the CPU). Read from the
    caching allocator's counters: no device sync."""
    if device.type != "cuda":
        return None
    return torch.cuda.max_memory_allocated(device) / 2**20


def peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0  # Linux: KiB
