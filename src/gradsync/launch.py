"""Start a job's workers: spawn trainer.devices processes that meet at a TCPStore this process
holds on a free port (no fixed 29500, no port race), or, when an outside engine already started
one process per rank (torchrun, or a submitit job of several tasks), be one of the workers."""

from __future__ import annotations

import multiprocessing
import os
from datetime import datetime, timedelta
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
    """torchrun's (or any env:// launcher's) variables are set: this process is one rank."""
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def adopt_submitit_ranks() -> None:
    """In a submitit job of several tasks (SLURM, or submitit's local executor) each task is one
    rank: export the env:// variables torchrun would set (RANK, WORLD_SIZE, LOCAL_RANK,
    LOCAL_WORLD_SIZE, MASTER_ADDR = the job's first node, MASTER_PORT = MASTER_PORT if set, else
    one drawn from the job id), so the task runs exactly like a torchrun rank. A job of one task
    is left alone: it spawns trainer.devices workers itself."""
    if "SUBMITIT_EXECUTOR" not in os.environ or under_torchrun():
        return
    import submitit

    if submitit.JobEnvironment().num_tasks > 1:
        # every task sees all of its node's GPUs and picks cuda:LOCAL_RANK (worker.py)
        submitit.helpers.TorchDistributedEnvironment().export(set_cuda_visible_devices=False,
                                                              overwrite=True)


def job_rank() -> int:
    """This process's global rank when an outside engine started the ranks, else 0. Asked while
    Hydra sets a job up (before adopt_submitit_ranks ran), hence the look at submitit."""
    if "RANK" in os.environ:
        return int(os.environ["RANK"])
    if "SUBMITIT_EXECUTOR" in os.environ:
        import submitit

        return int(submitit.JobEnvironment().global_rank)
    return 0


_job_store: dist.TCPStore | None = None
_agreed: dict[str, str] = {}


def rank0_now(fmt: str) -> str:
    """datetime.now().strftime(fmt); under torchrun, rank 0's, read by every rank from the job's
    store at MASTER_ADDR:MASTER_PORT, so all ranks of a job (on every node) agree on one run dir.
    Each restart of a torchrun job gets a fresh value, hence a fresh dir."""
    now = datetime.now().strftime(fmt)
    if not under_torchrun():
        return now
    key = f"gradsync/now/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}/{fmt}"
    if key not in _agreed:
        _agreed[key] = _share_from_rank0(key, now)
    return _agreed[key]


def _share_from_rank0(key: str, value: str) -> str:
    global _job_store
    rank = int(os.environ["RANK"])
    if _job_store is None:
        # torchrun's agent hosts the store (TORCHELASTIC_USE_AGENT_STORE); otherwise rank 0
        # hosts it, multi-tenant, so init_process_group(env://) later reuses this server. Kept
        # for the life of the process: the other ranks read from it.
        agent_hosts = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
        _job_store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]),
                                   is_master=rank == 0 and not agent_hosts, multi_tenant=True,
                                   wait_for_workers=False, timeout=timedelta(seconds=300))
    if rank == 0:
        _job_store.set(key, value)
    return _job_store.get(key).decode()


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
        rank = int(os.environ["RANK"])
        try:
            worker_main(rank, int(os.environ["WORLD_SIZE"]), cfg, str(run_dir), store_port=None)
        except Exception as e:  # the traceback is in logs/rank<r>.log
            raise WorkerFailed(rank, _last_line(f"{type(e).__name__}: {e}")) from None
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
