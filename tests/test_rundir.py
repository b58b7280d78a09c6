"""run/rundir.py in this process: the run dir's lock (flock: a second open file description is
refused as another job's would be), Hydra's staged files becoming .hydra/ only when a start is
accepted, and a refused start leaving no half-made dir. (Two real jobs meeting at one run dir:
tests/test_faults.py.)"""

from __future__ import annotations

import os
import socket

import pytest

from gradsync.run import rundir
from gradsync.run.rundir import LOCK, Claim, RunDirBusy


def staged_config(run_dir, name: str, text: str):
    staged = run_dir / name
    staged.mkdir(parents=True)
    (staged / "config.yaml").write_text(text)
    return staged


def test_the_lock_names_its_holder_and_refuses_a_second_taker(tmp_path):
    path = tmp_path / LOCK
    fd = rundir.take(path)
    try:
        assert path.read_text() == f"pid {os.getpid()} on {socket.gethostname()}\n"
        with pytest.raises(RunDirBusy) as busy:
            rundir.take(path, holder="sweep", key="hydra.sweep.dir")
        assert str(busy.value) == (f"{tmp_path} is in use by another sweep (pid {os.getpid()} on "
                                   f"{socket.gethostname()}): wait for it to end, or choose "
                                   "another hydra.sweep.dir")
    finally:
        rundir.let_go(path, fd)
    assert not path.exists()  # the file goes while still held
    fd = rundir.take(path)  # free again
    rundir.let_go(path, fd)


def test_a_lock_file_left_by_a_killed_job_is_taken_over(tmp_path):
    (tmp_path / LOCK).write_text("pid 1 on elsewhere\n")  # nobody holds its flock
    fd = rundir.take(tmp_path / LOCK)
    try:
        assert (tmp_path / LOCK).read_text().startswith(f"pid {os.getpid()} ")
    finally:
        rundir.let_go(tmp_path / LOCK, fd)


def test_an_accepted_start_replaces_hydra_files_and_removes_stale_staging(tmp_path):
    (tmp_path / ".hydra").mkdir()
    (tmp_path / ".hydra" / "config.yaml").write_text("seed: 1\n")
    stale = staged_config(tmp_path, rundir.STAGING + "999999", "killed start\n")
    staged = staged_config(tmp_path, rundir.staging_name(), "seed: 2\n")
    with Claim(tmp_path, staged, lock=True) as claim:
        assert (tmp_path / LOCK).exists()
        claim.accept()
    assert (tmp_path / ".hydra" / "config.yaml").read_text() == "seed: 2\n"
    assert not staged.exists() and not stale.exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == [".hydra"]  # the lock went at exit


def test_a_refused_start_leaves_the_earlier_runs_files_byte_identical(tmp_path):
    (tmp_path / ".hydra").mkdir()
    (tmp_path / ".hydra" / "config.yaml").write_bytes(b"seed: 1\n")
    staged = staged_config(tmp_path, rundir.staging_name(), "seed: 2\n")
    with pytest.raises(ValueError), Claim(tmp_path, staged, lock=True):
        raise ValueError("a config error")  # the block ends without accept()
    assert (tmp_path / ".hydra" / "config.yaml").read_bytes() == b"seed: 1\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == [".hydra"]


def test_a_busy_run_dir_discards_the_staged_files(tmp_path):
    fd = rundir.take(tmp_path / LOCK)  # another job's
    try:
        staged = staged_config(tmp_path, rundir.staging_name(), "seed: 2\n")
        with pytest.raises(RunDirBusy, match="is in use by another job"):
            Claim(tmp_path, staged, lock=True).__enter__()
        assert not staged.exists()
        assert sorted(p.name for p in tmp_path.iterdir()) == [LOCK]
    finally:
        rundir.let_go(tmp_path / LOCK, fd)


def test_only_a_dir_holding_nothing_but_this_starts_files_is_removed(tmp_path):
    fresh = tmp_path / "fresh"
    staged_config(fresh, rundir.staging_name(), "seed: 2\n")
    (fresh / "main.log").write_text("")
    (fresh / LOCK).write_text("")
    rundir.remove_if_unused(fresh)
    assert not fresh.exists()
    used = tmp_path / "used"
    staged_config(used, ".hydra", "seed: 1\n")
    (used / "summary.json").write_text("{}")
    rundir.remove_if_unused(used)
    assert sorted(p.name for p in used.iterdir()) == [".hydra", "summary.json"]
