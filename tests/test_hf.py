"""A Hugging Face model as a component (gradsync.hf.CausalLM, conf/model/hf_llama.yaml): a tiny
Llama built from transformers' LlamaConfig (tied embeddings, rotary tables), trained on token
data by every engine on real 2-rank groups: the same model as one process trains on the same
global windows, torch_ddp and gradsync bit for bit, a job killed by SIGKILL resumed bit for
bit, the tied weight one parameter throughout; the example project from its own directory."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

import dist_cases
from configs import losses, plain_cfg
from gradsync.config.schema import RunConfig
from gradsync.run.worker import run_training
from gradsync.train import checkpoint
from resume_harness import Case, Run, check, kill_9_at
from test_components import REPO, cli

pytestmark = [pytest.mark.dist]

EMBED, HEAD = "model.model.embed_tokens.weight", "model.lm_head.weight"
# 96 sequences of 4 to 24 tokens, global windows of 16 sequences: 6 optimizer steps an epoch
HF = ["model=hf_llama", "data=synthetic_lm", "data.num_samples=96", "data.eval_samples=32",
      "data.max_len=24", "optimizer.lr=0.5", "lr_scheduler.warmup_steps=2",
      "trainer.max_epochs=2", "trainer.log_every_windows=1", "trainer.threads_per_worker=1",
      "trainer.progress_bar=false", "trainer.backend=gloo", "trainer.timeout_s=60", "seed=5"]
STEPS_PER_EPOCH = 6


def two_ranks(engine: str) -> list[str]:  # 2 ranks x micro 4 x N 2
    return [*HF, "schedule.micro_batch_size=4", "schedule.window_size=2", "trainer.devices=2",
            f"engine={engine}"]


@pytest.fixture(scope="module")
def one_process(single_process_group, tmp_path_factory):
    """The same global windows in one process: micro 8 x N 2."""
    cfg = plain_cfg([*HF, "schedule.micro_batch_size=8", "schedule.window_size=2",
                     "trainer.devices=1"])
    out = tmp_path_factory.mktemp("hf_one")
    summary = run_training(RunConfig.from_plain(cfg), out)
    return summary, checkpoint.load(out / "checkpoints" / "last.pt")["model"]


@pytest.fixture(scope="module")
def runs(pool2, tmp_path_factory):
    done: dict[str, dict] = {}

    def get(engine: str) -> dict:
        if engine not in done:
            done[engine] = pool2.run(dist_cases.train_run_rows, plain_cfg(two_ranks(engine)),
                                     str(tmp_path_factory.mktemp(f"hf_{engine}")))[0]
        return done[engine]
    return get


def relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max())


@pytest.mark.parametrize("engine", ["torch_ddp", "gradsync", "fsdp"])
def test_two_ranks_train_the_model_one_process_trains(one_process, runs, engine):
    ref_summary, ref = one_process
    out = runs(engine)
    s = out["summary"]
    assert s["optimizer_steps"] == ref_summary["optimizer_steps"] == 2 * STEPS_PER_EPOCH
    assert s["samples_seen"] == ref_summary["samples_seen"] == 2 * 96
    assert sorted(out["params"]) == sorted(ref)  # transformers' names, under model.
    worst = max(relative(out["params"][name], value) for name, value in ref.items())
    print(f"{engine}: worst relative difference {worst:.3g}")
    assert worst < 1e-6, worst
    assert abs(s["final_train_loss"] - ref_summary["final_train_loss"]) < 1e-6
    first, last = out["rows"][0]["loss"], out["rows"][-1]["loss"]  # it trained
    assert last < first - 0.5, (first, last)


@pytest.mark.parametrize("engine", ["torch_ddp", "gradsync", "fsdp"])
def test_the_tied_embedding_stays_one_parameter(runs, engine):
    """Input embedding and output head get different gradients: untied, they would part after
    the first step; tied, the trained model holds one tensor under both names."""
    params = runs(engine)["params"]
    assert torch.equal(params[EMBED], params[HEAD])


def test_gradsync_trains_the_bits_torch_ddp_trains(runs):
    theirs, ours = runs("torch_ddp"), runs("gradsync")
    assert losses(ours["rows"]) == losses(theirs["rows"])
    for name, value in theirs["params"].items():
        assert torch.equal(ours["params"][name], value), name
    assert ours["summary"]["allreduce_bytes"] == theirs["summary"]["allreduce_bytes"]


RESUMED = Run((*two_ranks("torch_ddp"), "trainer.checkpoint_every_steps=2",
               "trainer.keep_checkpoints=50"), STEPS_PER_EPOCH)


@pytest.mark.slow
def test_a_job_killed_by_sigkill_resumes_bitwise_with_the_weight_still_tied(references, pool2,
                                                                             tmp_path, cli_env):
    check(Case("hf kill -9", RESUMED, kill_9_at(4)), references, pool2, tmp_path, cli_env)
    resumed = checkpoint.load(tmp_path / "run" / "checkpoints" / "last.pt")["model"]
    assert torch.equal(resumed[EMBED], resumed[HEAD])


@pytest.mark.slow
def test_the_example_project_trains_a_tiny_llama_from_its_own_directory(tmp_path, cli_env):
    project = tmp_path / "project"
    shutil.copytree(REPO / "examples" / "hf_causal_lm", project)
    done = cli(["--config-dir", "conf", "experiment=tiny_llama", "trainer.max_steps=3",
                "trainer.progress_bar=false",
                "trainer.threads_per_worker=1", "hydra.run.dir=out/run"], project, cli_env)
    assert done.returncode == 0, done.stderr
    run = project / "out" / "run"
    s = json.loads((run / "summary.json").read_text())
    assert (s["status"], s["optimizer_steps"]) == ("completed", 3)
    model = checkpoint.load(run / "checkpoints" / "last.pt")["model"]
    assert model[EMBED].shape == (256, 64) and torch.equal(model[EMBED], model[HEAD])


@pytest.mark.slow
def test_a_key_not_yet_in_a_mapping_argument_is_named_with_the_fix(tmp_path, cli_env):
    typo = cli(["model=hf_llama", "data=synthetic_lm", "model.config.hiden_size=8",
                "hydra.run.dir=run"], tmp_path, cli_env)
    assert typo.returncode == 2 and typo.stderr.splitlines() == [
        "gradsync: config error: model.config.hiden_size: not in model.config of the config: "
        "add it with +model.config.hiden_size=8"], typo.stderr
    assert list(tmp_path.iterdir()) == []


def test_a_hugging_face_config_is_checked_before_anything_runs():
    from gradsync.config.validate import ConfigError
    from gradsync.run.preflight import preflight

    for overrides, message in [
            (["+model.config.hiden_size=8"], "model.config.hiden_size: not a setting of "
                                              "LlamaConfig"),
            (["+model.config.vocab_size=8"], "model.config.vocab_size: set by the data "
                                              "(vocab_size), not here"),
            (["model.config_class=torch.nn.Linear"], "model.config_class='torch.nn.Linear' is "
                                                     "not allowed: a transformers config class"),
            (["model.attn_implementation=flash"], "model.attn_implementation='flash' is not "
                                                  "allowed: one of eager, sdpa")]:
        with pytest.raises(ConfigError) as e:
            preflight(plain_cfg([*HF, *overrides]))
        assert str(e.value).startswith(message), e.value
