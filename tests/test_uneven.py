"""Data that does not divide evenly: a prime number of samples, so the DistributedSampler repeats
a sample to give both ranks the same number of micro-batches, epochs end in a partial window and
a short last micro-batch, and (synthetic) rank 1's last micro-batch holds only the repeat. The
repeat must weigh nothing: every step applies the exact mean gradient over the window's real
samples (an independent reference: the epoch's permutation and plain autograd, no DDP), and 1
and 2 ranks train the same model. Real 2-rank gloo runs of the worker's parts and loop."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import dist_cases
from gradsync.components import build
from test_lm import lm_cfg
from test_torch_ddp import synthetic_cfg

pytestmark = [pytest.mark.dist]

# kind -> (samples, global batch, 1-rank (micro, N), 2-rank (micro, N), micro-batches per rank
# and epoch on 2 ranks). synthetic: 2 ranks x 51 positions (the last is rank 1's repeat) in
# micro-batches of 5: the 11th holds 1 position, a real sample on rank 0, the repeat on rank 1.
# lm: 2 x 27 positions in micro-batches of 4: the 7th holds 3, of which rank 1's last repeats.
CASES = {"synthetic": (101, 20, (4, 5), (5, 2), 11), "lm": (53, 8, (8, 1), (4, 1), 7)}
EPOCHS = 2
EVAL = 31  # held-out samples: 16 on rank 0, 15 on rank 1


def cfg_for(kind: str, devices: int, micro: int, accum: int) -> dict:
    cfg = synthetic_cfg(devices, micro, accum) if kind == "synthetic" else \
        lm_cfg(devices, micro, accum, "tokens")
    cfg["data"].update(num_samples=CASES[kind][0], eval_samples=EVAL)
    cfg["trainer"]["max_epochs"] = EPOCHS
    return cfg


@pytest.fixture(scope="module", params=list(CASES))
def runs(request, pool2, single_process_group):
    kind = request.param
    _, _, one, two, _ = CASES[kind]
    ref = dist_cases.train_recording_steps(cfg_for(kind, 1, *one))
    cfg = cfg_for(kind, 2, *two)
    r0, r1 = pool2.run(dist_cases.train_recording_steps, cfg)
    return kind, cfg, ref, r0, r1


def windows(kind: str, seed: int) -> list[torch.Tensor]:
    """Every window's sample indices, in order: the DistributedSampler's documented shuffle
    (randperm seeded with seed + epoch) cut into global batches; no sample twice."""
    n, batch = CASES[kind][:2]
    out = []
    for epoch in range(EPOCHS):
        perm = torch.randperm(n, generator=torch.Generator().manual_seed(seed + epoch))
        out += [perm[i:i + batch] for i in range(0, n, batch)]
    return out


def mean_loss(kind: str, model: torch.nn.Module, samples: list) -> torch.Tensor:
    """Plain mean loss: per sample (MSE over outputs), or per token, one sequence at a time."""
    if kind == "synthetic":
        x, y = torch.stack([s[0] for s in samples]), torch.stack([s[1] for s in samples])
        return F.mse_loss(model(x), y)
    total = sum(F.cross_entropy(model(s[:-1][None])[0], s[1:], reduction="sum") for s in samples)
    return total / sum(len(s) - 1 for s in samples)


def reference_model(cfg: dict, params: list[torch.Tensor]):
    data = build(cfg["data"], {"seed": cfg["seed"]})
    model = build(cfg["model"], data.sizes)
    with torch.no_grad():
        for q, v in zip(model.parameters(), params, strict=True):
            q.copy_(v)
    return model, data


def rel(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    fa, fb = torch.cat([t.flatten() for t in a]), torch.cat([t.flatten() for t in b])
    return float((fa - fb).norm() / fb.norm())


def test_every_window_applies_the_mean_gradient_over_its_real_samples(runs):
    kind, cfg, ref, r0, r1 = runs
    plan = windows(kind, cfg["seed"])
    per_epoch = len(plan) // EPOCHS
    for name, run in (("1 rank", ref), ("2 ranks", r0), ("2 ranks, rank 1", r1)):
        assert len(run["steps"]) == len(plan), name
        for k, (params, grads) in enumerate(run["steps"]):
            model, data = reference_model(cfg, params)
            mean_loss(kind, model, [data.train[int(i)] for i in plan[k]]).backward()
            err = rel(grads, [q.grad for q in model.parameters()])
            last = "last window of its epoch, " if k % per_epoch == per_epoch - 1 else ""
            assert err < 1e-5, f"{name}: step {k} ({last}{len(plan[k])} samples) off by {err:.3g}"


def test_one_and_two_ranks_train_the_same_model_and_count_real_samples(runs):
    kind, _, ref, r0, r1 = runs
    n, _, _, _, micro_batches = CASES[kind]
    assert ref["samples_seen"] == r0["samples_seen"] == r1["samples_seen"] == EPOCHS * n
    # every rank ran every micro-batch, the repeat's too (DDP's collectives match)
    assert r0["micro_steps"] == r1["micro_steps"] == EPOCHS * micro_batches
    for a, b in zip(r0["params"], ref["params"], strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    # training moved the parameters (the check has teeth)
    assert rel(ref["params"], ref["steps"][0][0]) > 1e-2
    assert r0["last_loss"] == pytest.approx(ref["last_loss"], rel=1e-5)


def test_loss_and_eval_are_means_over_real_samples(runs):
    kind, cfg, ref, r0, _ = runs
    last = windows(kind, cfg["seed"])[-1]
    model, data = reference_model(cfg, r0["steps"][-1][0])
    with torch.no_grad():  # the last window's loss, logged as the final train loss
        assert r0["last_loss"] == pytest.approx(
            float(mean_loss(kind, model, [data.train[int(i)] for i in last])), rel=1e-5)
    model, data = reference_model(cfg, r0["params"])
    with torch.no_grad():  # 31 held-out samples split 16 / 15 between the ranks
        expected = float(mean_loss(kind, model, [data.eval[i] for i in range(EVAL)]))
    assert r0["eval"]["loss"] == pytest.approx(expected, rel=1e-5)
    assert ref["eval"]["loss"] == pytest.approx(expected, rel=1e-4)
