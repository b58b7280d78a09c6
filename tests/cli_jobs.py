"""Real `python -m gradsync.run.main` jobs, each in its own session (a terminal's process group),
with every process it starts recorded while it runs: stopped by a signal, killed by SIGKILL at a
chosen moment, or left to finish. The autouse fixture in conftest.py kills whatever a failing
test left running."""

from __future__ import annotations

import json
import os
import signal
import stat
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

MAIN = ("-m", "gradsync.run.main")
STARTED: list[Job] = []


class Job:
    """`python <launcher> [hydra.run.dir=<run_dir>] <args>`; run_dir is where it writes (named
    on the command line unless name_run_dir is false: a SLURM job names its own)."""

    def __init__(self, run_dir: Path, args: list[str], env: dict, *,
                 launcher: tuple[str, ...] = MAIN, preexec_fn=None, cwd: Path | None = None,
                 name_run_dir: bool = True):
        self.run_dir = run_dir
        self.proc = subprocess.Popen(
            [sys.executable, *launcher, *([f"hydra.run.dir={run_dir}"] if name_run_dir else []),
             *args],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=cwd,
            start_new_session=True, preexec_fn=preexec_fn)
        self.seen: dict[int, float] = {}  # pid -> create_time of every descendant
        STARTED.append(self)

    def _record(self) -> None:
        try:
            for child in psutil.Process(self.proc.pid).children(recursive=True):
                self.seen.setdefault(child.pid, child.create_time())
        except psutil.Error:
            pass

    def step(self) -> int:
        """The last optimizer step metrics.jsonl holds (0: none yet)."""
        path = self.run_dir / "metrics.jsonl"
        lines = path.read_text().splitlines() if path.exists() else []
        for line in reversed(lines):
            try:
                return json.loads(line)["step"]
            except ValueError:
                continue  # a row being written
        return 0

    def wait_for_step(self, step: int, timeout: float = 240) -> int:
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            self._record()
            now = self.step()
            if now >= step:
                return now
            assert self.proc.poll() is None, f"job ended before step {step}: {self.finish()}"
            time.sleep(0.01)
        raise AssertionError(f"step {step} not reached in {timeout}s")

    def kill_9_when(self, marker: Path, timeout: float = 240) -> None:
        """SIGKILL the job's whole session (no chance to clean up) as soon as `marker` exists
        (a checkpoint's sidecar)."""
        end = time.monotonic() + timeout
        while not marker.exists():
            self._record()
            assert self.proc.poll() is None and time.monotonic() < end, self.finish()
            time.sleep(0.005)
        os.killpg(self.proc.pid, signal.SIGKILL)
        code, _, _ = self.finish()
        assert code == -signal.SIGKILL

    def finish(self, timeout: float = 240) -> tuple[int, str, str]:
        out, err = self.proc.communicate(timeout=timeout)
        return self.proc.returncode, out, err

    def survivors(self, wait: float = 10) -> list[int]:
        """Recorded processes still running after the job ended (zombies count as gone)."""
        end = time.monotonic() + wait
        while True:
            alive = []
            for pid, created in self.seen.items():
                try:
                    p = psutil.Process(pid)
                    if p.create_time() == created and p.status() != psutil.STATUS_ZOMBIE:
                        alive.append(pid)
                except psutil.NoSuchProcess:
                    pass
            if not alive or time.monotonic() > end:
                return alive
            time.sleep(0.2)

    def worker_pid(self, rank: int) -> int:
        text = (self.run_dir / "logs" / f"rank{rank}.log").read_text()
        up = text.split(f"rank {rank}/2 up: ")[-1].splitlines()[0]
        return int(up.split("pid=")[1])


def start_job(run_dir: Path, args: list[str], env: dict) -> Job:
    return Job(run_dir, args, env)


def kill_9_when(job: Job, marker: Path, timeout: float = 240) -> None:
    job.kill_9_when(marker, timeout)


def kill_started_jobs() -> None:
    """Kill every job a test started that still runs (with the processes of its session)."""
    while STARTED:
        job = STARTED.pop()
        if job.proc.poll() is None:
            os.killpg(job.proc.pid, signal.SIGKILL)
            job.proc.communicate()


def fake_scontrol(tmp: Path, code: int = 0) -> tuple[Path, Path]:
    """A directory holding an `scontrol` that records its arguments; and the record."""
    bin_dir, record = tmp / "bin", tmp / "scontrol.calls"
    bin_dir.mkdir(exist_ok=True)
    script = bin_dir / "scontrol"
    script.write_text(f'#!/bin/sh\necho "$@" >> {record}\nexit {code}\n')
    script.chmod(script.stat().st_mode | stat.S_IXUSR)
    return bin_dir, record


def entry_point_error(argv: list[str], cwd: Path, tmp_path: Path, monkeypatch, capsys) -> str:
    """gradsync-train's one line for a command line Hydra cannot compose, run in this process
    (nothing is started): exit code 2, one line, no run dir."""
    from gradsync.run import main as entry

    monkeypatch.chdir(cwd)
    monkeypatch.syspath_prepend(str(cwd))  # as the entry point does for the directory it runs in
    monkeypatch.setenv("HYDRA_FULL_ERROR", "0")  # the entry point sets it: restored afterwards
    for key in list(os.environ):  # not a rank of anything (the suite may run inside a SLURM job)
        if key.startswith("SLURM_") or key in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
            monkeypatch.delenv(key)
    run_dir = tmp_path / "run"
    monkeypatch.setattr(sys, "argv", ["gradsync-train", *argv, f"hydra.run.dir={run_dir}"])
    with pytest.raises(SystemExit) as exit_:
        entry.main()
    assert exit_.value.code == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1, lines
    assert not run_dir.exists()
    return lines[0].removeprefix("gradsync: config error: ")
