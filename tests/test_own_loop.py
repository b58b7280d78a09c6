"""docs/own-loop.md's loop runs as written (extracted from the page, run under torchrun on 2
ranks) and trains bit for bit the parameters of the same configuration through gradsync-train
(the page's command), for accumulate with a short last window on data of an odd size, always,
and local SGD."""

from __future__ import annotations

import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from cli_jobs import Job

PAGE = Path(__file__).resolve().parents[1] / "docs" / "own-loop.md"
TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2"]


def blocks(kind: str) -> list[str]:
    return re.findall(rf"```{kind}\n(.*?)```", PAGE.read_text(), re.S)


def page_command() -> list[str]:
    """The gradsync-train overrides of the page's bash block."""
    words = shlex.split(blocks("bash")[0].replace("\\\n", " "))
    assert words[0] == "gradsync-train"
    return words[1:]


@pytest.mark.slow
@pytest.mark.parametrize("policy", ["accumulate", "always", "local_sgd"])
def test_the_pages_loop_trains_the_bits_of_gradsync_train(policy, tmp_path, cli_env):
    (tmp_path / "own_loop.py").write_text(blocks("python")[0])
    proc = subprocess.run([*TORCHRUN, "own_loop.py", policy], cwd=tmp_path, env=cli_env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    windows = int(proc.stdout.split(" windows")[0])
    assert windows == 24  # 719 samples a rank in 45 micro-batches: 11 windows of 4 and 1 of 1
    mine = torch.load(tmp_path / "own_loop_ckpt" / f"step_{windows:08d}.pt",
                      weights_only=True)["model"]
    args = [a for a in page_command() if not a.startswith("sync=")] + [
        f"sync={policy}", "trainer.progress_bar=false"]
    code, _, err = Job(tmp_path / "run", args, cli_env).finish()
    assert code == 0, err
    theirs = torch.load(tmp_path / "run" / "checkpoints" / "last.pt", weights_only=True)["model"]
    assert sorted(mine) == sorted(theirs)
    assert all(torch.equal(mine[k], theirs[k]) for k in mine), policy
