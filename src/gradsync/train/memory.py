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
communication buffers). A CPU has no such counter, so the same quantity is measured for one
window, the run's second (the first one allocates the optimizer's state and warms up): the
tensor bytes alive when it starts (parameters, gradients and optimizer state, counted from the
tensors; a sharded engine's local shards), plus the highest the window's own allocations, net of
its frees, rose above them (every allocation and free torch's CPU allocator makes, recorded in
order by torch's legacy profiler for that window only: AllocationTrace). Memory that is not a
tensor (the interpreter, libraries, the allocator's retained free blocks) is in neither measure;
the process's resident set is summary.json's ``peak_rss_mb``. None for a run of fewer than two
windows.
"""

from __future__ import annotations

import os
import sys
import tempfile
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch

from gradsync.train.metrics import peak_memory_mb


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


def state_bytes(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> int:
    """Bytes of the tensors a rank keeps between windows: parameters, gradients, optimizer
    state (local shards)."""
    params = list(model.parameters())
    state = [local(v) for per_param in optimizer.state.values() for v in per_param.values()
             if isinstance(v, torch.Tensor)]
    return storage_bytes([local(q) for q in params] + [local(q.grad) for q in params] + state)


# What torch's CPU allocator (and Kineto's profiler, were it used) print on the process's stderr
# (fd 2) while a window is traced: a warning about frees of blocks allocated before the trace
NOISE = ("profiler_start", "profiler_stop",
         "Memory block of unknown size was allocated before the profiling started")


class HeldStderr:
    """The process's stderr (fd 2) into a temporary file while a window is profiled; on
    release, what was written there goes on to stderr, but the profiler's own lines (NOISE)."""

    def __init__(self) -> None:
        sys.stderr.flush()
        self.file = tempfile.TemporaryFile()
        self.saved = os.dup(2)
        os.dup2(self.file.fileno(), 2)

    def release(self) -> None:
        sys.stderr.flush()
        os.dup2(self.saved, 2)
        os.close(self.saved)
        self.file.seek(0)
        kept = [line for line in self.file.read().splitlines(keepends=True)
                if not any(n.encode() in line for n in NOISE)]
        self.file.close()
        if kept:
            os.write(2, b"".join(kept))


class AllocationTrace:
    """Every allocation and free torch's CPU allocator makes while it runs, in order: torch's
    legacy (non-Kineto) profiler with memory profiling, which records them as events at little
    cost (Kineto's first start in a process takes 0.4-1.2 s here). Its API is private: the same in
    torch 2.11 and 2.13 (``ProfilerConfig`` of 7 fields, ``_enable_profiler_legacy``)."""

    def __init__(self) -> None:
        from torch.autograd import ProfilerConfig, ProfilerState, _enable_profiler_legacy

        config = ProfilerConfig(ProfilerState.CPU, False, True, False, False, False,
                                torch._C._profiler._ExperimentalConfig())
        _enable_profiler_legacy(config)

    def stop(self) -> int:
        """The highest running total of the allocations minus the frees, in order (frees of
        blocks allocated before the trace started are not reported: an upper bound)."""
        from torch.autograd import _disable_profiler_legacy

        records = _disable_profiler_legacy()
        every = [e for thread in records for e in thread]
        if not every:
            return 0
        events = sorted((-e.cpu_elapsed_us(every[0]), e.cpu_memory_usage())
                        for e in every if e.kind() == "memory_alloc")
        total = peak = 0
        for _, size in events:
            total += size
            peak = max(peak, total)
        return peak


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
        self.measure = "cuda_max_allocated" if device.type == "cuda" else \
            "cpu_tensor_bytes_window_2"
        self.windows = 0  # windows since start()
        self.trace: AllocationTrace | None = None
        self.held: HeldStderr | None = None
        self.cpu_peak: int | None = None
        self.base = 0  # tensor bytes when the profiled window starts

    def record(self, unsharded: int, sharded: int) -> None:
        """After a backward: the gradient bytes the rank holds now."""
        g = self.grads
        g.unsharded_bytes = max(g.unsharded_bytes, unsharded)
        g.sharded_bytes = max(g.sharded_bytes, sharded)
        g.held_bytes = max(g.held_bytes, unsharded + sharded)

    def start(self) -> None:
        """When training starts (after set-up and any restore): the peak counts from here."""
        self.windows = 0
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)

    def after_window(self, p: Any, state: Any, stepped: bool) -> None:
        """A loop hook (Parts.after_window): on a CPU, profiles the second window."""
        self.windows += 1
        if self.device.type == "cuda" or self.windows > 2:
            return
        if self.windows == 1:
            self.base = state_bytes(p.engine.module, p.optimizer)
            self.held = HeldStderr()
            self.trace = AllocationTrace()
        else:
            peak = self.stop()
            self.cpu_peak = None if peak is None else self.base + peak

    def stop(self) -> int | None:
        """Stops a traced window (also when training ends inside it: the worker calls this in
        any case); its transient peak, None if no window was traced."""
        trace, self.trace = self.trace, None
        if trace is None:
            return None
        try:
            return trace.stop()
        finally:
            if self.held is not None:
                self.held.release()
                self.held = None

    def peak_mb(self) -> float | None:
        """The peak (see the module's docstring), in MiB; None without one."""
        if self.device.type == "cuda":
            return peak_memory_mb(self.device)
        return None if self.cpu_peak is None else self.cpu_peak / 2**20

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
