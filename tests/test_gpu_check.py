"""`make gpu-check` where CUDA is absent (forced with CUDA_VISIBLE_DEVICES="" on a GPU machine):
it says why it skips, exits 0 and writes a report saying so; and the report it writes on a GPU
(its Markdown, its failures) from checks recorded by hand."""

from __future__ import annotations

import subprocess
import sys

import pytest

from conftest import REPO, cli_environ

sys.path.insert(0, str(REPO / "bench"))
import gpu_check  # noqa: E402


@pytest.mark.slow  # make and a Python process
def test_make_gpu_check_without_cuda_skips_cleanly_saying_why(tmp_path):
    env = cli_environ() | {"CUDA_VISIBLE_DEVICES": ""}
    env.pop("PYTHONPATH", None)  # the target puts this checkout's src/ on it itself
    done = subprocess.run(["make", "--no-print-directory", "gpu-check", f"PY={sys.executable}",
                           f"GPU_CHECK_ARGS=--out {tmp_path}"], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert "gpu-check: skipped: CUDA absent: torch " in done.stdout
    assert "sees no GPU" in done.stdout
    report = (tmp_path / "report.md").read_text()
    assert report.startswith("# gradsync GPU check\n\n- skipped: CUDA absent: torch ")
    assert report.endswith("sees no GPU; nothing was run.\n")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["report.md"]


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
