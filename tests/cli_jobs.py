"""A real `python -m gradsync.run.main` job, killed by SIGKILL (the job and its workers, no chance
to clean up) at a chosen moment: for the exact-resume tests of policies that average."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path


def start_job(run_dir: Path, args: list[str], env: dict[str, str]) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "gradsync.run.main", f"hydra.run.dir={run_dir}", *args],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
        start_new_session=True)


def kill_9_when(job: subprocess.Popen, marker: Path, timeout: float = 240) -> None:
    """SIGKILL the job's whole session as soon as `marker` exists (a checkpoint's digest file)."""
    try:
        end = time.monotonic() + timeout
        while not marker.exists():
            assert job.poll() is None and time.monotonic() < end, job.communicate()
            time.sleep(0.005)
        os.killpg(job.pid, signal.SIGKILL)
    finally:
        if job.poll() is None:
            os.killpg(job.pid, signal.SIGKILL)
        job.communicate()
    assert job.returncode == -signal.SIGKILL
