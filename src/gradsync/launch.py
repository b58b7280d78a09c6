"""Start a job's workers: spawn trainer.devices processes that meet at a TCPStore this process
holds on a free port (no fixed 29500, no port race), or, under torchrun, be one of the workers."""

from __future__ import annotations

import multiprocessing
import os
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch.distributed as dist
import torch.multiprocessing as mp

from gradsync.worker import worker_main


class WorkerFailed(RuntimeError):
    def __init__(self, rank: int, message: str):
        super().__init__(f"rank {rank} failed: {message}")
        self.rank = rank


def under_torchrun() -> bool:
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def _last_line(text: str) -> str:
    lines = [line.strip() for line in text.strip().splitlines() if line.strip()]
    return lines[-1] if lines else "unknown error"


def _standard_start_method() -> None:
    """A spawned child sets its parent's default start method from the parent's data; in a
    joblib (loky) worker that is "loky", which a plain spawned child does not know and dies on.
    Jobs of a sweep run in loky workers under hydra/launcher=joblib: reset it there."""
    if multiprocessing.get_start_method(allow_none=True) not in (None, "spawn", "fork",
                                                                 "forkserver"):
        multiprocessing.set_start_method("spawn", force=True)


def launch(cfg: dict[str, Any], run_dir: Path) -> None:
    if under_torchrun():
        worker_main(int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), cfg, str(run_dir),
                    store_port=None)
        return
    world = cfg["trainer"]["devices"]
    timeout = timedelta(seconds=cfg["trainer"]["timeout_s"])
    store = dist.TCPStore("127.0.0.1", 0, world, is_master=True, wait_for_workers=False,
                          timeout=timeout)
    _standard_start_method()
    try:
        mp.start_processes(worker_main, args=(world, cfg, str(run_dir), store.port),
                           nprocs=world, start_method="spawn")
    except mp.ProcessRaisedException as e:
        raise WorkerFailed(e.error_index, _last_line(str(e))) from None
    except mp.ProcessExitedException as e:
        how = f"killed by {e.signal_name}" if e.signal_name else f"exit code {e.exit_code}"
        raise WorkerFailed(e.error_index, f"process exited ({how})") from None
    finally:
        del store
