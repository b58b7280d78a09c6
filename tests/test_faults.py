"""Faults through the real command line (python -m gradsync.run.main, real signals, real kills):
a failing worker ends the job quickly, naming its rank, and leaves no process behind; one job
per run dir; a full disk is reported as itself. (Jobs stopped by SIGTERM, Ctrl-C, kill -9 and
then resumed bitwise: tests/test_resume.py.)"""

from __future__ import annotations

import json
import multiprocessing
import os
import resource
import shlex
import signal
import socket
import subprocess
import sys
import time
from datetime import timedelta
from pathlib import Path

import psutil
import pytest
import torch.distributed as dist

from cli_jobs import Job
from configs import EXACT_RESUME, LONG_JOB
from gradsync.run import faults, launch, rundir, summary
from gradsync.train import checkpoint

pytestmark = [pytest.mark.dist]


def long_job(run_dir: Path, *args: str, env: dict, **kw) -> Job:
    """A job of configs.LONG_JOB (300 steps), with more overrides."""
    return Job(run_dir, [*LONG_JOB, *args], env, **kw)


# The launcher run as another local user would like it to run: whenever it is handed the name
# of a torch error file (pytorch-errorfile-*.pickle in $TMPDIR), the "stranger" plants a pickle
# under that name as soon as the name is free; unpickled, it creates the marker file.
PLANTING_LAUNCHER = """if True:
    import os, pickle, runpy, sys, tempfile, threading, time
    marker = sys.argv.pop(1)
    class Payload:
        def __reduce__(self):
            return (open, (marker, "w"))
    def plant(name):
        while os.path.exists(name):
            time.sleep(0.001)
        with open(name, "wb") as fh:
            pickle.dump(Payload(), fh)
    named = tempfile.NamedTemporaryFile
    def spied(*args, **kw):
        tf = named(*args, **kw)
        if kw.get("prefix") == "pytorch-errorfile-":
            threading.Thread(target=plant, args=(tf.name,), daemon=True).start()
        return tf
    tempfile.NamedTemporaryFile = spied
    runpy.run_module("gradsync.run.main", run_name="__main__")
"""


def listening_sockets(pid: int) -> list[tuple[str, int]]:
    """(local address, port) of every listening TCP socket process `pid` holds."""
    inodes = set()
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        try:
            target = os.readlink(fd)
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    found = []
    for table, size in (("tcp", 4), ("tcp6", 16)):
        for line in Path(f"/proc/net/{table}").read_text().splitlines()[1:]:
            cols = line.split()
            if cols[3] == "0A" and cols[9] in inodes:  # LISTEN
                addr, port = cols[1].split(":")
                raw = bytes.fromhex(addr)
                # /proc/net/tcp* prints each 32-bit word in host (little-endian) order
                raw = b"".join(raw[i:i + 4][::-1] for i in range(0, size, 4))
                family = socket.AF_INET if size == 4 else socket.AF_INET6
                found.append((socket.inet_ntop(family, raw), int(port, 16)))
    return found


@pytest.mark.slow
@pytest.mark.parametrize("how", ["raises", "killed", "hung"])
def test_a_failing_worker_ends_the_job_quickly_naming_the_rank(tmp_path, cli_env, how):
    """raises: rank 1 raises while a stranger, connected to the job's store, has written a
    failure of its own there; killed: rank 0 dies by SIGKILL while rank 1 is stopped, and a
    stranger plants pickles under the names of torch's error files; hung: rank 1 is stopped and
    rank 0 gives up after trainer.timeout_s."""
    run_dir, tmp = tmp_path / "run", tmp_path / "tmp"
    tmp.mkdir()
    marker = tmp_path / "payload-ran"
    env = {**cli_env, "TMPDIR": str(tmp)}
    args = {"raises": ["trainer.fail_at_step=12"], "killed": [],
            "hung": ["trainer.timeout_s=5"]}[how]
    launcher = ("-c", PLANTING_LAUNCHER, str(marker)) if how == "killed" else ("-m",
                                                                              "gradsync.run.main")
    job = long_job(run_dir, "trainer.log_every_windows=1", *args, env=env, launcher=launcher)
    job.wait_for_step(4)
    if how == "raises":  # the store listens on loopback only; what a stranger writes is ignored
        (address, port), = listening_sockets(job.proc.pid)
        stranger = dist.TCPStore("127.0.0.1", port, is_master=False, wait_for_workers=False,
                                 timeout=timedelta(seconds=30))
        stranger.add("gradsync/failures", 1)
        stranger.set("gradsync/first_failure", "0\nRuntimeError: injected by a stranger")
        del stranger
    elif how == "killed":  # rank 0 dies while rank 1 hangs (stopped): nothing will wake rank 1
        os.kill(job.worker_pid(1), signal.SIGSTOP)
        os.kill(job.worker_pid(0), signal.SIGKILL)
    else:
        os.kill(job.worker_pid(1), signal.SIGSTOP)
    failed_at = time.monotonic()
    code, _, err = job.finish()
    ended_in = time.monotonic() - failed_at
    assert code == 1, err
    line = err.strip().splitlines()[-1]
    assert err.strip().splitlines()[-2] == (f"gradsync: run dir: {run_dir} (each rank's log and "
                                            "traceback: logs/rank<r>.log)")
    if how == "raises":
        assert line == ("gradsync: training failed: rank 1 failed: RuntimeError: injected "
                        "failure after optimizer step 12 (trainer.fail_at_step, a test aid)")
        assert address == "127.0.0.1"
    elif how == "killed":
        assert line == ("gradsync: training failed: rank 0 failed: process exited (killed by "
                        "SIGKILL)")
    else:
        assert line.startswith("gradsync: training failed: rank 1 failed: stopped answering: "
                               "its process was stopped (as by SIGSTOP); rank 0 gave up after "
                               "trainer.timeout_s=5: "), line
    assert ended_in < 60, ended_in
    print(f"job ended {ended_in:.1f} s after the worker {how}")
    assert job.survivors() == []
    assert json.loads((run_dir / "summary.json").read_text())["status"] == "failed"
    assert not marker.exists()  # nothing was unpickled
    assert list(tmp.glob("pytorch-errorfile-*")) == []  # no tracebacks left in $TMPDIR


@pytest.mark.slow
def test_a_rank_that_raises_what_is_no_exception_is_reported_with_its_message(tmp_path,
                                                                             cli_env):
    """torch's CheckpointException, like any BaseException that is no Exception, escapes an
    `except Exception`: its rank's report must still carry its message (it did not: the job
    ended with "KeyError: 'status'" or "process exited (exit code 1)")."""
    env = cli_env | {"PYTHONPATH": os.pathsep.join([str(Path(__file__).parent),
                                                    cli_env.get("PYTHONPATH", "")])}
    job = Job(tmp_path / "run", [*EXACT_RESUME, "trainer.max_epochs=1",
                                 "sync._target_=components_for_tests.RaisesBaseException",
                                 "~sync.compression", "~sync.powersgd_rank",
                                 "~sync.powersgd_start_backwards", "~sync.groups",
                                 "~sync.reduce_scatter", "~sync.replica_all_reduce"], env)
    code, _, err = job.finish()
    assert code == 1, err
    line = ("gradsync: training failed: rank 1 failed: NotAnException: raised on rank 1 after "
            "window 2")
    assert err.strip().splitlines()[-1] == line and "Traceback" not in err, err
    assert json.loads((tmp_path / "run" / "summary.json").read_text()) == {
        "status": "failed", "error": line.removeprefix("gradsync: ")}
    assert job.survivors() == []


def _report_then_hang(rank: int, writer) -> None:
    faults.report_to(writer)
    if rank == 1:  # fails, and then never exits, as one stuck tearing down its process group
        faults.report_failure(RuntimeError("boom"))
    time.sleep(600)  # rank 0: waits, as in a collective its failed peer never joins


def test_a_rank_that_reported_its_error_but_never_exits_is_killed_after_the_grace_period(
        monkeypatch):
    """The launcher counts a failure from a rank's report, not only from its exit: the job ends
    GRACE_S after the report, naming the rank and its error, with every rank killed."""
    monkeypatch.setattr(launch, "GRACE_S", 1.0)  # read at each check: 1 s, not 5, of waiting
    ctx = multiprocessing.get_context("fork")
    watch = launch.Watch(timeout_s=300)
    for rank in range(2):
        reader, writer = ctx.Pipe(duplex=False)
        watch.reports.append(reader)
        watch.procs.append(ctx.Process(target=_report_then_hang, args=(rank, writer)))
        watch.procs[-1].start()
        writer.close()
    started = time.monotonic()
    try:
        with pytest.raises(launch.WorkerFailed, match="^rank 1 failed: RuntimeError: boom$"):
            watch.supervise()
    finally:
        for proc in watch.procs:
            proc.kill()
        watch.close()
    took = time.monotonic() - started
    assert launch.GRACE_S <= took < launch.GRACE_S + 3, took
    assert [proc.exitcode for proc in watch.procs] == [-signal.SIGKILL, -signal.SIGKILL]
    assert watch.killed == {0, 1}


def files(run_dir: Path) -> dict[str, bytes]:
    return {str(p.relative_to(run_dir)): p.read_bytes() for p in run_dir.rglob("*")
            if p.is_file()}


@pytest.mark.slow
def test_one_job_per_run_dir_sigint_to_the_launcher_and_files_follow_the_umask(
        tmp_path, cli_env):
    """A job (umask 077, a run dir with a space) holds its run dir: a second job there is
    refused in one line and touches nothing. A SIGINT to the launcher alone stops the job with
    exit code 130, saying SIGINT, and the printed resume command pastes into a shell. Then
    refused starts in the finished run dir leave every file byte-identical."""
    run_dir = tmp_path / "run dir"
    job = long_job(run_dir, "trainer.log_every_windows=1", "trainer.max_epochs=100000", env=cli_env,
              preexec_fn=lambda: os.umask(0o077))
    job.wait_for_step(3)
    hydra = files(run_dir / ".hydra")
    workers = [job.worker_pid(rank) for rank in (0, 1)]
    for pid in workers:  # paused: they would train on both cores while the second job starts
        os.kill(pid, signal.SIGSTOP)
    code, _, err = long_job(run_dir, "seed=12", env=cli_env).finish()
    for pid in workers:
        os.kill(pid, signal.SIGCONT)
    assert code == 2, err
    assert err.splitlines() == [
        f"gradsync: run dir in use: {run_dir} is in use by another job (pid {job.proc.pid} on "
        f"{socket.gethostname()}): wait for it to end, or choose another hydra.run.dir"]
    assert files(run_dir / ".hydra") == hydra
    assert [p.name for p in run_dir.glob(".hydra*")] == [".hydra"]  # nothing staged is left

    job.proc.send_signal(signal.SIGINT)
    code, _, err = job.finish()
    assert code == 128 + signal.SIGINT, err
    summary = json.loads((run_dir / "summary.json").read_text())
    assert (summary["status"], summary["stopped_by"]) == ("interrupted", "SIGINT")
    assert f"stopped by SIGINT after optimizer step {summary['optimizer_steps']}" in err
    hint = next(ln for ln in err.splitlines() if "continue with:" in ln)
    command = hint.split("continue with:")[1].split("(and the same overrides)")[0]
    assert shlex.split(command) == ["gradsync-train", "resume=auto", f"hydra.run.dir={run_dir}"]
    assert job.survivors() == []
    modes = {str(p.relative_to(run_dir)): p.stat().st_mode & 0o777 for p in run_dir.rglob("*")}
    assert set(modes.values()) == {0o600, 0o700} and run_dir.stat().st_mode & 0o777 == 0o700
    assert all(mode == (0o700 if (run_dir / p).is_dir() else 0o600) for p, mode in modes.items())
    assert not (run_dir / ".gradsync.lock").exists()  # the lock goes with the job

    before = files(run_dir)
    for args, refused in [(["seed=12"], "resume refused: "),
                          (["resume=auto", "trainer.timeout_s=0"], "config error: ")]:
        code, _, err = long_job(run_dir, *args, env=cli_env).finish()
        assert code == 2 and err.startswith(f"gradsync: {refused}"), err
        assert files(run_dir) == before  # .hydra/ and train.log included
        assert [p.name for p in run_dir.glob(".*")] == [".hydra"]


@pytest.mark.parametrize("name", ["it's", "a 'b' c", "x\\", "q\\'", "${oops}", "\\${x}",
                                  "a=b,c[d]{e}(f):g", "plain-name_1.2"])
def test_the_printed_resume_command_gives_hydra_the_run_dir_back(tmp_path, capsys, name):
    """The `continue with:` line of a stopped run, run by bash as it is pasted: its last word,
    parsed by Hydra's override parser and resolved by OmegaConf as hydra.run.dir is, is the run
    dir, quotes, backslashes and `${` included."""
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from omegaconf import OmegaConf

    run_dir = tmp_path / name
    with pytest.raises(SystemExit) as e:
        summary.stopped(run_dir, {"stopped_by": "SIGTERM", "optimizer_steps": 3,
                                  "checkpoint": "c"}, requeue=False)
    assert e.value.code == 128 + signal.SIGTERM
    hint = next(ln for ln in capsys.readouterr().err.splitlines() if "continue with:" in ln)
    command = hint.split("continue with:")[1].split("(and the same overrides)")[0]
    argv = subprocess.run(["bash", "-c", f"printf '%s\\0' {command}"], capture_output=True,
                          text=True, check=True).stdout.split("\0")[:-1]
    assert argv[:2] == ["gradsync-train", "resume=auto"] and len(argv) == 3, argv
    override = OverridesParser.create().parse_override(argv[2])
    assert override.key_or_group == "hydra.run.dir"
    assert OmegaConf.create({"dir": override.value()})["dir"] == str(run_dir), argv[2]


@pytest.mark.slow
def test_a_full_disk_is_reported_as_itself_and_leaves_no_temporary_file(tmp_path, cli_env):
    """RLIMIT_FSIZE fails a write past 8000 bytes (EFBIG) as a full disk fails it (ENOSPC):
    the first checkpoint is larger. Then a file the launcher writes is not writable."""
    run_dir = tmp_path / "run"

    def small_files() -> None:
        resource.setrlimit(resource.RLIMIT_FSIZE, (8000, 8000))

    code, _, err = long_job(run_dir, "trainer.max_steps=12", env=cli_env,
                       preexec_fn=small_files).finish()
    assert code == 1, err
    ckpt = checkpoint.step_path(run_dir / "checkpoints", 10)
    assert err.strip().splitlines()[-1] == (
        f"gradsync: training failed: rank 0 failed: OSError: [Errno 27] File too large: "
        f"'{ckpt}'")
    assert [p.name for p in run_dir.rglob("*tmp")] == []
    assert json.loads((run_dir / "summary.json").read_text())["status"] == "failed"

    run_dir = tmp_path / "run2"
    (run_dir / "run_info.json.tmp").mkdir(parents=True)  # where run_info.json is written
    code, _, err = long_job(run_dir, env=cli_env).finish()
    assert code == 1, err
    assert err.strip().splitlines()[-1] == (
        f"gradsync: error: IsADirectoryError: [Errno 21] Is a directory: "
        f"'{run_dir / 'run_info.json.tmp'}'")


def _alive(pids: dict[int, float]) -> list[int]:
    """Of these processes (pid -> create time), those still running. A zombie holds nothing
    once its last thread has ended; until then (a killed process whose main thread is a zombie
    while another of its threads is still exiting) it still holds its files."""
    alive = []
    for pid, created in pids.items():
        try:
            p = psutil.Process(pid)
            if p.create_time() == created and (p.status() != psutil.STATUS_ZOMBIE
                                               or _threads_running(pid)):
                alive.append(pid)
        except psutil.NoSuchProcess:
            pass
    return alive


def _threads_running(pid: int) -> bool:
    """Whether a thread of process `pid` is not yet a zombie (or gone)."""
    try:
        threads = list(Path(f"/proc/{pid}/task").iterdir())
    except OSError:
        return False
    for thread in threads:
        try:
            state = (thread / "stat").read_text().rsplit(")", 1)[1].split()[0]
        except (OSError, IndexError):
            continue  # ended meanwhile
        if state not in ("Z", "X"):
            return True
    return False


def _cmdline(pid: int) -> str:
    try:
        return " ".join(psutil.Process(pid).cmdline())
    except psutil.Error:
        return ""


def _ranks_started(job: Job) -> bool:
    """Both ranks exist, recorded in job.seen (the launcher's other children: multiprocessing's
    resource tracker when it spawns, git for run_info.json)."""
    job._record()
    ranks = [pid for pid in _alive(job.seen) if _cmdline(pid).startswith(sys.executable)
             and "resource_tracker" not in _cmdline(pid)]
    return len(ranks) >= 2


def _holds(pid: int, path: Path) -> bool:
    """Whether process `pid` has `path` open."""
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        try:
            if os.readlink(fd) == str(path):
                return True
        except OSError:
            pass
    return False


def _shm_names() -> set[str]:
    return {p.name for p in Path("/dev/shm").glob("gradsync-*")}


@pytest.mark.slow
@pytest.mark.parametrize("method, stage", [("fork", "spawned"), ("spawn", "spawned"),
                                           ("fork", "training")])
def test_a_killed_launcher_leaves_nothing_and_its_run_dir_is_taken_only_once_all_is_gone(
        tmp_path, cli_env, method, stage):
    """SIGKILL to the launcher alone, the moment its ranks exist (a spawned rank is still
    importing torch then, beside torch's resource tracker) or while they train (the shared
    memory mapped): no process of the job survives, nothing is left in /dev/shm, and the run
    dir's lock, which every process of the job holds, is free exactly when the last of them is
    gone: a restart there is refused while any lives and accepted after."""
    run_dir = tmp_path / "run"
    lock = run_dir / rundir.LOCK
    env = cli_env | ({"GRADSYNC_START_METHOD": "spawn"} if method == "spawn" else {})
    shm_before = _shm_names()
    job = long_job(run_dir, "trainer.max_epochs=100000", "trainer.log_every_windows=1", env=env)
    end = time.monotonic() + 240
    if stage == "spawned":
        while not _ranks_started(job):
            assert job.proc.poll() is None and time.monotonic() < end, job.finish()
            time.sleep(0.002)
    else:
        job.wait_for_step(1)
        ranks = [job.worker_pid(r) for r in range(2)]
        assert all(_holds(pid, lock) for pid in ranks)  # every rank holds the run dir's lock
    if method == "spawn":  # the launcher's first child, started with the first rank
        assert any("resource_tracker" in _cmdline(pid) for pid in job.seen)
    os.kill(job.proc.pid, signal.SIGKILL)
    job._record()
    # its pipes stay open while any rank lives (they inherited them): wait, do not read
    assert job.proc.wait(timeout=60) == -signal.SIGKILL
    refused = 0
    while True:  # as a restart would: take the lock, or be refused
        alive_before = _alive(job.seen)
        try:
            fd = rundir.take(lock)
        except rundir.RunDirBusy:
            assert alive_before, "refused although every process of the job had ended"
            refused += 1
            assert time.monotonic() < end, f"still running: {alive_before}"
            time.sleep(0.005)
            continue
        taken_while = _alive(job.seen)
        rundir.let_go(lock, fd)
        break
    # a process listed then may have closed its files on its way out: give it a moment
    assert job.survivors(wait=2) == [], f"the lock was taken while {taken_while} still ran"
    print(f"{method}, killed when {stage}: {len(job.seen)} processes, all gone; "
          f"{refused} restarts refused before that")
    assert _shm_names() <= shm_before
