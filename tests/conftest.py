from __future__ import annotations

import os
import subprocess
import sys
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).parent))  # dist_pool / dist_cases for spawned ranks

from dist_pool import DistPool  # noqa: E402

REPO = Path(__file__).resolve().parents[1]


class _Pool:
    """Session-wide pool, rebuilt after a failed task (its ranks may be stuck)."""

    def __init__(self):
        self.pool: DistPool | None = None

    def run(self, fn, *args, **kw):
        if self.pool is None:
            _current["pool"] = True  # its ranks are no job processes (conftest's guard)
            try:
                self.pool = DistPool(2)
            finally:
                _current["pool"] = False
        try:
            return self.pool.run(fn, *args, **kw)
        except Exception:
            self.close()
            raise

    def close(self):
        if self.pool is not None:
            for proc in self.pool.procs:
                proc.kill()
            self.pool = None


@pytest.fixture(scope="session")
def pool2():
    p = _Pool()
    yield p
    if p.pool is not None:
        p.pool.close()


@pytest.fixture(scope="session")
def references(pool2, tmp_path_factory):
    """Uninterrupted reference runs on the pool, each trained once per session and shared by
    every test that compares a run of the same config with it (tests/resume_harness.py)."""
    from resume_harness import References  # psutil: not on a GPU box's Python (gpu-check)

    return References(pool2, tmp_path_factory)


@pytest.fixture(autouse=True)
def no_job_outlives_its_test():
    """A test that fails half-way must not leave its command-line job (or a stopped worker)
    running (tests/cli_jobs.py; only a test module that imported it can have started one, and
    psutil, which it needs, is not on a GPU box's Python: make gpu-check runs tests/test_gpu.py
    there)."""
    yield
    jobs = sys.modules.get("cli_jobs")
    if jobs is not None:
        jobs.kill_started_jobs()


# "slow" means exactly "starts a job process": a Python interpreter (a job, torchrun, a script, a
# rank of a pool of its own) or make, each paying seconds of imports. The ranks of the
# session's pool (pool2) are not: a 2-rank case on the pool is not slow. Both directions are
# held here: a test not marked slow that starts one fails where it starts it (make test-fast
# stays fast), and a test marked slow that starts none, itself or through a fixture, fails
# after its call (the mark then buys nothing but a place outside make test-fast).
JOB_PROGRAMS = ("python", "gradsync-train", "torchrun", "make", "unshare")  # unshare: a job in
# a mount namespace of its own
_starts: list[str] = []  # every job process started in this session, by what started it
_current: dict = {"item": None, "pool": False}  # the test running; the session pool starting
_starter_fixtures: set[str] = set()  # fixtures whose set-up started a job process


def _started(program: str) -> None:
    item = _current["item"]
    if item is None or _current["pool"]:
        return
    if item.get_closest_marker("slow") is None:
        raise AssertionError(f"{item.nodeid} starts {program}: mark it @pytest.mark.slow "
                             "(make test-fast leaves it out)")
    _starts.append(f"{item.nodeid}: {program}")


def _watch_job_processes() -> None:
    import multiprocessing.util

    popen_init = subprocess.Popen.__init__

    def popen(self, args, *rest, **kw):
        argv = [args] if isinstance(args, (str, bytes, os.PathLike)) else list(args)
        program = os.path.basename(str(argv[0]).split()[0]) if argv else ""
        if program.startswith(JOB_PROGRAMS):
            _started(program)
        popen_init(self, args, *rest, **kw)

    spawnv_passfds = multiprocessing.util.spawnv_passfds

    def spawn(path, args, passfds):  # multiprocessing's spawn and forkserver start methods
        if not any("resource_tracker" in os.fsdecode(a) for a in args):  # stdlib only, no torch
            _started(f"{os.path.basename(os.fsdecode(path))} (multiprocessing)")
        return spawnv_passfds(path, args, passfds)

    subprocess.Popen.__init__ = popen  # type: ignore[method-assign]
    multiprocessing.util.spawnv_passfds = spawn


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    _current["item"] = item
    item.stash[_STARTS_BEFORE] = len(_starts)
    yield
    _current["item"] = None


@pytest.hookimpl(hookwrapper=True)
def pytest_fixture_setup(fixturedef, request):
    before = len(_starts)
    yield
    if len(_starts) > before:
        _starter_fixtures.add(fixturedef.argname)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    if call.when != "call" or not report.passed or item.get_closest_marker("slow") is None:
        return
    if len(_starts) > item.stash[_STARTS_BEFORE]:
        return
    if _starter_fixtures.intersection(getattr(item, "fixturenames", ())):
        return
    report.outcome = "failed"
    report.longrepr = (f"{item.nodeid} is marked slow but starts no job process (a Python "
                       "interpreter or make), itself or through a fixture: drop the mark (a "
                       "2-rank case on the pool is not slow)")


_STARTS_BEFORE = pytest.StashKey[int]()


@pytest.fixture(scope="session")
def single_process_group():
    """A world-size-1 gloo group in the test process, for single-process references."""
    if not dist.is_initialized():
        store = dist.TCPStore("127.0.0.1", 0, 1, is_master=True)
        dist.init_process_group("gloo", store=store, rank=0, world_size=1,
                                timeout=timedelta(seconds=60))
    yield
    # left for interpreter exit: other session fixtures may still use it


def cli_environ() -> dict[str, str]:
    """The environment of a gradsync-train subprocess: not a rank of anything."""
    env = dict(os.environ)
    env.pop("HYDRA_FULL_ERROR", None)
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR",
                "MASTER_PORT", "SUBMITIT_EXECUTOR"):
        env.pop(key, None)
    for key in [k for k in env if k.startswith("SLURM_")]:  # the suite run inside a job
        del env[key]
    env["PYTHONUNBUFFERED"] = "1"
    return env


@pytest.fixture
def cli_env():
    return cli_environ()


@pytest.fixture(scope="module")
def cli_env_module():
    """cli_env for module-scoped fixtures (a sweep run once, checked by several tests)."""
    return cli_environ()


def pytest_configure(config):
    torch.set_num_threads(1)
    _watch_job_processes()
    # what the entry point registers before composing: the tests that compose with Hydra's API
    # directly (test_sweep, test_race, test_cluster) must not rely on a test run before them
    from gradsync.run.main import register_resolvers, register_schemas

    register_schemas()
    register_resolvers()
