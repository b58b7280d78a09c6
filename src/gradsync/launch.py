"""Start a job's workers: spawn trainer.devices processes that meet at a TCPStore this process
holds on a free port (no fixed 29500, no port race), or, when an outside engine already started
one process per rank (torchrun, or a submitit job of several tasks), be one of the workers.

The launcher then watches the workers it spawned. When one fails, the others get a few seconds
to exit on their own (a peer that went away breaks their next collective) and are then killed:
no rank is left waiting in a collective, and the job ends with the rank that failed first and
its error. A SIGTERM or SIGINT it receives goes to every worker (as SIGTERM), which finish the
optimizer step, checkpoint and exit together (see faults.py); a second one kills them.
"""

from __future__ import annotations

import multiprocessing
import multiprocessing.connection
import os
import pickle
import signal
import sys
import threading
import time
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any

import torch.distributed as dist
import torch.multiprocessing as mp

from gradsync.faults import first_failure, signal_name
from gradsync.settings import RunConfig
from gradsync.slurm import PREEMPT_SIGNALS, watched_signals
from gradsync.worker import worker_main

GRACE_S = 5.0  # after a rank fails, how long the others get to exit before they are killed


class WorkerFailed(RuntimeError):
    def __init__(self, rank: int, message: str):
        super().__init__(f"rank {rank} failed: {message}")
        self.rank = rank


class Interrupted(RuntimeError):
    """Stopped by a signal before the workers could checkpoint (or aborted by a second one)."""

    def __init__(self, signum: int, message: str):
        super().__init__(message)
        self.signum = signum


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


def launch(cfg: RunConfig, run_dir: Path) -> None:
    if under_torchrun():
        rank = int(os.environ["RANK"])
        try:
            worker_main(rank, int(os.environ["WORLD_SIZE"]), cfg, str(run_dir), store_port=None)
        except Exception as e:  # the traceback is in logs/rank<r>.log
            raise WorkerFailed(rank, _last_line(f"{type(e).__name__}: {e}")) from None
        return
    world = cfg.trainer.devices
    timeout = timedelta(seconds=cfg.trainer.timeout_s)
    store = dist.TCPStore("127.0.0.1", 0, world, is_master=True, wait_for_workers=False,
                          timeout=timeout)
    _standard_start_method()
    watch = Watch()
    watching = threading.current_thread() is threading.main_thread()  # signals: main only
    previous = ({sig: signal.signal(sig, watch.on_signal) for sig in watched_signals()}
                if watching else {})
    try:
        # Workers inherit an ignored SIGINT (through exec) until they install their handler: a
        # Ctrl-C while they import prints no tracebacks. The launcher forwards it as SIGTERM.
        if watching:
            signal.signal(signal.SIGINT, signal.SIG_IGN)
        try:
            ctx = mp.start_processes(worker_main, args=(world, cfg, str(run_dir), store.port),
                                     nprocs=world, start_method="spawn", join=False)
        finally:
            if watching:
                signal.signal(signal.SIGINT, watch.on_signal)
        watch.supervise(ctx, store)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        del store


class Watch:
    def __init__(self) -> None:
        self.procs: list[Any] = []
        self.signum = 0
        self.aborted = False
        self.killed: set[int] = set()  # ranks this launcher killed
        self.exit_order: list[int] = []

    def on_signal(self, signum: int, frame: Any) -> None:
        if not self.signum:
            self.signum = signum
            print(f"gradsync: {signal_name(signum)}: finishing the optimizer step, then "
                  "checkpointing (send it again to abort)", file=sys.stderr, flush=True)
            self._send(self.forwarded)
        else:
            self.aborted = True
            self._kill_all()

    @property
    def forwarded(self) -> int:
        """What the workers get: SIGTERM, or SLURM's preemption warning as it came (they
        record it, and the job then requeues itself)."""
        return self.signum if self.signum in PREEMPT_SIGNALS else signal.SIGTERM

    def _send(self, signum: int) -> None:
        for proc in self.procs:
            if proc.exitcode is None:
                try:
                    os.kill(proc.pid, signum)
                except ProcessLookupError:
                    pass

    def _kill_all(self) -> None:
        for rank, proc in enumerate(self.procs):
            if proc.exitcode is None:
                proc.kill()
                self.killed.add(rank)

    def supervise(self, ctx: Any, store: Any) -> None:
        self.procs = ctx.processes
        if self.signum:  # arrived while the workers were being started
            self._send(self.forwarded)
        failed_at = None
        while True:
            for rank, proc in enumerate(self.procs):
                if proc.exitcode is not None and rank not in self.exit_order:
                    self.exit_order.append(rank)
            alive = [p for p in self.procs if p.exitcode is None]
            if not alive:
                break
            if failed_at is None and any(self.procs[r].exitcode for r in self.exit_order):
                failed_at = time.monotonic()
            if failed_at is not None and time.monotonic() - failed_at > GRACE_S:
                self._kill_all()
            multiprocessing.connection.wait([p.sentinel for p in alive], timeout=0.5)
        for proc in self.procs:
            proc.join()
        failed = [r for r in self.exit_order if self.procs[r].exitcode]
        if self.aborted:
            raise Interrupted(self.signum, f"aborted by a second {signal_name(self.signum)}: "
                              "workers killed; resume=auto continues from the newest intact "
                              "checkpoint")
        if failed:
            rank, message = self._root_cause(failed, ctx.error_files, store)
            if self.signum:
                raise Interrupted(self.signum, f"stopped by {signal_name(self.signum)} before "
                                  f"the workers could checkpoint (rank {rank}: {message})")
            raise WorkerFailed(rank, message)

    def _root_cause(self, failed: list[int], error_files: list[str],
                    store: Any) -> tuple[int, str]:
        """A rank that died (a signal, an exit without a Python error) comes first: the others'
        errors follow from it. Otherwise the first rank that raised (recorded in the store)."""
        raised = {r for r in failed if os.access(error_files[r], os.R_OK)}
        for rank in failed:
            if rank not in raised and rank not in self.killed:
                code = self.procs[rank].exitcode
                how = (f"killed by {signal_name(-code)}" if code < 0 else f"exit code {code}")
                return rank, f"process exited ({how})"
        first = first_failure(store)
        if first is not None:
            return first
        rank = next(iter(sorted(raised)), failed[0])
        if rank in raised:
            with open(error_files[rank], "rb") as fh:
                return rank, _last_line(pickle.load(fh))
        return rank, f"process exited (exit code {self.procs[rank].exitcode})"
