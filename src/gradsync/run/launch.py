"""Start a job's workers: spawn trainer.devices processes that meet at a TCPStore this process
holds on a free port of 127.0.0.1 (no fixed 29500, no port race, no other host), or, when an
outside engine already started one process per rank (torchrun, or a submitit job of several
tasks), be one of the workers.

The launcher then watches the workers it spawned. When one fails, the others get a few seconds
to exit on their own (a peer that went away breaks their next collective) and are then killed
(a stopped one at once): no rank is left waiting in a collective, and the job ends with the rank
that failed first and its error, which each rank reports through a pipe of its own (text: no
error file anyone could plant, nothing unpickled, nothing read from the store, which every local
user can reach). A SIGTERM or SIGINT it receives goes to every worker (as SIGTERM), which finish
the optimizer step, checkpoint and exit together (see faults.py); a second one kills them.

Nothing outlives the launcher: every rank dies with it, however it ends (core/lifeline.py), and one
that has not ended when the launcher returns or raises is killed first (Watch.close). Every
rank holds the run dir's lock (rundir.py) for its whole life, inherited from the launcher (a
forked rank has its descriptor; a spawned one gets it passed), so no other job starts in the
run dir while any process of this one lives.
"""

from __future__ import annotations

import json
import logging
import multiprocessing
import multiprocessing.connection
import os
import re
import signal
import socket
import sys
import threading
import time
from datetime import datetime, timedelta
from multiprocessing import reduction
from pathlib import Path
from typing import Any

import torch.distributed as dist

from gradsync.config.schema import RunConfig
from gradsync.core.lifeline import ENV as LAUNCHER_ENV
from gradsync.core.lifeline import bind_from_environment
from gradsync.core.numerics import worker_environment
from gradsync.run.faults import (
    exit_now,
    process_stat,
    read_report,
    report_failure,
    report_to,
    signal_name,
)
from gradsync.run.network import (
    Link,
    NetworkConfig,
    ShapedNetwork,
    hop_latency,
    inside,
    local_section,
)
from gradsync.run.placement import Placement, env_launched
from gradsync.run.slurm import PREEMPT_SIGNALS, watched_signals
from gradsync.run.worker import worker_main

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


def adopt_submitit_ranks() -> None:
    """In a submitit job of several tasks (SLURM, or submitit's local executor) each task is one
    rank: export the env:// variables torchrun would set (RANK, WORLD_SIZE, LOCAL_RANK,
    LOCAL_WORLD_SIZE, MASTER_ADDR = the job's first node, MASTER_PORT = MASTER_PORT if set, else
    one drawn from the job id), so the task runs exactly like a torchrun rank. A job of one task
    is left alone: it spawns trainer.devices workers itself."""
    if "SUBMITIT_EXECUTOR" not in os.environ or env_launched():
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
    if not env_launched():
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


def launch(cfg: RunConfig, placement: Placement, run_dir: Path,
           lock: int | None = None,
           network: NetworkConfig | None = None) -> tuple[int, dict[str, Any]]:
    """Train; returns the signal this launcher received that stopped the job (0: none), which
    the workers, who got it forwarded as SIGTERM, cannot know, and the run's summary (rank 0's;
    {} on the other env:// ranks). lock: the descriptor of the run dir's lock this process
    holds, which every rank it starts holds too. network=shaped: the ranks on links of their
    own (run/network.py), made here and removed when this returns or raises."""
    if not placement.spawns:  # this process is one rank
        try:
            summary = worker_main(placement, cfg, str(run_dir), store_port=None)
        except Exception as e:  # the traceback is in logs/rank<r>.log
            raise WorkerFailed(placement.rank, _last_line(f"{type(e).__name__}: {e}")) from None
        return 0, summary if placement.rank == 0 else {}
    network = network or NetworkConfig()
    if not network.shaped:
        signum, summary = _launch(cfg, placement, run_dir, lock, None)
        if summary:
            summary["network"] = local_section(network)
        return signum, summary
    with ShapedNetwork(network, placement.world_size) as net:
        signum, summary = _launch(cfg, placement, run_dir, lock, net)
        if summary:  # the links' counters, read before the links go
            summary["network"] = net.section(summary)
    return signum, summary


def _launch(cfg: RunConfig, placement: Placement, run_dir: Path, lock: int | None,
            net: ShapedNetwork | None) -> tuple[int, dict[str, Any]]:
    world = placement.world_size
    timeout = timedelta(seconds=cfg.trainer.timeout_s)
    if net is None:
        store, host = loopback_store(world, timeout), "127.0.0.1"
    else:  # in rank 0's namespace, at its address: the rendezvous crosses the links
        rank0 = net.links[0]
        store = inside(rank0.netns, lambda: loopback_store(world, timeout, rank0.address))
        host = rank0.address
    _standard_start_method()
    watch = Watch(cfg.trainer.timeout_s)
    watching = threading.current_thread() is threading.main_thread()  # signals: main only
    previous = ({sig: signal.signal(sig, watch.on_signal) for sig in watched_signals()}
                if watching else {})
    try:
        # Workers inherit an ignored SIGINT (through exec) until they install their handler: a
        # Ctrl-C while they import prints no tracebacks. The launcher forwards it as SIGTERM.
        if watching:
            signal.signal(signal.SIGINT, signal.SIG_IGN)
        try:
            watch.start(placement, cfg, run_dir, (host, store.port), lock,
                        net.links if net is not None else None)
        finally:
            if watching:
                signal.signal(signal.SIGINT, watch.on_signal)
        watch.supervise()
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        watch.close()
        del store
    return watch.signum, watch.summary


def loopback_store(world: int, timeout: timedelta, host: str = "127.0.0.1") -> dist.TCPStore:
    """The job's TCPStore on a free port of 127.0.0.1 only (network=shaped: of rank 0's
    address, in its namespace): a TCPStore server asked for "127.0.0.1" listens on every
    interface; one handed a socket bound here listens on it. The store only serves the
    rendezvous; what a rank reports goes through its own pipe."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        sock.bind((host, 0))
        sock.listen(128)
        store = dist.TCPStore(host, sock.getsockname()[1], world, is_master=True,
                              wait_for_workers=False, timeout=timeout,
                              master_listen_fd=sock.fileno(), use_libuv=True)
    except BaseException:
        sock.close()
        raise
    sock.detach()  # the store owns (and closes) the descriptor now
    return store


def start_method(placement: Placement, bits: str = "native") -> str:
    """fork for CPU workers while this process holds no CUDA context: a forked worker starts
    with what the launcher already imported (torch; the compiler stack an optimizer's
    constructor imports; gradsync), where a spawned one spends seconds importing it again; a
    sweep pays that at every job. spawn for CUDA (a forked child cannot use a CUDA context, and
    an nccl job's launcher may have touched one), for trainer.bits=portable (its pins must be in
    the environment before torch loads: core/numerics.py), or when
    GRADSYNC_START_METHOD=spawn."""
    import torch

    if os.environ.get("GRADSYNC_START_METHOD") == "spawn" or bits == "portable":
        return "spawn"
    if placement.backend == "gloo" and not torch.cuda.is_initialized():
        return "fork"
    return "spawn"


def _as_if_spawned() -> None:
    """A forked rank starts as a spawned one would: the launcher's signal handlers reset to the
    default (exec does that; an ignored signal stays ignored), and without the launcher's Hydra
    log handlers (the console, the job's train.log): a rank logs to logs/rank<r>.log. In a
    spawned rank there is nothing to undo."""
    for sig in watched_signals():
        if signal.getsignal(sig) not in (signal.SIG_IGN, signal.SIG_DFL):
            signal.signal(sig, signal.SIG_DFL)
    root = logging.getLogger()
    for handler in root.handlers[:]:
        root.removeHandler(handler)


class Inherited:
    """A descriptor every rank holds for its whole life (the run dir's lock): a forked rank has
    the launcher's already; a spawned one gets it passed when it is started (multiprocessing
    hands the descriptors its arguments name to the new process)."""

    def __init__(self, fd: int | None):
        self.fd = fd

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:  # pickled only to spawn a rank
        return (_adopt, (None if self.fd is None else reduction.DupFd(self.fd),))


def _adopt(passed: Any) -> Inherited:
    return Inherited(None if passed is None else passed.detach())


def _rank_main(placement: Placement, cfg: RunConfig, run_dir: str, store_at: tuple[str, int],
               report: Any, summary_to: Any, lock: Inherited, link: Link | None) -> None:
    """A spawned (or forked, start_method) rank. It dies with its launcher (core/lifeline.py: a
    spawned one bound itself when it first imported gradsync, a forked one does here, first),
    and holds the run dir's `lock` until it ends. Its first error goes to the launcher through
    `report`, and it exits with code 1 (the traceback is in logs/rank<r>.log); rank 0 sends the
    run's summary through `summary_to`. network=shaped: it enters its namespace (`link`) first,
    and meets the others at the store in rank 0's (`store_at`)."""
    bind_from_environment()
    _as_if_spawned()
    report_to(report)
    try:
        if link is not None:
            link.enter()
        summary = worker_main(placement, cfg, run_dir, store_port=store_at[1],
                              store_host=store_at[0],
                              probe=hop_latency if link is not None else None)
    except BaseException as e:  # whatever it was, reported with its message (faults.py)
        report_failure(e)  # if worker_main could not (an error before its own handler)
        exit_now(1)  # with the error's frames alive: nothing of the failed training is freed
    if summary_to is not None:  # rank 0: the launcher writes summary.json (run/summary.py)
        summary_to.send_bytes(json.dumps(summary).encode())
        summary_to.close()


def _ready(conn: Any) -> bool:
    """Something to read: a report, or the end of a pipe closed without one."""
    try:
        return bool(conn.poll())
    except (OSError, EOFError):
        return True  # read_report then finds nothing


def _stopped(pid: int) -> bool:
    """Stopped (SIGSTOP, a debugger): it will never exit on its own."""
    return process_stat(pid)[:1] in (["T"], ["t"])


class Watch:
    def __init__(self, timeout_s: int) -> None:
        self.timeout_s = timeout_s
        self.procs: list[Any] = []
        self.reports: list[Any] = []  # the launcher's ends of the ranks' pipes
        self.signum = 0
        self.aborted = False
        self.killed: set[int] = set()  # ranks this launcher killed
        self.stopped: set[int] = set()  # of those, ranks found stopped (SIGSTOP)
        self.exit_order: list[int] = []
        self.reported: dict[int, tuple[int, str]] = {}  # rank: (when, error) it reported
        self.unreported: set[int] = set()  # ranks whose pipe closed without a report
        self.summary: dict[str, Any] = {}  # rank 0's, once it sent it
        self.summary_from: Any = None  # the launcher's end of rank 0's summary pipe

    def start(self, placement: Placement, cfg: RunConfig, run_dir: Path,
              store_at: tuple[str, int], lock: int | None = None,
              links: list[Link] | None = None) -> None:
        """Start the ranks (start_method), each with a pipe to report its error on (text, never
        pickled: no error file in a shared temporary dir), rank 0 with one more for the run's
        summary (JSON); each with this launcher's pid in its environment (core/lifeline.py) and the
        run dir's `lock`."""
        ctx: Any = multiprocessing.get_context(start_method(placement, cfg.trainer.bits))
        os.environ[LAUNCHER_ENV] = str(os.getpid())
        try:
            for rank in range(placement.world_size):
                reader, writer = ctx.Pipe(duplex=False)
                self.reports.append(reader)
                summary_to = None
                if rank == 0:
                    self.summary_from, summary_to = ctx.Pipe(duplex=False)
                proc = ctx.Process(target=_rank_main, args=(
                    placement.for_rank(rank), cfg, str(run_dir), store_at, writer, summary_to,
                    Inherited(lock), links[rank] if links else None))
                self.procs.append(proc)
                try:
                    with worker_environment(cfg.trainer.bits):  # portable bits: the pins
                        proc.start()
                finally:
                    writer.close()  # the rank holds its own copy
                    if summary_to is not None:
                        summary_to.close()
        finally:
            os.environ.pop(LAUNCHER_ENV, None)

    def close(self) -> None:
        """Nothing this launcher started outlives it: a rank still running (the launcher is
        leaving on an error of its own, or was interrupted while starting them) is killed."""
        for _, proc in self._running():
            proc.kill()
        for proc in self.procs:
            if proc.pid is not None:
                proc.join()
        for conn in self.reports + ([self.summary_from] if self.summary_from else []):
            conn.close()

    def _read_summary(self) -> None:
        """Rank 0's summary, once it is there (JSON text)."""
        conn = self.summary_from
        if self.summary or conn is None or not _ready(conn):
            return
        try:
            self.summary = json.loads(conn.recv_bytes().decode())
        except (EOFError, OSError, ValueError):
            pass
        conn.close()
        self.summary_from = None

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

    def _running(self) -> list[tuple[int, Any]]:
        return [(rank, proc) for rank, proc in enumerate(self.procs)
                if proc.pid is not None and proc.exitcode is None]

    def _send(self, signum: int) -> None:
        for _, proc in self._running():
            try:
                os.kill(proc.pid, signum)
            except ProcessLookupError:
                pass

    def _kill(self, rank: int) -> None:
        if _stopped(self.procs[rank].pid):
            self.stopped.add(rank)
        self.procs[rank].kill()
        self.killed.add(rank)

    def _kill_all(self) -> None:
        for rank, _ in self._running():
            self._kill(rank)

    def supervise(self) -> None:
        if self.signum:  # arrived while the workers were being started
            self._send(self.forwarded)
        failed_at = None
        while True:
            for rank, proc in enumerate(self.procs):
                if proc.exitcode is not None and rank not in self.exit_order:
                    self.exit_order.append(rank)
            self._read_reports()
            self._read_summary()
            # the living from the same look as the exits: a rank that ends after the look
            # is seen ending at the next one (its sentinel is ready), never missed by both
            alive = [p for r, p in enumerate(self.procs) if r not in self.exit_order]
            if not alive:
                break
            # a rank that reported its error has failed, even if its process lingers
            if failed_at is None and (self.reported or any(self.procs[r].exitcode
                                                           for r in self.exit_order)):
                failed_at = time.monotonic()
            if failed_at is not None:
                for rank, proc in self._running():
                    if _stopped(proc.pid):
                        self._kill(rank)
                if time.monotonic() - failed_at > GRACE_S:
                    self._kill_all()
            waiting = [c for r, c in enumerate(self.reports)
                       if r not in self.reported and r not in self.unreported]
            waiting += [self.summary_from] if self.summary_from is not None else []
            multiprocessing.connection.wait([p.sentinel for p in alive] + waiting, timeout=0.5)
        for proc in self.procs:
            proc.join()
        self._read_reports()
        self._read_summary()
        failed = [r for r in self.exit_order if self.procs[r].exitcode]
        if self.aborted:
            raise Interrupted(self.signum, f"aborted by a second {signal_name(self.signum)}: "
                              "workers killed; resume=auto continues from the newest intact "
                              "checkpoint")
        if failed:
            rank, message = self._root_cause(failed)
            if self.signum:
                raise Interrupted(self.signum, f"stopped by {signal_name(self.signum)} before "
                                  f"the workers could checkpoint (rank {rank}: {message})")
            raise WorkerFailed(rank, message)
        if self.procs and not self.summary and not self.signum:  # rank 0 always sends one
            raise WorkerFailed(0, "exited (exit code 0) without the run's summary; see "
                               "logs/rank0.log")

    def _read_reports(self) -> None:
        """Take what a rank reported; a pipe closed without a report (the rank exited, or
        exec'd away from it) is not waited on again."""
        for rank, conn in enumerate(self.reports):
            if rank in self.reported or rank in self.unreported or not _ready(conn):
                continue
            report = read_report(conn)
            if report is None:
                self.unreported.add(rank)
            else:
                self.reported[rank] = report

    def _root_cause(self, failed: list[int]) -> tuple[int, str]:
        """A rank that died on its own (a signal, an exit without a Python error) comes first:
        the others' errors follow from it. Then a rank that stopped answering (stopped, or
        still running when its peers timed out): the timeouts follow from it. Otherwise the
        rank that raised first."""
        reports = self.reported
        for rank in failed:
            if rank not in reports and rank not in self.killed:
                code = self.procs[rank].exitcode
                how = (f"killed by {signal_name(-code)}" if code < 0 else f"exit code {code}")
                return rank, f"process exited ({how})"
        first = min(reports, key=lambda r: reports[r][0], default=None)
        timed_out = first is not None and re.search(r"time ?out|timed out",
                                                    reports[first][1], re.I) is not None
        silent = sorted(self.stopped or (self.killed - reports.keys() if timed_out else ()))
        if silent:
            how = ("its process was stopped (as by SIGSTOP)" if silent[0] in self.stopped
                   else "it was still running")
            peers = (f"; rank {first} gave up after trainer.timeout_s={self.timeout_s}: "
                     f"{reports[first][1]}" if first is not None else "")
            return silent[0], f"stopped answering: {how}{peers}"
        if first is not None:
            return first, reports[first][1]
        return failed[0], f"process exited (exit code {self.procs[failed[0]].exitcode})"
