"""Faults: stopping together after a SIGTERM or SIGINT (a cluster's preemption, a Ctrl-C), and
naming the rank that failed first.

A signal only sets a flag in the process that gets it; ranks get it at different moments (or
only some get it), so they must agree on the optimizer step after which all of them stop and
checkpoint. A blocking all-reduce of the flag after every step puts a round trip on the hot path;
instead a rank launches an asynchronous all-reduce (MAX) of its flag at the end of a step and
waits for it at the end of the next one, when it has long completed. Even so, a gloo collective
costs about 0.6 ms of CPU per rank on a busy 2-core machine, 15 % of a 4 ms step; so the ranks
launch one every `stride` steps, where the stride aims at one agreement per `interval_s` of
training. The stride comes from the step time carried by the agreement itself (MAX over ranks),
so every rank computes the same stride and launches at the same steps. All ranks read the same
flag at the same step and stop together, at most about interval_s + one step after the signal.
It runs on a separate gloo group, so with nccl the flag never syncs the GPU.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import time
from typing import Any, NoReturn

import torch
import torch.distributed as dist

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)


class StopFlag:
    """The signal this process received (0: none). Repeated signals change nothing: escalating
    (a second Ctrl-C kills) is the launcher's job, which sees every worker."""

    def __init__(self) -> None:
        self.signum = 0

    def install(self, signals: tuple[int, ...] = STOP_SIGNALS) -> None:
        for sig in signals:
            signal.signal(sig, self._handle)

    def _handle(self, signum: int, frame: Any) -> None:
        self.signum = self.signum or signum


class StopAgreement:
    """Asked once per optimizer step, on every rank: returns the agreed signal number (0 means
    go on)."""

    def __init__(self, flag: StopFlag, group: Any, world_size: int, interval_s: float = 0.1):
        self.flag, self.group, self.world_size = flag, group, world_size
        self.interval_s = interval_s
        self.agreed = 0
        self.stride = 1  # steps between launches; 1 until a step time is known
        self._buf = torch.zeros(2, dtype=torch.float64)  # [signal, seconds per step]
        self._work: Any = None
        self._since = 0  # steps since the last launch
        self._launched = time.perf_counter()

    def poll(self) -> int:
        if self.world_size == 1:
            self.agreed = self.flag.signum
            return self.agreed
        self._since += 1
        if self._work is not None:
            self._work.wait()
            self._work = None
            signum, step_s = self._buf.tolist()
            self.agreed = int(signum)
            if self.agreed:
                return self.agreed
            self.stride = max(1, int(self.interval_s / step_s)) if step_s > 0 else 1
        if self._since >= self.stride:
            now = time.perf_counter()
            step_s = (now - self._launched) / self._since
            self._buf = torch.tensor([float(self.flag.signum), step_s], dtype=torch.float64)
            self._work = dist.all_reduce(self._buf, op=dist.ReduceOp.MAX, group=self.group,
                                         async_op=True)
            self._since, self._launched = 0, now
        return 0

    def close(self) -> None:
        """Complete the collective in flight (every rank has one) before the group goes."""
        if self._work is not None:
            self._work.wait()
            self._work = None


# The process's own flag: signal handlers are per process (workers install it at start).
PROCESS_FLAG = StopFlag()


def process_stat(pid: int) -> list[str]:
    """The fields of /proc/<pid>/stat after the command name (so [0] is the state letter, T:
    stopped; [19] the start time in clock ticks since boot); [] when there is no such process."""
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return []


def signal_name(signum: int) -> str:
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"


# A spawned rank's end of its private pipe to the launcher (None under torchrun): the first error
# a rank raises goes there as text, never through the job's TCPStore, which any local user can
# reach, and never pickled.
_report: Any = None
MAX_REPORT = 2000  # characters: one line of an error, well under a pipe's atomic write


def report_to(conn: Any) -> None:
    global _report
    _report = conn


def report_failure(exc: BaseException) -> None:
    """Tell the launcher this rank's error, with the moment it was raised (CLOCK_MONOTONIC,
    one clock for every process of the host): the rank that raised first is the cause, ranks
    that fail afterwards because a peer went away are consequences. Once per process."""
    global _report
    conn, _report = _report, None
    if conn is None:
        return
    lines = [ln.strip() for ln in str(exc).splitlines() if ln.strip()]
    message = f"{type(exc).__name__}: {lines[0]}" if lines else type(exc).__name__
    try:
        conn.send_bytes(f"{time.monotonic_ns()}\n{message[:MAX_REPORT]}".encode())
        conn.close()
    except OSError:  # the launcher may be gone: the original error matters more
        pass


def exit_now(code: int) -> NoReturn:
    """End a rank that failed at once, its logs and report out, without tearing down what it
    built. Freeing a failed rank's DDP model can deadlock in torch's gloo process group: its
    destructor, on the main thread and holding the GIL, waits for a loop thread that is freeing
    a collective a peer has just completed, which needs the GIL (seen about one run in six of a
    failing sweep job). The process's exit frees everything."""
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(code)


def read_report(conn: Any) -> tuple[int, str] | None:
    """(when, message) a rank reported on a pipe that is ready to read, or None when it was
    closed without one: read as text only."""
    try:
        when, message = conn.recv_bytes(4 * MAX_REPORT + 64).decode(errors="replace").split(
            "\n", 1)
        return int(when), message
    except (EOFError, OSError, ValueError):
        return None
