"""A pool of real worker processes joined in one gloo process group, kept alive across tests:
spawning and importing torch costs seconds per process, so tests send functions to ranks that
are already up. ``pool.run(fn, *args)`` calls ``fn(*args)`` on every rank and returns the
per-rank results; an error on any rank raises here and the pool is rebuilt."""

from __future__ import annotations

import importlib
import os
import queue
import traceback
from datetime import timedelta

import torch.distributed as dist
import torch.multiprocessing as mp


def _serve(rank: int, world: int, port: int, tasks, results, backend: str = "gloo",
           setup: str | None = None) -> None:
    import torch

    torch.set_num_threads(1)
    if setup:  # "module:function", called in the rank before its process group exists
        module, name = setup.split(":")
        getattr(importlib.import_module(module), name)()
    store = dist.TCPStore("127.0.0.1", port, world, is_master=False)
    dist.init_process_group(backend, store=store, rank=rank, world_size=world,
                            timeout=timedelta(seconds=60))
    while True:
        task = tasks.get()
        if task is None:
            break
        module, name, args = task
        try:
            fn = getattr(importlib.import_module(module), name)
            results.put((rank, True, fn(*args)))
        except Exception:
            results.put((rank, False, traceback.format_exc()))
    dist.destroy_process_group()
    results.close()
    results.join_thread()  # every result sent
    # no interpreter finalisation: collecting torch's module graph takes seconds per process
    os._exit(0)


class DistPool:
    """backend: the default group's (tests/test_gpu.py: "cuda:gloo", CUDA tensors only);
    setup: "module:function" each rank calls first."""

    def __init__(self, world_size: int = 2, backend: str = "gloo", setup: str | None = None):
        self.world = world_size
        ctx = mp.get_context("spawn")
        self.store = dist.TCPStore("127.0.0.1", 0, world_size, is_master=True,
                                   wait_for_workers=False)
        self.tasks = [ctx.Queue() for _ in range(world_size)]
        self.results = ctx.Queue()
        self.procs = [
            ctx.Process(target=_serve, daemon=True,
                        args=(r, world_size, self.store.port, self.tasks[r], self.results,
                              backend, setup))
            for r in range(world_size)
        ]
        for proc in self.procs:
            proc.start()

    def run(self, fn, *args, timeout: float = 180.0) -> list:
        for q in self.tasks:
            q.put((fn.__module__, fn.__name__, args))
        out: list = [None] * self.world
        errors = []
        for _ in range(self.world):
            try:
                rank, ok, value = self.results.get(timeout=timeout)
            except queue.Empty:
                raise TimeoutError(f"{fn.__name__} did not finish in {timeout}s") from None
            if ok:
                out[rank] = value
            else:
                errors.append(f"rank {rank}:\n{value}")
                break  # the other ranks may be stuck in a collective
        if errors:
            raise RuntimeError("\n".join(errors))
        return out

    def close(self) -> None:
        for q in self.tasks:
            q.put(None)
        for proc in self.procs:
            proc.join(timeout=10)
            if proc.is_alive():
                proc.kill()
