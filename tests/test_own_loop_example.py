"""examples/own_loop/: with_gradsync.py, nanoGPT's loop (plain_ddp.py) with gradsync added in at
most 10 changed or added lines (the README's diff is the files' diff), trains bit for bit the
parameters of the same configuration through gradsync-train (the example's conf/), on 2 ranks
under torchrun; plain_ddp.py too, where the math is the same (packed windows, full windows,
powers of two: README.md there)."""

from __future__ import annotations

import difflib
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from cli_jobs import MAIN, Job
from gradsync.models import Transformer

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "own_loop"
TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2"]
STEPS, WARMUP = 6, 2  # warm-up and cosine both stepped through


def the_diff() -> list[str]:
    """plain_ddp.py -> with_gradsync.py, unified, one line of context, without the header."""
    plain, gradsync = ((EXAMPLE / f).read_text().splitlines() for f in
                       ("plain_ddp.py", "with_gradsync.py"))
    return list(difflib.unified_diff(plain, gradsync, n=1, lineterm=""))[2:]


def test_the_readme_shows_the_diff_and_gradsync_takes_at_most_10_lines():
    diff = the_diff()
    shown = re.findall(r"```diff\n(.*?)```", (EXAMPLE / "README.md").read_text(), re.S)
    assert shown and shown[0].splitlines() == diff
    added = [line for line in diff if line.startswith("+")]
    assert 8 <= len(added) <= 10, added  # changed or added lines of with_gradsync.py


def run(script: str, tmp_path: Path, env: dict) -> dict[str, torch.Tensor]:
    proc = subprocess.run([*TORCHRUN, str(EXAMPLE / script), f"--max_iters={STEPS}",
                           f"--warmup_iters={WARMUP}"], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert re.match(r"iter 0: loss 5\.\d+$", proc.stdout.strip()), proc.stdout  # ln 256 = 5.55
    name = script.removesuffix(".py")
    found = sorted((tmp_path / f"out-{name}").glob("*.pt"))
    assert len(found) == 1, found
    return torch.load(found[0], weights_only=True)


@pytest.mark.slow
def test_with_gradsync_trains_the_bits_of_gradsync_train_and_of_plain_ddp(tmp_path, cli_env):
    cli_env["OMP_NUM_THREADS"] = "1"
    job = Job(tmp_path / "run", [  # meanwhile: the scripts under torchrun
        "experiment=own_loop", f"trainer.max_steps={STEPS}",
        f"lr_scheduler.warmup_steps={WARMUP}", "trainer.progress_bar=false"], cli_env,
        launcher=(*MAIN, "--config-dir", str(EXAMPLE / "conf")))
    mine = run("with_gradsync.py", tmp_path, cli_env)
    assert mine["step"] == STEPS and mine["numerics"]["threads"] == 1  # fingerprinted
    plain = run("plain_ddp.py", tmp_path, cli_env)["model"]
    code, _, err = job.finish()
    assert code == 0, err
    theirs = torch.load(tmp_path / "run" / "checkpoints" / "last.pt", weights_only=True)
    assert theirs["step"] == STEPS
    mine, theirs = mine["model"], theirs["model"]
    assert sorted(mine) == sorted(theirs) == sorted(plain) and len(mine) == 30
    assert all(torch.equal(mine[k], theirs[k]) for k in mine)
    assert all(torch.equal(plain[k], mine[k]) for k in mine)
    torch.manual_seed(0)  # the scripts' init: trained, no parameter is left where it was
    init = Transformer(vocab_size=256, max_len=64, d_model=32, n_layers=2, n_heads=2)
    assert all(not torch.equal(v, mine[k]) for k, v in init.state_dict().items())
