"""What a rank's memory holds while it trains: the gradient bytes held between micro-batches,
counted from the gradient tensors that exist after each backward (unsharded: a whole
parameter's gradient; sharded: a rank's shard of it, as FSDP keeps them), and the rank's peak
memory during training.

The engine counts its gradients after every micro-batch's backward (``MemoryMeter.record``): the
maximum over the run of the unsharded bytes, of the sharded bytes and of their sum. Tensors are
counted by their storage, once each (DDP's gradients are views into its buckets: a bucket
counts once, whole; FSDP's sharded gradients of one unit share one flat buffer, padding
included).

Peak memory: on a GPU, torch's ``max_memory_allocated`` since training started (what the
caching allocator handed out: parameters, gradients, optimizer state, activations,
communication buffers). On a CPU there is no allocator counter to read, so the measure is the
process's own: the resident set's high-water mark during training (Linux ``VmHWM``, reset when
training starts by writing 5 to ``/proc/self/clear_refs``) minus the resident set before the rank
built its data and model (the interpreter, torch and the process group). It includes what the
allocator keeps after a free (glibc returns large blocks to the system, small ones it keeps),
so it is an upper bound of the tensor bytes alive at the peak, on the same scale for every
engine. None where the platform offers neither.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import torch

_STATUS = Path("/proc/self/status")
_CLEAR_REFS = Path("/proc/self/clear_refs")


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


def _status_kib(key: str) -> int | None:
    try:
        found = re.search(rf"^{key}:\s+(\d+) kB", _STATUS.read_text(), re.MULTILINE)
    except OSError:
        return None
    return int(found.group(1)) if found else None


def _reset_rss_peak() -> bool:
    try:
        _CLEAR_REFS.write_text("5")  # resets VmHWM to the current RSS (Linux >= 4.0)
    except OSError:
        return False
    return True


@dataclass
class GradientMemory:
    """Gradient bytes a rank held after a backward: the maximum over the run of each."""

    unsharded_bytes: int = 0  # whole gradients (DDP's; FSDP's while accumulating unsharded)
    sharded_bytes: int = 0  # shards of gradients (FSDP's after a reduce-scatter)
    held_bytes: int = 0  # both at once


class MemoryMeter:
    """A rank's gradient memory (recorded by its engine) and its peak memory during training.
    Made before the rank builds its data and model: the CPU measure's baseline."""

    def __init__(self, device: torch.device):
        self.device = device
        self.grads = GradientMemory()
        self.base_kib = _status_kib("VmRSS") if device.type == "cpu" else 0
        self.measure = ("cuda_max_allocated" if device.type == "cuda" else
                        "rss_high_water_above_setup" if self.base_kib is not None else None)
        self.started = False

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
            self.started = True
        elif self.measure is not None:
            self.started = _reset_rss_peak()
            if not self.started:
                self.measure = None

    def peak_mb(self) -> float | None:
        """The peak since start() (see the module's docstring), in MiB; None without one."""
        if not self.started:
            return None
        if self.device.type == "cuda":
            return torch.cuda.max_memory_allocated(self.device) / 2**20
        peak = _status_kib("VmHWM")
        return None if peak is None or self.base_kib is None else (peak - self.base_kib) / 1024

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
