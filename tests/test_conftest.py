"""conftest.py's definition of slow, both ways, in a pytest run of its own: a test not marked
slow that starts an interpreter fails where it starts it (also from a module fixture), a test
marked slow that starts none fails after its call, and a slow test that starts one (itself or
through a fixture another test set up) passes."""

from __future__ import annotations

from pathlib import Path

import pytest

pytest_plugins = ["pytester"]

HERE = Path(__file__).parent

CASES = '''
import subprocess
import sys

import pytest


def python():
    subprocess.run([sys.executable, "-c", "pass"], check=True)


@pytest.fixture(scope="module")
def job():
    python()


@pytest.fixture(scope="module")
def other_job():
    python()


def test_fast_through_a_module_fixture(other_job):
    pass


@pytest.mark.slow
def test_slow_starting_nothing():
    assert True


def test_fast_starting_python():
    python()


@pytest.mark.slow
def test_slow_starting_python():
    python()


@pytest.mark.slow
def test_slow_through_a_fixture_set_up_here(job):
    pass


@pytest.mark.slow
def test_slow_through_a_fixture_set_up_before(job):
    pass


def test_fast_forking_is_no_interpreter():
    import multiprocessing

    proc = multiprocessing.get_context("fork").Process(target=print)
    proc.start()
    proc.join()
    assert proc.exitcode == 0


def test_fast_spawning_is_one():
    import multiprocessing

    proc = multiprocessing.get_context("spawn").Process(target=print)
    proc.start()
    proc.join()
'''


@pytest.mark.slow
def test_slow_means_exactly_starts_a_job_process(pytester):
    pytester.makeconftest((HERE / "conftest.py").read_text())
    pytester.makeini("[pytest]\nmarkers =\n    slow: starts a job process\n")
    pytester.makepyfile(dist_pool=(HERE / "dist_pool.py").read_text(), test_cases=CASES)
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", "-q", "-rf", timeout=240)
    outcomes = result.parseoutcomes()
    out = result.stdout.str()
    counts = tuple(outcomes.get(k) for k in ("passed", "failed", "errors"))
    assert counts == (4, 3, 1), out
    assert "test_slow_starting_nothing is marked slow but starts no job process" in out
    assert "test_fast_starting_python starts python" in out
    assert "test_fast_through_a_module_fixture starts python" in out  # in its set-up
    assert "test_fast_spawning_is_one starts python" in out and "(multiprocessing)" in out
