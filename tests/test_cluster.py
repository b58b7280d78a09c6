"""From one box to a cluster, with the real engines: torchrun (one node, and two agents meeting
at a c10d rendezvous as two "nodes" with separate working dirs) and hydra-submitit-launcher's
local executor, which runs the SLURM launcher's code path on this machine. Every run trains the
same tiny job, so the final parameters must agree bitwise with gradsync's own spawn launcher:
same global ranks, same data shards, one thread per rank, and gloo's all-reduce depends only on
the rank order, not on which process or node a rank lives in. SLURM itself is not here: the
SLURM config and submitit's reading of a SLURM task's environment are checked on their own."""

from __future__ import annotations

import csv
import json
import os
import platform
import random
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_dir
from hydra.utils import instantiate

from conftest import cli_environ
from gradsync.core.ranks import job_rank
from gradsync.run import slurm
from gradsync.run.launch import adopt_submitit_ranks
from gradsync.run.main import CONF_DIR

TORCHRUN = [sys.executable, "-m", "torch.distributed.run"]
TRAIN = ["-m", "gradsync.run.main"]
JOB = ["data=synthetic", "data.num_samples=256", "trainer.max_steps=4",
       "trainer.progress_bar=false", "trainer.threads_per_worker=1"]
SWEEP = ["--multirun", "seed=0,1"]
SAME_NUMBERS = ("optimizer_steps", "samples_seen", "final_train_loss", "eval", "world_size",
                "sync_backwards", "allreduce_calls", "allreduce_bytes", "window_size", "seed")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def port_free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def job_with_free_ports(steps: int) -> str:
    """A SLURM job id whose first `steps` steps derive master ports free on this machine."""
    rng = random.Random()
    for _ in range(1000):
        job = str(rng.randrange(10**6))
        if all(port_free(slurm.port_for(job, str(s))) for s in range(steps)):
            return job
    raise RuntimeError("no job id with free derived ports")


def start(cmd: list[str], cwd: Path, env: dict) -> subprocess.Popen:
    # own session: a timed-out engine is killed with every process it started
    return subprocess.Popen(cmd, cwd=cwd, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)


def finish(proc: subprocess.Popen, timeout: float = 240) -> subprocess.CompletedProcess:
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        pytest.fail(f"{proc.args} timed out\n{out}\n{err}")
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def run(cmd: list[str], cwd: Path, env: dict) -> subprocess.CompletedProcess:
    return finish(start(cmd, cwd, env))


def files_under(d: Path) -> list[str]:
    """Relative paths of the files under d; TensorBoard event files by folder only (their
    names carry a timestamp and pid)."""
    return sorted("tb/<events>" if p.parent.name == "tb" else str(p.relative_to(d))
                  for p in d.rglob("*") if p.is_file())


def params(run_dir: Path) -> dict[str, torch.Tensor]:
    return torch.load(run_dir / "checkpoints" / "last.pt", weights_only=True)["model"]


def assert_same_training(a: Path, b: Path) -> None:
    sa, sb = (json.loads((d / "summary.json").read_text()) for d in (a, b))
    assert sa["status"] == sb["status"] == "completed"
    assert {k: sa[k] for k in SAME_NUMBERS} == {k: sb[k] for k in SAME_NUMBERS}
    pa, pb = params(a), params(b)
    assert pa.keys() == pb.keys()
    for key in pa:
        assert torch.equal(pa[key], pb[key]), key


@pytest.fixture(scope="module")
def basic_sweep(tmp_path_factory) -> Path:
    """The reference: a 2-job multirun through Hydra's basic launcher, each job spawning its 2
    workers itself."""
    tmp = tmp_path_factory.mktemp("basic")
    proc = run([sys.executable, *TRAIN, *SWEEP, *JOB, f"hydra.sweep.dir={tmp / 'sweep'}"],
               tmp, cli_environ())
    assert proc.returncode == 0, proc.stderr
    return tmp / "sweep"


@pytest.mark.slow
@pytest.mark.dist
def test_torchrun_job_has_one_run_dir_written_by_rank0(tmp_path, cli_env, basic_sweep):
    port = free_port()
    proc = run([*TORCHRUN, "--nproc-per-node=2", f"--master-port={port}", *TRAIN, *JOB],
               tmp_path, cli_env)
    assert proc.returncode == 0, proc.stderr
    # the default run dir (rank 0's clock), not one ${now} dir per rank
    (run_dir,) = (tmp_path / "outputs" / "runs").glob("*/*")
    assert proc.stdout.count("gradsync: outputs in") == 1  # only rank 0 reports
    assert f"outputs in {run_dir}" in proc.stdout
    assert files_under(run_dir) == [
        ".hydra/config.yaml", ".hydra/hydra.yaml", ".hydra/overrides.yaml",
        "checkpoints/last.pt", "checkpoints/step_00000004.json", "checkpoints/step_00000004.pt",
        "evals.jsonl", "logs/rank0.log", "logs/rank1.log", "metrics.jsonl", "run_info.json",
        "summary.json",
        "tb/<events>", "tb/<events>", "trackers.json", "train.log"]  # training + HParams
    assert json.loads((run_dir / "summary.json").read_text())["world_size"] == 2
    # torchrun's ranks train exactly what gradsync's own spawned workers train
    assert_same_training(run_dir, basic_sweep / "0")


@pytest.mark.slow
@pytest.mark.dist
def test_two_torchrun_nodes_train_like_one_node(tmp_path, cli_env, basic_sweep):
    """Two agents (--nnodes=2, one rank each) meet at a c10d rendezvous on 127.0.0.1. Each runs
    in its own working dir, as two machines without a shared disk would: everything but the
    rank's own log lands on the node of rank 0."""
    endpoint = f"127.0.0.1:{free_port()}"
    nodes = [tmp_path / "node_a", tmp_path / "node_b"]
    cmd = [*TORCHRUN, "--nnodes=2", "--nproc-per-node=1", "--rdzv-backend=c10d",
           f"--rdzv-endpoint={endpoint}", "--rdzv-id=gradsync-test",
           "--rdzv-conf=join_timeout=90", *TRAIN, *JOB]
    procs = []
    for node in nodes:
        node.mkdir()
        procs.append(start(cmd, node, cli_env))
    done = [finish(p) for p in procs]
    for d in done:
        assert d.returncode == 0, d.stderr

    run_dirs = [list((node / "outputs" / "runs").glob("*/*")) for node in nodes]
    assert [len(r) for r in run_dirs] == [1, 1]
    (dir_a,), (dir_b,) = run_dirs
    assert dir_a.relative_to(nodes[0]) == dir_b.relative_to(nodes[1])  # one name for the job
    rank0_dir, other_dir = (dir_a, dir_b) if (dir_a / "summary.json").exists() else (dir_b, dir_a)
    assert files_under(other_dir) == ["logs/rank1.log"]  # not even Hydra's files
    assert files_under(rank0_dir) == [
        ".hydra/config.yaml", ".hydra/hydra.yaml", ".hydra/overrides.yaml",
        "checkpoints/last.pt", "checkpoints/step_00000004.json", "checkpoints/step_00000004.pt",
        "evals.jsonl", "logs/rank0.log", "metrics.jsonl", "run_info.json", "summary.json",
        "tb/<events>",
        "tb/<events>", "trackers.json", "train.log"]  # training + HParams
    assert sum(d.stdout.count("gradsync: outputs in") for d in done) == 1
    assert_same_training(rank0_dir, basic_sweep / "0")


@pytest.mark.slow
@pytest.mark.dist
def test_torchrun_failures_are_one_line_and_a_restart_gets_a_fresh_dir(tmp_path, cli_env):
    """A rank whose training raises ends the job non-zero with the rank and the error in one
    line and a failed summary. With --max-restarts=1 torchrun runs the job twice: two dirs.
    TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 (restarts on torchrun's shared store can read the
    previous attempt's keys, pytorch#135712) also makes rank 0, not the agent, host the store
    that rank0_now goes through."""
    tests = str(Path(__file__).parent)  # components_for_tests: data that fails in the workers
    env = cli_env | {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1",
                     "PYTHONPATH": os.pathsep.join([tests, cli_env.get("PYTHONPATH", "")])}
    proc = run([*TORCHRUN, "--standalone", "--nproc-per-node=2", "--max-restarts=1", *TRAIN,
                *JOB, "data._target_=components_for_tests.data_that_fails"], tmp_path, env)
    assert proc.returncode != 0
    line = ("gradsync: training failed: rank 0 failed: ValueError: the data cannot be loaded "
            "(a test aid)")
    assert proc.stderr.count(line) == 2 and "config error" not in proc.stderr
    run_dirs = sorted((tmp_path / "outputs" / "runs").glob("*/*"))
    assert len(run_dirs) == 2
    for run_dir in run_dirs:
        summary = json.loads((run_dir / "summary.json").read_text())
        assert summary == {"status": "failed", "error": line.removeprefix("gradsync: ")}
        assert sorted(p.name for p in (run_dir / "logs").iterdir()) == ["rank0.log",
                                                                        "rank1.log"]

    # A sweep under torchrun is refused before anything is created.
    elsewhere = tmp_path / "sweep"
    elsewhere.mkdir()
    proc = run([*TORCHRUN, "--nproc-per-node=1", f"--master-port={free_port()}", *TRAIN,
                *SWEEP, *JOB], elsewhere, cli_env)
    assert proc.returncode != 0
    assert "gradsync: config error: a multirun (-m) under torchrun is not supported" \
        in proc.stderr
    assert list(elsewhere.iterdir()) == []


@pytest.mark.slow
@pytest.mark.dist
def test_srun_tasks_form_one_job_and_two_concurrent_steps_of_it_both_train(
        tmp_path, cli_env, basic_sweep):
    """`srun --ntasks=2 gradsync-train ...` without SLURM: two processes with the variables
    srun gives its tasks. Each becomes one rank (no spawning), they meet at the first host of
    the nodelist, agree on one run dir named after the job, and train bitwise what
    trainer.devices=2 trains. Under `taskset -c 0,1` each of the 2 ranks runs 1 thread.

    Two such steps of one allocation at once on one node (step 0 in the default run dir, step
    1 in a hydra.run.dir of its own, as the docs ask): each step's tasks derive their own
    master port from the job and step ids. With one port per job, the second step's rank 0
    could not listen, or its tasks joined the first step's store. (One test: the two steps
    are the two plain jobs, 4 processes started once.)"""
    job = job_with_free_ports(steps=2)
    procs = {}
    for step in (0, 1):
        step_env = {"SLURM_JOB_ID": job, "SLURM_STEP_ID": str(step), "SLURM_NTASKS": "2",
                    "SLURM_NODEID": "0", "SLURM_TASKS_PER_NODE": "2",
                    "SLURM_JOB_NODELIST": "localhost"}
        for r in (0, 1):
            task_env = cli_env | step_env | {"SLURM_PROCID": str(r), "SLURM_LOCALID": str(r)}
            if step == 0:  # the plain job: threads from the CPUs each task may use
                cmd = ["taskset", "-c", "0,1", sys.executable, *TRAIN, *JOB,
                       "trainer.threads_per_worker=0"]
            else:
                cmd = [sys.executable, *TRAIN, *JOB, f"hydra.run.dir={tmp_path / 'step1'}"]
            procs[step, r] = start(cmd, tmp_path, task_env)
    done = {key: finish(p) for key, p in procs.items()}
    for key, d in done.items():
        assert d.returncode == 0, (key, d.stderr)
    assert list((tmp_path / "outputs" / "runs").iterdir()) == [
        tmp_path / "outputs" / "runs" / f"slurm-{job}"]
    run_dirs = [tmp_path / "outputs" / "runs" / f"slurm-{job}", tmp_path / "step1"]
    for step in (0, 1):
        assert sum(done[step, r].stdout.count("gradsync: outputs in") for r in (0, 1)) == 1
        for rank in (0, 1):  # one rank per task, each up once: nothing spawned
            log = (run_dirs[step] / "logs" / f"rank{rank}.log").read_text()
            assert log.count(f"rank {rank}/2 up: backend=gloo") == 1
        assert_same_training(run_dirs[step], basic_sweep / "0")
    run_dir = run_dirs[0]
    assert files_under(run_dir) == files_under(basic_sweep / "0")
    for rank in (0, 1):
        log = (run_dir / "logs" / f"rank{rank}.log").read_text()
        assert log.count(f"rank {rank}/2 up: backend=gloo device=cpu threads=1") == 1
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["threads"] == [1, 1] and summary["world_size"] == 2
    assert summary["device"] == (platform.processor() or platform.machine() or "cpu")
    assert summary["peak_gpu_mem_mb"] is None
    assert slurm.port_for(job, "0") != slurm.port_for(job, "1")


@pytest.mark.slow
@pytest.mark.dist
def test_submitit_sweep_matches_the_basic_launcher(tmp_path, cli_env, basic_sweep):
    """hydra/launcher=slurm_local: each job runs as 2 submitit tasks, one rank each, through the
    code path a SLURM job takes."""
    proc = run([sys.executable, *TRAIN, *SWEEP, *JOB, "hydra/launcher=slurm_local"], tmp_path,
               cli_env)
    assert proc.returncode == 0, proc.stderr
    # the default sweep dir: named once by the submitting process, used by every task
    (sweep,) = (tmp_path / "outputs" / "sweeps").glob("*/*")
    jobs = sorted(p.name for p in sweep.iterdir() if not p.name.startswith("."))
    assert jobs == ["0", "1", "multirun.yaml", "sweep.png", "sweep_summary.csv",
                    "sweep_summary.md"]
    # the same sweep summary as the basic launcher's, but for timings, memory and paths
    # (peak_mem_mb on CPU: allocations traced in the second window, which depend on the
    # allocator and threads of the process, as peak_rss_mb does)
    volatile = {"wall_s", "train_s", "seconds_to_target", "samples_per_s", "peak_rss_mb",
                "peak_mem_mb", "dir"}

    def summary_rows(d: Path) -> list[dict[str, str]]:
        with open(d / "sweep_summary.csv", newline="") as f:
            return [{k: v for k, v in row.items() if k not in volatile}
                    for row in csv.DictReader(f)]

    assert summary_rows(sweep) == summary_rows(basic_sweep)
    assert [r["status"] for r in summary_rows(sweep)] == ["completed", "completed"]
    for job in ("0", "1"):
        assert files_under(sweep / job) == files_under(basic_sweep / job)
        assert_same_training(sweep / job, basic_sweep / job)
        # pass-through, not a spawn per task: each rank came up once, in its own task
        for rank in (0, 1):
            log = (sweep / job / "logs" / f"rank{rank}.log").read_text()
            assert log.count(f"rank {rank}/2 up") == 1
    task_outputs = sorted(sweep.glob(".submitit/*/*_log.out"))
    assert len(task_outputs) == 4  # 2 jobs x 2 tasks
    reports = [p.name for p in task_outputs if "gradsync: outputs in" in p.read_text()]
    assert len(reports) == 2 and all(name.endswith("_0_log.out") for name in reports)
    # the two seeds did train differently (the comparison above is not vacuous)
    p0, p1 = params(sweep / "0"), params(sweep / "1")
    assert not any(torch.equal(p0[key], p1[key]) for key in p0)


def test_slurm_launcher_asks_one_task_per_gpu():
    with initialize_config_dir(config_dir=CONF_DIR, version_base="1.3"):
        cfg = compose("config", return_hydra_config=True, overrides=[
            "hydra/launcher=slurm", "trainer.devices=4", "hydra.launcher.nodes=2"])
    launcher = instantiate(cfg.hydra.launcher)  # what -m hydra/launcher=slurm submits with
    assert type(launcher).__name__ == "SlurmLauncher"
    p = launcher.params
    assert (p["nodes"], p["tasks_per_node"], p["gpus_per_node"]) == (2, 4, 4)


def test_a_slurm_task_becomes_an_env_rank(monkeypatch):
    """What SLURM sets for task 5 of a 2-node x 4-task job, read through submitit as in a real
    job, becomes torch's env:// variables; every task derives the same MASTER_PORT."""
    slurm = {"SUBMITIT_EXECUTOR": "slurm", "SLURM_JOB_ID": "1234", "SLURM_NTASKS": "8",
             "SLURM_PROCID": "5", "SLURM_LOCALID": "1", "SLURM_JOB_NUM_NODES": "2",
             "SLURM_NODEID": "1", "SLURM_JOB_NODELIST": "gpu[017-018]"}
    ports = []
    for procid in ("5", "0"):
        for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR",
                    "MASTER_PORT"):
            monkeypatch.setenv(key, "")  # so that monkeypatch restores them after the test
            monkeypatch.delenv(key)
        for key, value in (slurm | {"SLURM_PROCID": procid}).items():
            monkeypatch.setenv(key, value)
        assert job_rank() == int(procid)  # while Hydra sets the job up, before the export
        adopt_submitit_ranks()
        assert os.environ["RANK"] == procid and os.environ["WORLD_SIZE"] == "8"
        ports.append(os.environ["MASTER_PORT"])
    assert (os.environ["LOCAL_RANK"], os.environ["LOCAL_WORLD_SIZE"]) == ("1", "4")
    assert os.environ["MASTER_ADDR"] == "gpu017"
    assert ports[0] == ports[1] and 20000 <= int(ports[0]) <= 60000


class _EndsBetweenLooks:
    """A rank's process that was still running when the supervisor noted the exits and had
    ended (killed) by the time it counted the living: the last ranks of a failed job, killed at
    once after the grace period. Its sentinel is ready, as an ended process's is."""

    pid = None

    def __init__(self, code: int):
        self.code, self.reads = code, 0
        self.sentinel, done = os.pipe()
        os.write(done, b"x")
        os.close(done)

    @property
    def exitcode(self) -> int | None:
        self.reads += 1
        return None if self.reads == 1 else self.code

    def join(self) -> None:
        pass


def test_ranks_that_end_between_the_supervisors_looks_still_fail_the_job():
    """The supervisor noted exits, then counted the living: ranks killed in between were in
    neither list, and a failed job read as one whose rank 0 ended cleanly without a summary
    ("exited (exit code 0) without the run's summary", seen in full-suite runs)."""
    from gradsync.run.launch import Watch, WorkerFailed

    watch = Watch(timeout_s=5)
    watch.procs = [_EndsBetweenLooks(-signal.SIGKILL), _EndsBetweenLooks(-signal.SIGKILL)]
    try:
        with pytest.raises(WorkerFailed) as e:
            watch.supervise()
    finally:
        for proc in watch.procs:
            os.close(proc.sentinel)
    assert str(e.value).endswith("process exited (killed by SIGKILL)"), str(e.value)
    assert watch.exit_order == [0, 1]
