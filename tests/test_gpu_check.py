"""`make gpu-check` where CUDA is absent: on a machine without a GPU it says why it skips, exits
0 and writes a report saying so; on a machine that shows a GPU (nvidia-smi on PATH) a torch that
cannot use it is a failure; the wheelhouse unpacks without pip; and the report it writes on a
GPU (its Markdown, its failures) from checks recorded by hand. `make gpu-check-dry` (CI) runs
every step of the check itself on the CPU."""

from __future__ import annotations

import os
import platform
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
import torch

from conftest import REPO, cli_environ

sys.path.insert(0, str(REPO / "bench"))
import gpu_check  # noqa: E402


def make_gpu_check(tmp_path, env: dict) -> subprocess.CompletedProcess:
    env.pop("PYTHONPATH", None)  # the target puts this checkout's src/ on it itself
    return subprocess.run(["make", "--no-print-directory", "gpu-check", f"PY={sys.executable}",
                           f"GPU_CHECK_ARGS=--out {tmp_path}"], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=300)


@pytest.mark.slow
def test_make_gpu_check_without_a_gpu_skips_cleanly_saying_why(tmp_path):
    env = cli_environ() | {"CUDA_VISIBLE_DEVICES": ""}
    env["PATH"] = os.pathsep.join(p for p in env["PATH"].split(os.pathsep)
                                  if not (Path(p) / "nvidia-smi").exists())
    done = make_gpu_check(tmp_path, env)
    assert done.returncode == 0, done.stderr
    why = (f"CUDA absent: torch {torch.__version__} (CUDA build: {torch.version.cuda}) sees no "
           "GPU, and this machine shows none (no nvidia-smi, no /dev/nvidia*)")
    assert f"\ngpu-check: skipped: {why} (report: " in done.stdout  # after make's echo
    report = (tmp_path / "report.md").read_text()
    assert report == f"# gradsync GPU check\n\n- skipped: {why}; nothing was run.\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["report.md"]


@pytest.mark.slow
@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a torch that sees no GPU")
def test_a_gpu_machine_whose_torch_cannot_use_it_fails_saying_why(tmp_path):
    """nvidia-smi on PATH (here a stand-in) says the machine has a GPU: a CPU-only torch, or a
    driver this torch cannot use, is then a failure, not a skip (a false pass on a GPU box)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "nvidia-smi").write_text("#!/bin/sh\nexit 0\n")
    (bin_dir / "nvidia-smi").chmod(0o755)
    env = cli_environ()
    env["PATH"] = f"{bin_dir}{os.pathsep}{env['PATH']}"
    done = make_gpu_check(tmp_path / "out", env)
    assert done.returncode == 2  # make's own, for the check's exit code 1
    build = f"torch {torch.__version__} (CUDA build: {torch.version.cuda})"
    if torch.version.cuda is None:
        why = (f"this machine has a GPU (nvidia-smi is on PATH) but {build} at "
               f"{sys.executable} is a CPU-only build: run with a Python whose torch is a CUDA "
               "build (make gpu-check PY=/path/to/python)")
    else:
        why = f"this machine has a GPU (nvidia-smi is on PATH) but {build} cannot use it: "
    assert f"gpu-check: FAILED: {why}" in done.stdout
    assert (tmp_path / "out" / "report.md").read_text().startswith(
        f"# gradsync GPU check\n\n- FAILED: {why}")


def test_wheels_unpack_where_pip_is_missing(tmp_path):
    """A Python without pip gets the wheelhouse unpacked: the pure wheels, and of a binary one
    the build for this interpreter and machine only."""
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    tag = f"cp{sys.version_info.major}{sys.version_info.minor}"
    other = "cp39" if tag != "cp39" else "cp38"
    machine = platform.machine()
    for name, module in (("pure-1.0-py3-none-any.whl", "pure"),
                         (f"native-1.0-{tag}-{tag}-manylinux2014_{machine}.whl", "native_here"),
                         (f"native-1.0-{other}-{other}-manylinux2014_{machine}.whl", "elsewhere"),
                         (f"native-1.0-{tag}-{tag}-manylinux2014_s390x.whl", "s390x")):
        with zipfile.ZipFile(wheels / name, "w") as z:
            z.writestr(f"{module}/__init__.py", "")
    site = tmp_path / "site"
    chosen = gpu_check.unpack_wheels(wheels, site)
    assert sorted(chosen) == sorted(["pure-1.0-py3-none-any.whl",
                                     f"native-1.0-{tag}-{tag}-manylinux2014_{machine}.whl"])
    assert sorted(p.name for p in site.iterdir()) == ["native_here", "pure"]


def test_the_report_lists_every_check_with_its_figures(tmp_path):
    report = gpu_check.Report(["- cuda:0: a GPU"])
    report.add("tests marked gpu").done(True, "7 passed")
    report.add("kill -9 and resume, bitwise").done(False, "parameters bitwise equal: False")
    report.add("LM tokens/s vs a hand-written loop")  # a check that never finished
    path = report.write(tmp_path / "out")
    assert path == tmp_path / "out" / "report.md"
    assert path.read_text() == "\n".join([
        "# gradsync GPU check", "", "- cuda:0: a GPU", "",
        "| check | result |", "|---|---|",
        "| tests marked gpu | pass |",
        "| kill -9 and resume, bitwise | FAIL |",
        "| LM tokens/s vs a hand-written loop | not run |", "",
        "## tests marked gpu: pass", "", "- 7 passed", "",
        "## kill -9 and resume, bitwise: FAIL", "", "- parameters bitwise equal: False", "",
        "## LM tokens/s vs a hand-written loop: not run", "", "- (nothing recorded)", ""])
    assert report.failed == ["kill -9 and resume, bitwise"]
    env = gpu_check.child_env()
    assert env["PYTHONPATH"].split(":")[0] == str(REPO / "src")
    assert "RANK" not in env and not any(k.startswith("SLURM_") for k in env)
