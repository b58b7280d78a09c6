"""Fast tests of the pieces behind exact resume: checkpoint files (atomic, digests, keep-last-K,
fallback, refusal), RNG states through weights_only, the resumable sampler, DataLoader worker
seeding, metrics truncation, run_info."""

from __future__ import annotations

import json
import random
import re
import resource
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from torch.utils.data import Dataset, TensorDataset

from configs import plain_cfg
from gradsync.config.validate import ConfigError
from gradsync.core.seeds import derive_seed
from gradsync.data.loader import epoch_batches, train_loader
from gradsync.run.faults import StopAgreement, StopFlag
from gradsync.run.preflight import preflight
from gradsync.train import checkpoint
from gradsync.train.checkpoint import ResumeError, resolve_resume
from gradsync.train.checks import require_finite_parameters
from gradsync.train.metrics import keep_rows_through
from gradsync.train.repro import config_hash, git_state, write_run_info
from gradsync.train.state import rng_state, set_rng_state

CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def cfg():
    return plain_cfg(["data=synthetic", "model.hidden_sizes=[8]"])


def fake_state(cfg: dict, step: int) -> dict:
    return {"step": step, "model": {"w": torch.full((1000,), float(step))}, "world_size": 2,
            "config": cfg, "config_hash": config_hash(cfg)}


def write_steps(ckpt_dir: Path, cfg: dict, steps: list[int], keep: int = 10) -> None:
    for step in steps:
        checkpoint.write(fake_state(cfg, step), ckpt_dir, keep)


def flip_a_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01
    path.write_bytes(bytes(data))


def test_write_keeps_the_newest_k_with_digests_and_loads_weights_only(tmp_path, cfg):
    write_steps(tmp_path, cfg, [5, 10, 15, 20], keep=3)
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        f"step_{s:08d}.{ext}" for s in (10, 15, 20) for ext in ("json", "pt")]
    meta = checkpoint.verify(checkpoint.step_path(tmp_path, 20))
    assert meta["step"] == 20 and meta["sha256"] == checkpoint.sha256_file(
        checkpoint.step_path(tmp_path, 20))
    assert checkpoint.load(checkpoint.step_path(tmp_path, 20))["model"]["w"][0] == 20.0
    checkpoint.link_last(checkpoint.step_path(tmp_path, 20))
    assert checkpoint.load(tmp_path / "last.pt")["step"] == 20


def test_verify_names_truncated_flipped_and_incomplete_checkpoints(tmp_path, cfg):
    write_steps(tmp_path, cfg, [1, 2, 3])
    truncated, flipped, lonely = (checkpoint.step_path(tmp_path, s) for s in (1, 2, 3))
    truncated.write_bytes(truncated.read_bytes()[:-100])
    flip_a_byte(flipped)
    lonely.with_suffix(".json").unlink()  # killed between the .pt and its sidecar
    with pytest.raises(ResumeError, match="truncated or corrupt checkpoint"):
        checkpoint.verify(truncated)
    with pytest.raises(ResumeError, match="corrupt checkpoint .sha256"):
        checkpoint.verify(flipped)
    torch.load(flipped, weights_only=True)  # what the digest is for: torch.load does not see it
    with pytest.raises(ResumeError, match="incomplete checkpoint"):
        checkpoint.verify(lonely)
    assert checkpoint.complete(tmp_path) == [flipped, truncated]


def test_resume_auto_falls_back_past_corrupt_checkpoints(tmp_path, cfg):
    ckpts = tmp_path / "checkpoints"
    # nothing yet: fresh start
    assert resolve_resume("auto", tmp_path, cfg, 2, [], sharded=False) is None
    write_steps(ckpts, cfg, [10, 20, 30])
    flip_a_byte(checkpoint.step_path(ckpts, 30))
    notes: list[str] = []
    assert resolve_resume("auto", tmp_path, cfg, 2, notes, sharded=False) == \
        checkpoint.step_path(ckpts, 20)
    assert notes == [f"skipping {checkpoint.step_path(ckpts, 30)}: corrupt checkpoint "
                     "(sha256 differs from the one written)"]
    # a run dir or a file named explicitly
    assert resolve_resume(str(tmp_path), tmp_path / "new", cfg, 2, [], sharded=False) == \
        checkpoint.step_path(ckpts, 20)
    assert resolve_resume(str(checkpoint.step_path(ckpts, 10)), tmp_path / "new", cfg, 2,
                          [], sharded=False) == checkpoint.step_path(ckpts, 10)
    with pytest.raises(ResumeError, match="corrupt checkpoint"):  # named: no fallback
        resolve_resume(str(checkpoint.step_path(ckpts, 30)), tmp_path / "new", cfg, 2, [],
                       sharded=False)
    flip_a_byte(checkpoint.step_path(ckpts, 20))
    flip_a_byte(checkpoint.step_path(ckpts, 10))
    with pytest.raises(ResumeError, match="no intact checkpoint"):
        resolve_resume("auto", tmp_path, cfg, 2, [], sharded=False)


def test_a_sidecar_without_its_keys_is_corrupt_and_resume_auto_falls_back(tmp_path, cfg):
    ckpts = tmp_path / "checkpoints"
    write_steps(ckpts, cfg, [10, 20, 30, 40])
    step = {s: checkpoint.step_path(ckpts, s) for s in (10, 20, 30, 40)}
    step[40].with_suffix(".json").write_text("{}")
    step[30].with_suffix(".json").write_text("[]")
    meta = json.loads(step[20].with_suffix(".json").read_text())
    meta["bytes"] = str(meta["bytes"])
    step[20].with_suffix(".json").write_text(json.dumps(meta))
    notes: list[str] = []
    assert resolve_resume("auto", tmp_path, cfg, 2, notes, sharded=False) == step[10]
    assert notes == [
        f"skipping {step[40]}: corrupt checkpoint (step_00000040.json lacks a valid step, "
        "bytes, sha256, world_size, config_hash, config)",
        f"skipping {step[30]}: corrupt checkpoint (step_00000030.json lacks a valid step, "
        "bytes, sha256, world_size, config_hash, config)",
        f"skipping {step[20]}: corrupt checkpoint (step_00000020.json lacks a valid bytes)"]
    with pytest.raises(ResumeError, match="corrupt checkpoint"):  # named: no fallback
        resolve_resume(str(step[40]), tmp_path / "new", cfg, 2, [], sharded=False)


@pytest.mark.slow  # a Python process of its own, under its own file size limit
def test_atomic_writes_past_a_file_size_limit_raise_and_leave_no_temporary_file(tmp_path):
    """RLIMIT_FSIZE makes a write past its bytes fail (EFBIG) as a full disk does (ENOSPC):
    every atomic writer raises the error, keeps the old file and removes its temporary one."""
    (tmp_path / "m.jsonl").write_text("".join(f'{{"window": {i}}}\n' for i in range(100)))
    (tmp_path / "s.json").write_text("old")
    code = """if True:
        import errno, sys, torch
        from pathlib import Path
        from gradsync.core import files
        from gradsync.train import checkpoint, metrics
        d = Path(sys.argv[1])
        for write in (lambda: files.write_json_atomic(d / "s.json", list(range(500))),
                      lambda: metrics.keep_rows_through(d / "m.jsonl", 80),
                      lambda: checkpoint.save_atomic({"w": torch.zeros(10**5)}, d / "c.pt")):
            try:
                write()
            except OSError as e:
                print(errno.errorcode[e.errno], Path(e.filename).name)
    """
    limit = lambda: resource.setrlimit(resource.RLIMIT_FSIZE, (1000, 1000))  # noqa: E731
    out = subprocess.run([sys.executable, "-c", code, str(tmp_path)], capture_output=True,
                         text=True, preexec_fn=limit, timeout=120)
    assert out.stdout.split("\n") == ["EFBIG s.json", "EFBIG m.jsonl", "EFBIG c.pt", ""], \
        out.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.jsonl", "s.json"]
    assert (tmp_path / "s.json").read_text() == "old"
    assert len((tmp_path / "m.jsonl").read_text().splitlines()) == 100


def test_a_fresh_start_over_existing_checkpoints_is_refused(tmp_path, cfg):
    assert resolve_resume("none", tmp_path, cfg, 2, [], sharded=False) is None
    write_steps(tmp_path / "checkpoints", cfg, [4])
    with pytest.raises(ResumeError, match="already holds checkpoints.*resume=auto"):
        resolve_resume("none", tmp_path, cfg, 2, [], sharded=False)


def test_only_trainer_settings_may_change_on_resume(tmp_path, cfg):
    write_steps(tmp_path / "checkpoints", cfg, [4])
    more = json.loads(json.dumps(cfg))
    more["trainer"].update(max_steps=1000, log_every_windows=1, checkpoint_every_steps=7)
    assert resolve_resume("auto", tmp_path, more, 2, [], sharded=False) is not None
    with pytest.raises(ResumeError, match="written by 2 processes, this run has 3"):
        resolve_resume("auto", tmp_path, cfg, 3, [], sharded=False)
    for key, value, shown in [("model", {"hidden_sizes": [9]}, "model.hidden_sizes=[9]"),
                              ("data", {"num_samples": 7}, "data.num_samples=7"),
                              ("optimizer", {"lr": 0.5}, "optimizer.lr=0.5"),
                              ("seed", 1, "seed=1")]:
        changed = json.loads(json.dumps(cfg))
        if isinstance(value, dict):
            changed[key].update(value)
        else:
            changed[key] = value
        with pytest.raises(ResumeError, match=f"this run has {shown.replace('[', '.')}"):
            resolve_resume("auto", tmp_path, changed, 2, [], sharded=False)


def test_epochwise_keys_compare_equal_after_the_sidecar_json(tmp_path):
    cfg = plain_cfg(["data=synthetic", "schedule=epochwise"])
    write_steps(tmp_path / "checkpoints", cfg, [4])
    edited = json.loads(json.dumps(cfg))
    edited["trainer"]["max_epochs"] = 99
    edited["schedule"]["window_size_by_epoch"] = cfg["schedule"]["window_size_by_epoch"]
    assert resolve_resume("auto", tmp_path, edited, 2, [], sharded=False) is not None


def test_rng_states_round_trip_through_a_weights_only_checkpoint(tmp_path):
    random.seed(1), np.random.seed(2), torch.manual_seed(3)
    np.random.standard_normal()  # leaves a cached gaussian in NumPy's state
    torch.save({"rng": rng_state(CPU)}, tmp_path / "r.pt")
    draws = (random.random(), np.random.standard_normal(3).tolist(), torch.rand(3))
    random.seed(9), np.random.seed(9), torch.manual_seed(9)
    set_rng_state(torch.load(tmp_path / "r.pt", weights_only=True)["rng"], CPU)
    again = (random.random(), np.random.standard_normal(3).tolist(), torch.rand(3))
    assert draws[:2] == again[:2] and torch.equal(draws[2], again[2])


def test_a_resumed_epoch_skips_samples_without_changing_the_order():
    ds = TensorDataset(torch.arange(50).float(), torch.zeros(50))
    loader, sampler = train_loader(ds, 4, rank=1, world_size=2, seed=5)
    full = torch.cat([x for x, _ in epoch_batches(loader, 3)])
    tail = [x for x, _ in epoch_batches(loader, 3, skip_samples=12)]
    assert len(full) == len(sampler) == 25
    assert torch.equal(torch.cat(tail), full[12:]) and [len(t) for t in tail] == [4] * 3 + [1]
    assert not torch.equal(torch.cat([x for x, _ in epoch_batches(loader, 4)]), full)
    before = torch.get_rng_state()
    next(epoch_batches(loader, 3))
    assert torch.equal(torch.get_rng_state(), before)  # the loader has its own generator


class Draws(Dataset):
    """Each item is what the worker's Python, NumPy and torch streams give."""

    def __len__(self):
        return 8

    def __getitem__(self, i):
        return torch.tensor([random.random(), float(np.random.rand()), torch.rand(()).item()])


def test_dataloader_workers_are_seeded_from_seed_rank_and_epoch():
    def draws(rank, epoch, seed=5):
        loader, _ = train_loader(Draws(), 2, rank=rank, world_size=2, seed=seed, num_workers=2)
        return torch.cat(list(epoch_batches(loader, epoch)))

    first = draws(0, 0)
    assert torch.equal(first, draws(0, 0))  # reproducible
    assert len({tuple(row.tolist()) for row in first}) == len(first)  # workers differ
    for other in (draws(1, 0), draws(0, 1), draws(0, 0, seed=6)):
        assert not torch.equal(first, other)


def test_derived_seeds_differ_for_neighbouring_inputs():
    seeds = {derive_seed(s, r) for s in range(3) for r in range(3)}
    assert len(seeds) == 9 and all(0 <= s < 2**63 for s in seeds)
    assert derive_seed(1, 2) == derive_seed(1, 2)


def test_metrics_keep_rows_through_a_step_and_drop_a_torn_line(tmp_path):
    path = tmp_path / "metrics.jsonl"
    rows = [json.dumps({"window": s, "step": s - 1, "loss": 1.0 / s}) for s in range(1, 8)]
    path.write_text("\n".join(rows) + "\n" + rows[-1][:9])
    keep_rows_through(path, 5)
    assert path.read_text() == "\n".join(rows[:5]) + "\n"


def test_stop_agreement_with_one_process_stops_after_the_current_step():
    flag = StopFlag()
    agreement = StopAgreement(flag, None, 1)
    assert agreement.poll() == 0
    flag.signum = 15
    assert agreement.poll() == 15 and agreement.agreed == 15


def test_a_diverged_model_is_never_checkpointed():
    model = torch.nn.Linear(3, 2)
    require_finite_parameters(model, 7)  # type: ignore[arg-type]
    with torch.no_grad():
        model.bias[1] = float("inf")
    with pytest.raises(FloatingPointError, match="non-finite parameters after optimizer step 7"):
        require_finite_parameters(model, 7)  # type: ignore[arg-type]


def test_run_info_reads_the_git_state_when_called_and_keeps_earlier_starts(tmp_path):
    def git(*args):
        subprocess.run(["git", "-C", str(tmp_path), *args], check=True, capture_output=True)

    git("init", "-q")
    (tmp_path / "a.txt").write_text("a")
    git("add", "a.txt")
    git("-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "a")
    head = subprocess.run(["git", "-C", str(tmp_path), "rev-parse", "HEAD"], check=True,
                          capture_output=True, text=True).stdout.strip()
    assert git_state(tmp_path) == {"repo": str(tmp_path), "commit": head, "dirty": False}
    (tmp_path / "a.txt").write_text("b")
    assert git_state(tmp_path)["dirty"] is True
    assert git_state(tmp_path / "nowhere") is None

    info = tmp_path / "run_info.json"
    write_run_info(info, {"started": 1})
    write_run_info(info, {"started": 2})
    write_run_info(info, {"started": 3})
    assert json.loads(info.read_text()) == {
        "started": 3, "previous_starts": [{"started": 1}, {"started": 2}]}


@pytest.mark.parametrize("key,value,allowed", [
    ("checkpoint_every_steps", -1, "an integer >= 0"), ("keep_checkpoints", 0, "an integer >= 1"),
    ("num_workers", -2, "an integer >= 0"), ("fail_at_step", 0, "-1 (never)")])
def test_new_trainer_keys_are_validated(cfg, key, value, allowed):
    bad = json.loads(json.dumps(cfg))
    bad["trainer"][key] = value
    expected = f"trainer.{key}={value} is not allowed: {allowed}"
    with pytest.raises(ConfigError, match=re.escape(expected)):
        preflight(bad)


def test_resume_must_be_none_auto_or_an_existing_path(cfg):
    bad = dict(cfg, resume="/no/such/run")
    with pytest.raises(ConfigError, match="resume='/no/such/run' is not allowed: none, auto"):
        preflight(bad)
