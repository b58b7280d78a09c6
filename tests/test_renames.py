"""The glossary's names (docs/architecture.md "Glossary"): the window's size is `window_size`
everywhere, a cadence names its unit (`trainer.log_every_windows`, `eval_every_steps`,
`checkpoint_every_steps`). An old name on the command line or in a YAML file answers with one
line naming the new one (test_config.py runs WINDOW_CASES with the other renames); a checkpoint
written under the old names resumes, bit for bit, where the values mean the same.

This file holds the old names on purpose: /work/notes/renames.sh (the rename, re-run after a
merge) leaves it alone."""

from __future__ import annotations

import copy
import json

import pytest

from configs import plain_cfg
from gradsync.config.renames import RENAMED, upgrade_renamed_keys
from gradsync.config.schema import RunConfig
from gradsync.train import checkpoint
from gradsync.train.checkpoint import ResumeError, resolve_resume
from gradsync.train.repro import config_hash

# old key -> (the choices it needs, a value for it): test_config.py RENAMED_CASES takes these
WINDOW_CASES = {
    "schedule.accum_steps": ([], "8"),
    "schedule.accum_steps_by_epoch": (["schedule=epochwise"], "{0: 2}"),
    "schedule.initial_accum_steps": (["schedule=adaptive"], "2"),
    "schedule.min_accum_steps": (["schedule=adaptive"], "2"),
    "schedule.max_accum_steps": (["schedule=adaptive"], "8"),
    "trainer.log_every": ([], "5"),
    "trainer.eval_every": ([], "5"),
    "trainer.checkpoint_every": ([], "5"),
}

# the keys as gradsync recorded them before the renames: new -> old
OLD_KEYS = {"schedule": {"window_size": "accum_steps",
                         "window_size_by_epoch": "accum_steps_by_epoch",
                         "initial_window_size": "initial_accum_steps",
                         "min_window_size": "min_accum_steps",
                         "max_window_size": "max_accum_steps"},
            "trainer": {"log_every_windows": "log_every", "eval_every_steps": "eval_every",
                        "checkpoint_every_steps": "checkpoint_every"}}


def recorded_before_the_renames(cfg: dict) -> dict:
    """`cfg` (a plain config of today) as a checkpoint written before the renames holds it."""
    old = copy.deepcopy(cfg)
    for group, keys in OLD_KEYS.items():
        old[group] = {keys.get(k, k): v for k, v in old[group].items()}
    return old


def test_the_renamed_keys_are_the_ones_a_checkpoint_recorded():
    cfg = plain_cfg(["data=synthetic"])
    old = recorded_before_the_renames(cfg)
    assert old["schedule"]["accum_steps"] == cfg["schedule"]["window_size"] == 4
    assert old["trainer"]["log_every"] == cfg["trainer"]["log_every_windows"]
    for group, keys in OLD_KEYS.items():
        for new, gone in keys.items():
            assert RENAMED[f"{group}.{gone}"].split(" ")[0] == f"{group}.{new}"
    assert set(WINDOW_CASES) <= set(RENAMED)
    # read under the new names: the same config, and the same RunConfig
    assert json.loads(json.dumps(upgrade_renamed_keys(old))) == json.loads(json.dumps(cfg))
    assert RunConfig.from_plain(old) == RunConfig.from_plain(cfg)
    epochwise = plain_cfg(["data=synthetic", "schedule=epochwise"])
    assert RunConfig.from_plain(recorded_before_the_renames(epochwise)) == \
        RunConfig.from_plain(epochwise)


def test_a_checkpoint_written_under_the_old_names_resumes_unless_a_value_changed(tmp_path):
    cfg = plain_cfg(["data=synthetic", "model.hidden_sizes=[8]"])
    old = recorded_before_the_renames(cfg)
    assert config_hash(old) != config_hash(cfg)  # compared key by key
    checkpoint.write({"step": 4, "world_size": 2, "config": old,
                      "config_hash": config_hash(old)}, tmp_path / "checkpoints", 3)
    assert resolve_resume("auto", tmp_path, cfg, 2, [], sharded=False) is not None
    longer = json.loads(json.dumps(cfg))
    longer["trainer"].update(max_steps=1000, log_every_windows=1)  # a trainer setting: may
    assert resolve_resume("auto", tmp_path, longer, 2, [], sharded=False) is not None
    other = json.loads(json.dumps(cfg))
    other["schedule"]["window_size"] = 2
    with pytest.raises(ResumeError) as e:
        resolve_resume("auto", tmp_path, other, 2, [], sharded=False)
    assert str(e.value).splitlines() == [
        f"{tmp_path / 'checkpoints' / 'step_00000004.pt'} was trained with "
        "schedule.window_size=4, this run has schedule.window_size=2; only trainer settings "
        "other than the world size (more steps or epochs, cadences) may change on resume: use "
        "a new run dir"]


@pytest.mark.dist
def test_a_checkpoint_written_under_the_old_names_resumes_bitwise(references, pool2, tmp_path,
                                                                   cli_env):
    """The reference's checkpoint of step 6 (mid-epoch), its config and its progress rewritten
    as gradsync recorded them before the renames (schedule.accum_steps, ...; the windows of the
    epoch done as epoch_step), resumed on the pool: every later window's loss and the final
    parameters, bit for bit those of the uninterrupted run."""
    from resume_harness import Case, Ctx, Start, check
    from test_resume import EXACT_RUNS

    def old_checkpoint(ctx: Ctx) -> Start:
        state = checkpoint.load(ctx.ref.checkpoint(6))
        state["config"] = recorded_before_the_renames(state["config"])
        state["config_hash"] = config_hash(state["config"])
        progress = state["progress"]
        assert progress["epoch_windows"] > 0  # mid-epoch: where it resumes depends on it
        progress["epoch_step"] = progress.pop("epoch_windows")
        path = checkpoint.write(state, ctx.tmp / "old", 1)
        assert path is not None and "accum_steps" in checkpoint.load(path)["config"]["schedule"]
        assert "epoch_windows" not in checkpoint.load(path)["progress"]
        return Start(ctx.tmp, path, resume=str(path), rows_kept=False)

    check(Case("written under the old names", EXACT_RUNS["fp32"], old_checkpoint), references,
          pool2, tmp_path, cli_env)


def test_a_job_of_an_older_sweep_reads_with_its_window_size(tmp_path):
    """A sweep dir holding a job written before the rename (summary.json and metrics.jsonl
    with accum_steps) still gives its N and global batch in the sweep summary's row."""
    import yaml

    from gradsync.run import sweep

    job = tmp_path / "0"
    (job / ".hydra").mkdir(parents=True)
    (job / ".hydra" / "hydra.yaml").write_text(yaml.safe_dump(
        {"hydra": {"overrides": {"task": ["schedule.accum_steps=4"]}, "job": {"num": 0}}}))
    (job / "summary.json").write_text(json.dumps(
        {"status": "completed", "world_size": 2, "micro_batch_size": 8, "accum_steps": 4}))
    (job / "metrics.jsonl").write_text(json.dumps(
        {"samples": 64, "loss": 1.5, "noise_scale": 12.0, "accum_steps": 4}) + "\n")
    read = sweep.read_job(job)
    assert read.summary["window_size"] == 4 and "accum_steps" not in read.summary
    assert sweep._global_batch(read.summary) == 64
    assert read.noise == [(64, 12.0, 4)]
