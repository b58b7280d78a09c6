"""Token data, the causal transformer, and the loss averaged over the global token count: exact
across micro-batches and ranks, where per-micro-batch means (the 2024 accumulation bug) are not."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from collections import Counter

import pytest
import torch
import torch.nn.functional as F
from hydra import compose, initialize_config_dir

import dist_cases
from configs import losses, plain_cfg
from gradsync.components import build
from gradsync.config.schema import RunConfig
from gradsync.config.validate import ConfigError
from gradsync.data.evaluation import evaluate
from gradsync.data.tokens import IGNORE_INDEX, pad_batch, token_loss_per_sample
from gradsync.models import Transformer
from gradsync.run.main import CONF_DIR
from gradsync.run.preflight import preflight
from gradsync.run.worker import run_training
from gradsync.train import checkpoint
from gradsync.train.normalize import resolve
from gradsync.train.schedules import build_schedule
from test_config import compose_plain
from test_torch_ddp import run_overrides

LM_DATA = {"_target_": "gradsync.data.synthetic_lm", "num_samples": 512,
           "eval_samples": 50, "vocab_size": 32, "min_len": 4, "max_len": 64, "max_stride": 4,
           "noise": 0.05}


def build_data(node: dict, seed: int):
    """The data as the worker builds it from its config node."""
    return build(node, {"seed": seed})


def test_synthetic_lm_is_deterministic_from_the_seed_and_spans_the_length_range():
    a, b, c = build_data(LM_DATA, 1), build_data(LM_DATA, 1), build_data(LM_DATA, 2)
    assert all(torch.equal(a.train[i], b.train[i]) for i in range(len(a.train)))
    assert not all(torch.equal(a.train[i], c.train[i]) for i in range(10))
    lengths = [len(s) for s in a.train]
    assert (min(lengths), max(lengths)) == (4, 64)
    assert (len(a.train), len(a.eval), a.sizes["max_len"], a.unit) == (512, 50, 63, "tokens")
    assert a.tokens_per_sample == pytest.approx(sum(n - 1 for n in lengths) / 512)
    # the rule: each sequence steps by one stride in 1..4; noise breaks about 10 % of the steps
    follow = total = 0
    strides = set()
    for s in a.train:
        steps = ((s[1:] - s[:-1]) % 32).tolist()
        stride, hits = Counter(steps).most_common(1)[0]
        strides.add(stride)
        follow, total = follow + hits, total + len(steps)
    assert strides == {1, 2, 3, 4}
    assert 0.85 < follow / total < 0.95


def test_pad_batch_right_pads_inputs_and_ignores_padding_targets():
    x, y = pad_batch([torch.tensor([5, 6, 7, 8]), torch.tensor([1, 2])])
    assert x.tolist() == [[5, 6, 7], [1, 0, 0]]
    assert y.tolist() == [[6, 7, 8], [2, IGNORE_INDEX, IGNORE_INDEX]]
    assert token_loss_per_sample(torch.zeros(2, 3, 9), y)[1].tolist() == [3, 1]


def test_transformer_outputs_at_real_tokens_ignore_padding_and_the_future():
    torch.manual_seed(0)
    model = Transformer(32, 63, d_model=16, n_layers=2, n_heads=2, mlp_ratio=4).eval()
    short, long = torch.randint(0, 32, (10,)), torch.randint(0, 32, (50,))
    padded, _ = pad_batch([short, long])  # short is followed by 40 padding positions
    alone, _ = pad_batch([short])
    with torch.no_grad():
        ref = model(alone)[0]
        torch.testing.assert_close(model(padded)[0, :9], ref, rtol=1e-5, atol=1e-6)
        changed = alone.clone()
        changed[0, -1] = (changed[0, -1] + 1) % 32
        out = model(changed)[0]
    torch.testing.assert_close(out[:-1], ref[:-1], rtol=0, atol=1e-6)  # causal
    assert (out[-1] - ref[-1]).abs().max() > 1e-3


def test_lm_loss_sum_adds_the_real_tokens_losses_only():
    torch.manual_seed(0)
    logits = torch.randn(2, 3, 7)
    y = torch.tensor([[1, 2, 3], [4, IGNORE_INDEX, IGNORE_INDEX]])
    expected = -sum(F.log_softmax(logits[b, t], -1)[y[b, t]] for b, t in
                    [(0, 0), (0, 1), (0, 2), (1, 0)])
    sums, counts = token_loss_per_sample(logits, y)
    assert sums.sum().item() == pytest.approx(expected.item(), rel=1e-6)
    assert counts.tolist() == [3, 1]
    logits[1, 1:] = 1e4  # whatever the model says at padding positions
    assert token_loss_per_sample(logits, y)[0].sum().item() == pytest.approx(expected.item(),
                                                                             rel=1e-6)


def test_lm_evaluate_scores_every_token_once_whatever_the_batching():
    data = build_data(LM_DATA, 0)
    torch.manual_seed(0)
    model = Transformer(32, data.sizes["max_len"], d_model=16, n_layers=1, n_heads=2,
                        mlp_ratio=2)
    total = correct = count = 0.0
    with torch.no_grad():
        for s in data.eval:  # one unpadded sequence at a time
            logits = model(s[:-1][None])[0]
            total += F.cross_entropy(logits, s[1:], reduction="sum").item()
            correct += (logits.argmax(-1) == s[1:]).sum().item()
            count += len(s) - 1
    for batch_size in (1000, 7):
        m = evaluate(model, data, 0, 1, torch.device("cpu"), batch_size)
        assert m["loss"] == pytest.approx(total / count, rel=1e-5)
        assert m["accuracy"] == correct / count
        assert m["perplexity"] == pytest.approx(math.exp(total / count), rel=1e-5)


# --- one window on 2 real ranks: gradients ----------------------------------------------------
def reference_window(objective: str):
    """Single process, no DDP, unpadded sequences: the loss and gradient each normalisation
    stands for, over the window of dist_cases.LM_LENGTHS on both ranks."""
    model = dist_cases.tiny_lm()
    window = dist_cases.lm_window_batches()  # [rank][micro] -> sequences

    def summed(seqs):
        return sum(F.cross_entropy(model(s[:-1][None])[0], s[1:], reduction="sum")
                   for s in seqs)

    seqs = [s for rank in window for micro in rank for s in micro]
    if objective == "tokens":  # every token of the window weighs the same
        loss = summed(seqs) / sum(len(s) - 1 for s in seqs)
    elif objective == "samples":  # every sequence weighs the same
        loss = sum(summed([s]) / (len(s) - 1) for s in seqs) / len(seqs)
    else:  # micro_batch_mean: the mean of each micro-batch's own token mean
        means = [summed(m) / sum(len(s) - 1 for s in m) for rank in window for m in rank]
        loss = sum(means) / len(means)
    loss.backward()
    return torch.cat([p.grad.flatten() for p in model.parameters()]), loss.item()


@pytest.mark.dist
@pytest.mark.parametrize("normalize,precision,tol", [
    ("tokens", "fp32", 1e-5), ("tokens", "fp16", 5e-3), ("samples", "fp32", 1e-5),
    ("micro_batch_mean", "fp32", 1e-5)])
def test_each_normalisation_applies_the_gradient_of_its_objective(pool2, normalize, precision,
                                                                   tol):
    r0, r1 = pool2.run(dist_cases.lm_window_grad, normalize, precision)
    ref_grad, ref_loss = reference_window(normalize)
    torch.testing.assert_close(r0["grad"], r1["grad"], rtol=0, atol=0)
    torch.testing.assert_close(r0["grad"], ref_grad, rtol=tol, atol=tol * 1e-2)
    assert (r0["loss"] + r1["loss"]) / 2 == pytest.approx(ref_loss, rel=tol)
    if precision == "fp16":
        assert r0["scale"] == 65536.0  # the scaler stepped: no inf, no back-off


def test_the_three_objectives_differ_on_this_window():
    """So each check above could only pass with the right normalisation."""
    grads = {name: reference_window(name)[0] for name in ("tokens", "samples",
                                                          "micro_batch_mean")}
    for a, b in [("tokens", "samples"), ("tokens", "micro_batch_mean"),
                 ("samples", "micro_batch_mean")]:
        rel = ((grads[a] - grads[b]).norm() / grads[a].norm()).item()
        assert rel > 0.2, (a, b, rel)


# --- whole runs: factorisations of one global batch -------------------------------------------
def lm_cfg(devices: int, micro: int, accum: int, normalize: str, clip: float = 0.0) -> dict:
    """104 sequences of 2..48 tokens, global batch 16: each epoch ends in a partial window of
    8 sequences; 2 epochs = 14 steps."""
    return plain_cfg([*run_overrides(devices, micro, accum), "model=transformer",
                      "model.d_model=16", "model.mlp_ratio=2", "data=synthetic_lm",
                      "data.num_samples=104", "data.eval_samples=32", "data.vocab_size=16",
                      "data.min_len=2", "data.max_len=48", "data.max_stride=3", "data.noise=0.1",
                      "optimizer.lr=0.3", f"trainer.clip_grad_norm={clip}",
                      f"loss.normalize={normalize}"])


def train_here(cfg: dict, run_dir) -> tuple[dict, dict]:
    summary = run_training(RunConfig.from_plain(cfg), run_dir)
    return summary, checkpoint.load(run_dir / "checkpoints" / "last.pt")["model"]


def max_diff(a: dict, b: dict) -> float:
    return max((a[k] - b[k]).abs().max().item() for k in a)


@pytest.fixture(scope="module")
def direct_reference(single_process_group, tmp_path_factory):
    """1 process, N=1: each window is one micro-batch, so micro_batch_mean divides its summed
    token loss by the window's token count directly, with nothing deferred: the objective
    token normalisation must reproduce."""
    return train_here(lm_cfg(1, 16, 1, "micro_batch_mean"), tmp_path_factory.mktemp("direct"))


@pytest.mark.parametrize("clip", [0.0, 0.5])
def test_deferred_rescale_equals_dividing_by_the_token_count(
        single_process_group, direct_reference, tmp_path, clip):
    """Same run with tokens: backward on summed losses, one rescale before clipping."""
    ref_summary, ref_params = direct_reference
    if clip:
        ref_summary, ref_params = train_here(lm_cfg(1, 16, 1, "micro_batch_mean", clip),
                                             tmp_path / "direct")
    summary, params = train_here(lm_cfg(1, 16, 1, "tokens", clip), tmp_path / "tokens")
    assert (summary["loss_normalize"], summary["optimizer_steps"]) == ("tokens", 14)
    assert max_diff(params, ref_params) < 2e-6
    assert summary["final_train_loss"] == pytest.approx(ref_summary["final_train_loss"],
                                                        rel=1e-6)


@pytest.mark.dist
@pytest.mark.parametrize("micro,accum", [(2, 4), (4, 2)])
def test_token_normalised_factorisations_train_the_same_model(
        pool2, direct_reference, tmp_path, micro, accum):
    ref_summary, ref_params = direct_reference
    r0, _ = pool2.run(dist_cases.train_run, lm_cfg(2, micro, accum, "tokens"), str(tmp_path))
    s = r0["summary"]
    assert (s["optimizer_steps"], s["samples_seen"], s["loss_normalize"]) == (14, 208, "tokens")
    assert s["sync_backwards"] == [14, 14]
    assert max_diff(r0["params"], ref_params) < 2e-6
    assert s["final_train_loss"] == pytest.approx(ref_summary["final_train_loss"], rel=1e-5)
    assert s["eval"]["loss"] == pytest.approx(ref_summary["eval"]["loss"], rel=1e-5)
    # training moved the parameters (the check has teeth)
    torch.manual_seed(3)  # the seed of synthetic_cfg, as the worker seeds before building
    init = Transformer(16, 47, d_model=16, n_layers=2, n_heads=2, mlp_ratio=2).state_dict()
    assert max_diff(ref_params, init) > 0.1


@pytest.mark.dist
def test_per_micro_batch_means_train_another_model(pool2, direct_reference, tmp_path):
    _, ref_params = direct_reference
    r0, _ = pool2.run(dist_cases.train_run, lm_cfg(2, 2, 4, "micro_batch_mean"), str(tmp_path))
    assert r0["summary"]["loss_normalize"] == "micro_batch_mean"
    assert max_diff(r0["params"], ref_params) > 1e-2  # thousands of times the tolerance above


# --- learning, the preset, bad input -----------------------------------------------------------
def bigram_accuracy(data) -> float:
    """Held-out accuracy of the best next-token guess from the current token alone, counted on
    the training set: what a model that ignores the context can reach."""
    vocab = data.sizes["vocab_size"]
    counts = torch.zeros(vocab, vocab)
    for s in data.train:
        counts.index_put_((s[:-1], s[1:]), torch.ones(len(s) - 1), accumulate=True)
    guess = counts.argmax(1)
    hits = sum((guess[s[:-1]] == s[1:]).sum().item() for s in data.eval)
    return hits / sum(len(s) - 1 for s in data.eval)


def test_the_transformer_learns_the_rule_beyond_a_bigram_model(single_process_group, tmp_path):
    cfg = lm_cfg(1, 32, 1, "tokens")
    cfg["data"].update(num_samples=2048, eval_samples=128, vocab_size=32, min_len=4, max_len=32,
                       max_stride=4, noise=0.05)
    cfg["model"].update(d_model=32, mlp_ratio=4)
    cfg["optimizer"] = {"_target_": "torch.optim.AdamW", "_partial_": True, "lr": 0.01,
                        "betas": [0.9, 0.999], "eps": 1e-8, "weight_decay": 0.01}
    cfg["trainer"]["max_steps"] = 60
    cfg["lr_scheduler"] = {"_target_": "gradsync.train.lr_schedulers.warmup_cosine",
                           "warmup_steps": 5, "min_lr_ratio": 0.1}
    ev = run_training(RunConfig.from_plain(cfg), tmp_path)["eval"]
    bigram = bigram_accuracy(build_data(cfg["data"], cfg["seed"]))
    assert bigram < 0.35  # about 1/max_stride
    assert ev["accuracy"] > bigram + 0.2, (ev, bigram)
    assert ev["perplexity"] == pytest.approx(math.exp(ev["loss"]))


def test_lm_accum_sweep_is_one_valid_run_and_a_sweep_of_valid_runs():
    cfg = compose_plain(["experiment=lm_accum_sweep"])
    preflight(cfg)
    assert (cfg["model"]["_target_"], cfg["data"]["_target_"], cfg["trainer"]["devices"]) == \
        ("gradsync.models.Transformer", "gradsync.data.synthetic_lm", 2)
    assert resolve(cfg["loss"]["normalize"], "tokens") == "tokens"
    assert build_schedule(RunConfig.from_plain(cfg).schedule, 2).window_size(0) == 4
    with initialize_config_dir(config_dir=CONF_DIR, version_base="1.3"):
        params = compose("config", overrides=["experiment=lm_accum_sweep"],
                         return_hydra_config=True).hydra.sweeper.params
    assert set(params) == {"schedule.micro_batch_size", "loss.normalize"}
    accum = set()
    for micro in params["schedule.micro_batch_size"].split(","):
        for normalize in params["loss.normalize"].split(","):
            job = compose_plain(["experiment=lm_accum_sweep", f"schedule.micro_batch_size={micro}",
                                 f"loss.normalize={normalize}"])
            preflight(job)
            assert job["schedule"]["global_batch_size"] == 64
            accum.add(build_schedule(RunConfig.from_plain(job).schedule, 2).window_size(0))
    assert accum == {1, 2, 4, 8}


BAD_LM = [
    (["loss.normalize=foo"],
     "loss.normalize='foo' is not allowed: one of auto, tokens, samples, micro_batch_mean"),
    (["model.n_heads=3"], "model.d_model=32 is not allowed: a positive multiple of "
     "model.n_heads=3"),
    (["data.min_len=1"], "data.min_len=1 is not allowed: an integer >= 2"),
    (["data.max_len=3"], "data.max_len=3 is not allowed: an integer >= data.min_len=4"),
    (["data.max_stride=32"], "data.max_stride=32 is not allowed: an integer in [1, "
     "data.vocab_size=32)"),
    (["model=mlp"], "model: gradsync.models.MLP needs in_dim, which data "
     "(gradsync.data.synthetic_lm) does not provide (it provides vocab_size, max_len)"),
]


@pytest.mark.parametrize("overrides,message", BAD_LM, ids=[" ".join(o) for o, _ in BAD_LM])
def test_bad_lm_config_is_refused_naming_the_key(overrides, message):
    cfg = compose_plain(["experiment=lm_accum_sweep", *overrides])
    with pytest.raises(ConfigError) as e:
        preflight(cfg)
    assert str(e.value).startswith(message)


def test_the_transformer_on_sample_data_is_refused():
    with pytest.raises(ConfigError, match=r"^model: gradsync.models.Transformer needs "
                       r"vocab_size, which data \(gradsync.data.digits\) does not provide"):
        preflight(compose_plain(["model=transformer"]))


@pytest.mark.slow
def test_lm_accum_sweep_runs_as_a_single_run(tmp_path, cli_env):
    run = tmp_path / "run"
    proc = subprocess.run(
        [sys.executable, "-m", "gradsync.run.main", "experiment=lm_accum_sweep",
         f"hydra.run.dir={run}", "trainer.progress_bar=false", "trainer.max_steps=3",
         "data.num_samples=256", "data.eval_samples=32"],
        capture_output=True, text=True, env=cli_env, timeout=300)
    assert proc.returncode == 0, proc.stderr
    s = json.loads((run / "summary.json").read_text())
    assert (s["loss_normalize"], s["world_size"], s["window_size"]) == ("tokens", 2, 4)
    assert (s["optimizer_steps"], s["samples_seen"], s["sync_backwards"]) == (3, 192, [3, 3])
    assert set(s["eval"]) == {"loss", "accuracy", "perplexity"}
    assert s["eval"]["perplexity"] == pytest.approx(math.exp(s["eval"]["loss"]))
    assert 2.0 < s["final_train_loss"] < 4.0  # a per-token mean near log(32) = 3.47, not a sum
    assert "eval_perplexity=" in proc.stdout


@pytest.mark.dist
def test_uniform_length_windows_train_the_same_bits_without_counting_their_tokens(pool2,
                                                                                  tmp_path):
    """data.packed: every window holds exactly max_len - 1 loss tokens, so a window's token
    count is its real samples times that, without the count's all-reduce (train/normalize.py
    ByTokens uniform): the same parameters and losses, bit for bit, as counting them, over
    epochs that end in a partial window that holds a sampler's repeat on one rank."""
    root = tmp_path / "corpus"
    root.mkdir()
    for i in range(13):  # 89 windows: odd, the sampler repeats one on rank 1
        (root / f"m{i}.py").write_bytes(b"def f(x):\n    return x * %d\n\n" % i * (i % 3 + 2))
    cfg = plain_cfg([*run_overrides(2, 3, 2), "model=transformer", "model.d_model=16",
                     "model.mlp_ratio=2", "data=stdlib_text", f"data.root={root}",
                     "data.max_len=12", "data.max_bytes=100000", "data.eval_fraction=0.2",
                     "data.packed=true", "optimizer=adamw", "optimizer.lr=0.01"])
    data = build_data(cfg["data"], cfg["seed"])
    assert data.uniform_length and data.tokens_per_sample == 11.0
    assert len(data.train) == 89  # each epoch ends in a partial window holding the repeat
    known = pool2.run(dist_cases.train_counting_tokens, cfg, str(tmp_path / "known"), False)[0]
    counted = pool2.run(dist_cases.train_counting_tokens, cfg, str(tmp_path / "counted"),
                        True)[0]
    assert known["summary"]["optimizer_steps"] == counted["summary"]["optimizer_steps"] >= 8
    assert losses(known["rows"]) == losses(counted["rows"])  # every logged step, bit for bit
    assert all(torch.equal(known["params"][k], counted["params"][k]) for k in known["params"])
