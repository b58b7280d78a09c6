"""A rank dies with its launcher, whatever ends the launcher and whenever.

The launcher hands its own pid to the ranks it starts, in the environment (``ENV``). The first
thing a rank does, forked or spawned, is ``bind``: it asks the kernel for SIGKILL the moment
its parent ends (PR_SET_PDEATHSIG), then checks that its parent still is the launcher; a rank
whose launcher ended before it could ask (a spawned rank spends its first seconds importing)
has been handed to another parent and exits at once. A spawned rank binds while the package
``gradsync`` is first imported (``gradsync/__init__.py``), before torch, Hydra or anything of
the job; a forked one at the top of its entry point. So a launcher killed by any signal, at
any moment of the start-up or of training, leaves no rank behind: a rank it started is either
dead with it or exits before doing anything. The kernel's SIGKILL leaves the rank no chance to
checkpoint (a stop with a checkpoint is a SIGTERM or SIGINT to the launcher, which forwards
it); everything a rank holds (its descriptors, the run dir's lock, its shared memory) is the
kernel's to release.

Standard library only: it runs before anything else of gradsync is imported.
"""

from __future__ import annotations

import os
import signal
import sys

ENV = "GRADSYNC_LAUNCHER"  # the launcher's pid, in the environment of the ranks it starts
PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


def bind(launcher: int) -> None:
    """Die with `launcher`, this process's parent: SIGKILL from the kernel when it ends, and an
    immediate exit if it has ended already."""
    if sys.platform.startswith("linux"):
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"prctl(PR_SET_PDEATHSIG): {os.strerror(err)}")
    if os.getppid() != launcher:  # the launcher ended before the request: an orphan already
        try:
            print(f"gradsync: rank {os.getpid()} exits: its launcher (pid {launcher}) has "
                  "ended", file=sys.stderr, flush=True)
        finally:
            os._exit(1)


def bind_loader_worker(rank: int, worker_id: int) -> None:
    """A data loader's worker_init_fn (with functools.partial): its worker dies with `rank`,
    the process that started it."""
    bind(rank)


def bind_from_environment() -> None:
    """In a process a launcher started as a rank (``ENV`` set): bind to that launcher, and take
    ``ENV`` out of the environment, so that this rank's own children (data loader workers)
    are not taken for ranks."""
    launcher = os.environ.pop(ENV, None)
    if launcher is not None and launcher.isdigit():
        bind(int(launcher))
