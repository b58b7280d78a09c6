"""One run dir, one job: a job holds an exclusive lock on its run dir for its lifetime, and
Hydra's own files reach the run dir's .hydra/ only once the start is accepted, so a refused start
(the dir is in use, a config error, a refused resume) leaves an earlier run's files
byte-identical.

Hydra writes config.yaml, hydra.yaml and overrides.yaml before gradsync runs: conf/config.yaml
points hydra.output_subdir at `staging_name()`, a dir of this process's own, which
`Claim.accept` turns into .hydra/ and which is removed otherwise. The lock is an flock on
`LOCK` in the run dir, removed when the job ends (a lock file left by a killed job is taken
over by the next one).
"""

from __future__ import annotations

import fcntl
import os
import shutil
import socket
from pathlib import Path
from types import TracebackType

LOCK = ".gradsync.lock"
HYDRA = ".hydra"
STAGING = ".hydra-pending-"


def staging_name() -> str:
    """hydra.output_subdir of this process's start."""
    return f"{STAGING}{os.getpid()}"


class RunDirBusy(RuntimeError):
    """Another job holds the run dir."""


class Claim:
    """``with Claim(run_dir, staged, lock=True) as claim: ... claim.accept()``: the lock is
    held inside the block (RunDirBusy when another job holds it); Hydra's staged files become
    .hydra/ at accept() and are removed if the block ends without it."""

    def __init__(self, run_dir: Path, staged: Path | None, lock: bool):
        self.run_dir, self.staged, self.lock = run_dir, staged, lock
        self.fd: int | None = None

    def __enter__(self) -> Claim:
        if self.lock:
            try:
                self.fd = take(self.run_dir / LOCK)
            except RunDirBusy:
                self.discard()
                raise
        return self

    def accept(self) -> None:
        """The start goes ahead: its Hydra files replace the run dir's .hydra/ (a resumed run
        records the config it continues with), and stale staging dirs of starts that were
        killed go."""
        staged, self.staged = self.staged, None
        if staged is None or not staged.is_dir():
            return
        final = self.run_dir / HYDRA
        old = staged.with_name(staged.name + "-old")
        if final.exists():
            shutil.rmtree(old, ignore_errors=True)
            os.replace(final, old)
        os.replace(staged, final)
        for stale in self.run_dir.glob(f"{STAGING}*"):  # `old` among them
            shutil.rmtree(stale, ignore_errors=True)

    def discard(self) -> None:
        if self.staged is not None:
            shutil.rmtree(self.staged, ignore_errors=True)
            self.staged = None

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.discard()
        if self.fd is not None:
            let_go(self.run_dir / LOCK, self.fd)
            self.fd = None


def take(path: Path, holder: str = "job", key: str = "hydra.run.dir") -> int:
    """An flock on `path`, as a descriptor (RunDirBusy, naming the `holder` kind and the `key`
    to change, when another process holds it). A holder removes the file before it lets go
    (let_go), so a lock won on a file that is no longer at `path` is worthless: try again."""
    while True:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o666)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            owner = os.read(fd, 200).decode(errors="replace").strip() or "starting"
            os.close(fd)
            raise RunDirBusy(f"{path.parent} is in use by another {holder} ({owner}): wait "
                             f"for it to end, or choose another {key}") from None
        try:
            same = os.stat(path).st_ino == os.fstat(fd).st_ino
        except FileNotFoundError:
            same = False
        if same:
            os.ftruncate(fd, 0)
            os.write(fd, f"pid {os.getpid()} on {socket.gethostname()}\n".encode())
            return fd
        os.close(fd)


def let_go(path: Path, fd: int) -> None:
    """Release a lock `take` gave: the file goes first, while still held (see take)."""
    path.unlink(missing_ok=True)
    os.close(fd)


def remove_if_unused(run_dir: Path) -> None:
    """A start refused for its config leaves no half-made dir behind: the dir goes if it holds
    nothing but what this start's Hydra put there (staged files, the job's log file, the
    lock)."""
    if run_dir.is_dir() and all(p.name in (HYDRA, LOCK) or p.name.startswith(STAGING)
                                or p.suffix == ".log" for p in run_dir.iterdir()):
        shutil.rmtree(run_dir, ignore_errors=True)
