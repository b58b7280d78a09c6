"""Models as they are (issue 43): a model whose forward takes the targets and returns
``(logits, loss)`` (nanoGPT's interface: tests/nanogpt_like.py) or a ``ModelOutput`` (a Hugging
Face GPT-2, built from its own config class) plugs in by the model node's ``_forward_`` and
nested ``_target_`` nodes, and trains bit for bit as the same network returning its logits;
weight-decay groups by ``optimizer.no_decay``, read back from the checkpoint; a model config
that its model cannot build or run is one line before any worker starts."""

from __future__ import annotations

import json
import math
import os
import shutil

import pytest
import torch
import yaml

from configs import plain_cfg
from gradsync.components import ConfigError
from gradsync.config.schema import RunConfig
from gradsync.run.main import compose_plain
from gradsync.run.preflight import preflight
from gradsync.run.worker import run_training
from gradsync.train import checkpoint
from gradsync.train.weight_decay import undecayed
from test_components import REPO, cli

# 48 sequences of 4..15 tokens (right-padded: their padding targets reach the model as -1),
# 1 process, micro 8 x N 2: 3 steps an epoch, 2 epochs
BASE = ["data=synthetic_lm", "data.num_samples=48", "data.eval_samples=16", "data.max_len=16",
        "data.vocab_size=24", "optimizer=adamw", "optimizer.lr=0.03", "optimizer.weight_decay=0.1",
        "schedule.micro_batch_size=8", "schedule.window_size=2", "trainer.devices=1",
        "trainer.max_epochs=2", "trainer.threads_per_worker=1", "trainer.progress_bar=false",
        "trainer.clip_grad_norm=1.0", "lr_scheduler.warmup_steps=2", "seed=3"]
EXAMPLE = REPO / "examples" / "nanogpt"


def example_model(name: str, **sizes) -> dict:
    """examples/nanogpt's model YAML as it is, its nested config made tiny; nanoGPT's `model`
    module (not in the repo) replaced by tests/nanogpt_like.py, which has its interface."""
    node = yaml.safe_load((EXAMPLE / "conf" / "model" / f"{name}.yaml").read_text())
    for n in (node, node["config"]):
        n["_target_"] = n["_target_"].replace("model.", "nanogpt_like.", 1)
    node["config"].update(sizes)
    return node


NANOGPT = example_model("nanogpt", block_size=16, n_layer=1, n_head=2, n_embd=16)
GPT_CONFIG = NANOGPT["config"]


def cfg_with(model: dict, overrides: tuple[str, ...] = ()) -> dict:
    cfg = compose_plain([*BASE, *overrides])
    cfg["model"] = model
    preflight(cfg)
    return cfg


def trained(cfg: dict, out) -> tuple[dict, dict]:
    summary = run_training(RunConfig.from_plain(cfg), out)
    return summary, checkpoint.load(out / "checkpoints" / "last.pt")


def test_a_model_returning_logits_and_loss_trains_bit_for_bit_as_its_logits(
        single_process_group, tmp_path):
    s, ck = trained(cfg_with(NANOGPT), tmp_path / "nanogpt")
    ref_s, ref = trained(cfg_with({"_target_": "nanogpt_like.Logits", "config": GPT_CONFIG}),
                         tmp_path / "logits")
    assert s["optimizer_steps"] == 6 and s["final_train_loss"] < math.log(24)  # it learned
    assert s["eval"] == ref_s["eval"] and s["final_train_loss"] == ref_s["final_train_loss"]
    assert ck["model"].keys() == ref["model"].keys()
    assert all(torch.equal(ck["model"][k], ref["model"][k]) for k in ref["model"])
    assert ck["model"]["lm_head.weight"].shape == (24, 16)  # GPTConfig got the data's vocab
    # optimizer.no_decay=[bias, norm] (the YAML's default): nanoGPT's own rule for its GPT,
    # every parameter of fewer than 2 dimensions, as the checkpoint's param_groups record it
    groups = {g["name"]: g for g in ck["optimizer"]["param_groups"]}
    assert (groups["decay"]["weight_decay"], groups["no_decay"]["weight_decay"]) == (0.1, 0.0)
    one_dim = {k for k, v in ck["model"].items() if v.dim() < 2}
    assert set(groups["no_decay"]["param_names"]) == one_dim
    assert set(groups["decay"]["param_names"]) == {"wte.weight", "wpe.weight"} | {
        k for k in ck["model"] if k.startswith("h.") and k.endswith("weight") and
        ck["model"][k].dim() == 2}
    assert ck["optimizer"]["param_groups"] == ref["optimizer"]["param_groups"]


def test_decay_rules_by_kind_and_glob():
    import nanogpt_like

    model = nanogpt_like.GPT(nanogpt_like.GPTConfig())
    assert undecayed(model, ["embedding"]) == {"wte.weight", "wpe.weight"}  # tied head too
    assert undecayed(model, ["norm"]) == {"h.0.ln_1.weight", "h.0.ln_1.bias", "h.0.ln_2.weight",
                                          "h.0.ln_2.bias", "ln_f.weight", "ln_f.bias"}
    assert undecayed(model, ["h.*.c_*.weight"]) == {"h.0.c_attn.weight", "h.0.c_proj.weight"}
    assert undecayed(model, []) == set()


def test_a_hugging_face_gpt2_from_its_own_config_class_trains(single_process_group, tmp_path):
    """transformers' GPT2LMHeadModel(config=GPT2Config(...)) from config alone: the output's
    `logits`, the data's vocab_size given to the config class."""
    gpt2 = example_model("hf_gpt2", n_embd=16, n_layer=1, n_head=2, n_positions=16)
    assert gpt2["_target_"] == "transformers.GPT2LMHeadModel"
    s, ck = trained(cfg_with(gpt2, ("trainer.log_every_windows=1",)), tmp_path)
    assert s["optimizer_steps"] == 6 and s["final_train_loss"] < math.log(24)
    assert ck["model"]["transformer.wte.weight"].shape == (24, 16)
    groups = {g["name"]: set(g["param_names"]) for g in ck["optimizer"]["param_groups"]}
    assert "transformer.h.0.ln_1.weight" in groups["no_decay"]
    assert "transformer.h.0.attn.c_attn.bias" in groups["no_decay"]
    assert "transformer.wte.weight" in groups["decay"]


GPT_BAD = [
    ({"_target_": "nanogpt_like.GPT", "config": GPT_CONFIG},
     "model (nanogpt_like.GPT) returned a tuple for a micro-batch of the data's shape (inputs "
     "[2, 15]), where gradsync wants the logits: set model._forward_.logits to the logits' "
     "position (0) or name (logits)"),
    ({**NANOGPT, "_forward_": {"logits": 0}},
     "model (nanogpt_like.GPT) returned logits of shape [2, 1, 24] for a micro-batch of the "
     "data's shape (inputs [2, 15]); the data's targets want [2, 15, 24] (a score for each of "
     "the vocab_size=24 tokens at every position); without model._forward_.targets it may "
     "predict the last position only"),
    ({**NANOGPT, "_forward_": {"targets": "labels", "logits": 0}},
     "model._forward_.targets='labels' is not allowed: nanogpt_like.GPT's forward takes no such "
     "keyword (it takes idx, targets)"),
    ({**NANOGPT, "_forward_": {"target": "targets"}},
     "model._forward_.target: unknown key; allowed keys: targets, logits, ignore_index"),
    ({**NANOGPT, "config": {**GPT_CONFIG, "block_size": 8}},
     "model (nanogpt_like.GPT) cannot run a micro-batch of the data's shape (inputs [2, 15]): "
     "AssertionError: sequence of 15 > block_size"),
    ({**NANOGPT, "config": {**GPT_CONFIG, "n_embd": 15}},
     "model (nanogpt_like.GPT) cannot be built: AssertionError: assert config.n_embd % "
     "config.n_head == 0 failed"),
    ({**NANOGPT, "config": {**GPT_CONFIG, "n_layers": 2}},
     "model.config.n_layers: unknown key for nanogpt_like.GPTConfig; accepted keys: bias, "
     "block_size, dropout, n_embd, n_head, n_layer"),
    ({**NANOGPT, "config": {**GPT_CONFIG, "vocab_size": 65}},
     "model.config.vocab_size: set by gradsync at run time, not in the config"),
    ({**NANOGPT, "config": {**GPT_CONFIG, "n_head": "2"}},
     "model.config.n_head='2' is not allowed: nanogpt_like.GPTConfig takes an integer"),
    # transformers' own classes: the config class as a nested node, held as CausalLM's is
    (example_model("hf_gpt2", n_embd=16, n_layer=1, n_head=2, n_positions=8),
     "model.config.n_positions=8 is not allowed: at least the data's max_len=15"),
    (example_model("hf_gpt2", n_embd=30, n_layer=1, n_head=4, n_positions=16),
     "model.config.n_embd=30 is not allowed: a multiple of model.config.n_head=4"),
]


@pytest.mark.parametrize("model,expected", GPT_BAD, ids=[e[:48] for _, e in GPT_BAD])
def test_a_model_that_cannot_run_as_configured_is_refused_in_one_line(model, expected):
    with pytest.raises(ConfigError) as e:
        cfg_with(model)
    assert str(e.value).startswith(expected), str(e.value)
    assert "\n" not in str(e.value)


def test_a_no_decay_glob_that_matches_nothing_is_refused():
    with pytest.raises(ConfigError, match=r"optimizer\.no_decay: 'h\.\*\.ln_x\*' matches no "):
        cfg_with(NANOGPT, ("optimizer.no_decay=[bias,h.*.ln_x*]",))


# Hugging Face configs their config class accepts and their model cannot build or run (or
# would take minutes and gigabytes to): refused by the preflight, one line
HF = ["model=hf_llama", "data=synthetic_lm"]
HF_BAD = [
    (["model.config.num_attention_heads=4", "model.config.num_key_value_heads=3"],
     "model.config.num_key_value_heads=3 is not allowed: a divisor of "
     "model.config.num_attention_heads=4"),
    (["model.config.num_attention_heads=3"], "model.config: LlamaConfig refuses it: ValueError: "
     "The hidden size (32) is not a multiple of the number of attention heads (3)."),
    (["model.config.num_hidden_layers=0"],
     "model.config.num_hidden_layers=0 is not allowed: an integer >= 1"),
    (["model.config.hidden_size=0"], "model.config.hidden_size=0 is not allowed"),
    (["model.config.num_key_value_heads=0"], "model.config.num_key_value_heads=0 is not allowed"),
    (["model.config.num_hidden_layers=100000"], "model.config.num_hidden_layers=100000 is not "
     "allowed: at most model.max_layers=1024"),
    (["model.config.hidden_size=65536", "model.config.intermediate_size=65536"],
     "model.config: LlamaConfig of 60,131,966,976 parameters is not allowed: at most "
     "model.max_parameters=1,000,000,000"),
    (["model.config_class=transformers.GPT2Config", "~model.config",
      "+model.config={n_embd:30,n_head:4,n_layer:2}"],
     "model.config.n_embd=30 is not allowed: a multiple of model.config.n_head=4"),
]


@pytest.mark.parametrize("args,expected", HF_BAD, ids=[" ".join(a) for a, _ in HF_BAD])
def test_a_hugging_face_config_its_model_cannot_run_is_refused(args, expected):
    with pytest.raises(ConfigError) as e:
        plain_cfg([*HF, *args])
    assert str(e.value).startswith(expected), str(e.value)


@pytest.mark.slow
def test_the_nanogpt_example_trains_from_its_own_directory(tmp_path, cli_env):
    """examples/nanogpt copied outside the repo, `model` on PYTHONPATH as a nanoGPT clone would
    be (here a module re-exporting tests/nanogpt_like.py); a block shorter than the data's
    windows is one line before any worker starts, nothing written."""
    project = tmp_path / "project"
    shutil.copytree(EXAMPLE, project)
    (tmp_path / "clone").mkdir()
    (tmp_path / "clone" / "model.py").write_text("from nanogpt_like import GPT, GPTConfig\n")
    env = cli_env | {"PYTHONPATH": os.pathsep.join([str(tmp_path / "clone"),
                                                    str(REPO / "tests")])}
    short = cli(["--config-dir", "conf", "experiment=nanogpt", "model.config.block_size=32",
                 "hydra.run.dir=out/short"], project, env)
    assert short.returncode == 2 and short.stderr.splitlines() == [
        "gradsync: config error: model (model.GPT) cannot run a micro-batch of the data's shape "
        "(inputs [2, 64]): AssertionError: sequence of 64 > block_size"], short.stderr
    typo = cli(["--config-dir", "conf", "experiment=nanogpt", "model.config.n_layers=2",
                "hydra.run.dir=out/typo"], project, env)
    assert typo.returncode == 2 and typo.stderr.splitlines() == [
        "gradsync: config error: model.config.n_layers: unknown key for model.GPTConfig; "
        "accepted keys: bias, block_size, dropout, n_embd, n_head, n_layer"], typo.stderr
    assert not (project / "out" / "typo").exists()
    done = cli(["--config-dir", "conf", "experiment=nanogpt", "trainer.max_steps=2",
                "data.max_bytes=300000", "trainer.progress_bar=false",
                "trainer.threads_per_worker=1", "hydra.run.dir=out/run"], project, env)
    assert done.returncode == 0, done.stderr
    run = project / "out" / "run"
    s = json.loads((run / "summary.json").read_text())
    assert (s["status"], s["optimizer_steps"], s["world_size"], s["samples_seen"]) == (
        "completed", 2, 2, 2 * 2 * 8 * 4)
    ck = checkpoint.load(run / "checkpoints" / "last.pt")
    assert ck["model"]["lm_head.weight"].shape == (256, 128)  # 4 layers of width 128
    groups = {g["name"]: g for g in ck["optimizer"]["param_groups"]}
    assert (groups["decay"]["weight_decay"], groups["no_decay"]["weight_decay"]) == (0.1, 0.0)
