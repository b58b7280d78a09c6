"""Each engine owns its settings (engines/base.py Registered): a new engine with a setting of its
own is two files, its module and conf/engine/<name>.yaml, and nothing else changes: shown on a
copy of the package with exactly those two files added, trained through the command line."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from cli_jobs import Job

REPO = Path(__file__).resolve().parents[1]

TOY = '''"""engine=toy: torch's DDP whose buckets are `cap_mb` large (two files: this, its YAML)."""
from dataclasses import dataclass

from gradsync.components import require
from gradsync.engines.base import Registered
from gradsync.engines.torch_ddp import TorchDDP, build_torch_ddp


@dataclass
class ToySettings:
    cap_mb: float = 25.0

    def check(self, device_type):
        require(self.cap_mb > 0, "engine.cap_mb", "a number > 0", self.cap_mb)


def build_toy(model, wire, averager, device, world_size, counts, memory, cap_mb):
    return build_torch_ddp(model, wire, averager, device, world_size, counts,
                           bucket_cap_mb=cap_mb, allreduce="process_group", memory=memory)


ENGINES = {"toy": Registered(TorchDDP, build_toy, ToySettings)}
'''
TOY_YAML = """defaults:
  - /schema/engine/toy@_here_
  - _self_
"""
RUN = ["data=synthetic", "data.num_samples=64", "data.eval_samples=16",
       "schedule.micro_batch_size=8", "trainer.max_steps=2", "trainer.progress_bar=false",
       "trainer.threads_per_worker=1"]


def files(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*"))
            if p.is_file() and "__pycache__" not in p.parts}


@pytest.mark.slow
def test_an_engine_with_a_setting_of_its_own_is_two_files(tmp_path, cli_env):
    copy = tmp_path / "gradsync-copy"
    shutil.copytree(REPO / "src", copy / "src",
                    ignore=shutil.ignore_patterns("__pycache__", "*.egg-info"))
    shutil.copytree(REPO / "conf", copy / "conf")
    before = files(copy)
    (copy / "src" / "gradsync" / "engines" / "toy.py").write_text(TOY)
    (copy / "conf" / "engine" / "toy.yaml").write_text(TOY_YAML)
    after = files(copy)
    assert sorted(after.keys() - before.keys()) == ["conf/engine/toy.yaml",
                                                    "src/gradsync/engines/toy.py"]
    assert all(after[k] == v for k, v in before.items())  # nothing else touched
    env = cli_env | {"PYTHONPATH": str(copy / "src")}
    run_dir = tmp_path / "run"
    code, _, err = Job(run_dir, [*RUN, "engine=toy", "engine.cap_mb=0.0001"], env).finish()
    assert code == 0, err
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["optimizer_steps"] == 2
    # its setting reached the DDP it builds: a bucket per parameter or so, where the default
    # 25 MB holds this MLP's gradients in one bucket
    assert summary["allreduce_calls"][0] > summary["sync_backwards"][0]
    code, _, err = Job(tmp_path / "bad", [*RUN, "engine=toy", "engine.cap_mb=-1"], env).finish()
    assert code == 2 and err.strip().splitlines() == [
        "gradsync: config error: engine.cap_mb=-1.0 is not allowed: a number > 0"], err
    assert not (tmp_path / "bad").exists()
