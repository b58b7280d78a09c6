"""Real 2-process gloo DDP: gradients inside a window, factorisation invariance, exact counts."""

from __future__ import annotations

import pytest
import torch

import dist_cases
from configs import plain_cfg
from gradsync.config.schema import RunConfig
from gradsync.data.contract import mse_per_sample
from gradsync.models import MLP
from gradsync.run.worker import run_training

pytestmark = [pytest.mark.dist]

MICRO = [3, 3, 2]  # one window of three micro-batches, the last one short


def reference_grad(micro_sizes, world):
    """Single process, no DDP: gradient of the mean loss over the gathered window."""
    model = dist_cases.tiny_model()
    data = dist_cases.window_data(0, world, micro_sizes)
    x = torch.cat([b[0] for rank in data for b in rank])
    y = torch.cat([b[1] for rank in data for b in rank])
    (mse_per_sample(model(x), y)[0].sum() / len(x)).backward()
    return torch.cat([p.grad.flatten() for p in model.parameters()])


def param_bytes():
    return sum(p.numel() * p.element_size() for p in dist_cases.tiny_model().parameters())


def test_accumulate_grads_local_until_the_syncing_micro_step(pool2):
    r0, r1 = pool2.run(dist_cases.grads_per_micro_step, "accumulate", MICRO)
    ref = reference_grad(MICRO, 2)
    for i in range(len(MICRO) - 1):  # no_sync micro-steps: each rank only has its own data
        assert not torch.allclose(r0["grads"][i], r1["grads"][i], atol=1e-4)
    torch.testing.assert_close(r0["grads"][-1], r1["grads"][-1], rtol=0, atol=0)
    torch.testing.assert_close(r0["grads"][-1], ref, rtol=1e-5, atol=1e-6)
    # the local partial gradient is not the reference either: the sync did real work
    assert not torch.allclose(r0["grads"][-2], ref, atol=1e-4)
    for r in (r0, r1):
        assert r["sync_backwards"] == 1
        assert r["allreduce_bytes"] == param_bytes()


def test_always_syncs_every_micro_step_and_ends_at_the_same_gradient(pool2):
    r0, r1 = pool2.run(dist_cases.grads_per_micro_step, "always", MICRO)
    for g0, g1 in zip(r0["grads"], r1["grads"], strict=True):
        torch.testing.assert_close(g0, g1, rtol=0, atol=0)  # in sync after every micro-step
    torch.testing.assert_close(r0["grads"][-1], reference_grad(MICRO, 2), rtol=1e-5, atol=1e-6)
    for r in (r0, r1):
        assert r["sync_backwards"] == len(MICRO)
        assert r["allreduce_bytes"] == len(MICRO) * param_bytes()


def run_overrides(devices: int, micro: int, accum: int, sync: str = "accumulate") -> list[str]:
    """The settings every run of these tests shares (the model and data aside)."""
    return ["seed=3", "optimizer.lr=0.05", f"schedule.window_size={accum}", f"sync={sync}",
            f"schedule.micro_batch_size={micro}", f"trainer.devices={devices}",
            "trainer.max_epochs=2", "trainer.log_every_windows=3", "trainer.backend=gloo",
            "trainer.threads_per_worker=1", "trainer.progress_bar=false", "trainer.timeout_s=60",
            "trainer.checkpoint_every_steps=0", "trainer.keep_checkpoints=1",
            "lr_scheduler.warmup_steps=2", "lr_scheduler.min_lr_ratio=0.1"]


def synthetic_cfg(devices: int, micro: int, accum: int, sync: str = "accumulate") -> dict:
    """200 samples, global batch 32: every epoch ends in a partial window of 8 samples, and
    with micro 8 on 2 ranks the last micro-batch of an epoch is short (4 samples)."""
    return plain_cfg([*run_overrides(devices, micro, accum, sync), "model.hidden_sizes=[16]",
                      "model.activation=tanh", "data=synthetic", "data.num_samples=200",
                      "data.eval_samples=64", "data.in_dim=8", "data.out_dim=2"])


@pytest.fixture(scope="module")
def reference_run(single_process_group, tmp_path_factory):
    cfg = synthetic_cfg(1, 32, 1)
    out = tmp_path_factory.mktemp("ref")
    summary = run_training(RunConfig.from_plain(cfg), out)
    from gradsync.train import checkpoint

    return summary, checkpoint.load(out / "checkpoints" / "last.pt")["model"]


@pytest.mark.parametrize("micro,accum,sync", [(4, 4, "accumulate"), (8, 2, "accumulate"),
                                              (4, 4, "always")])
def test_factorisations_of_one_global_batch_train_the_same_model(
        pool2, reference_run, tmp_path, micro, accum, sync):
    ref_summary, ref_params = reference_run
    assert ref_summary["sync_backwards"] == [14]  # world size 1 goes through DDP too
    r0, r1 = pool2.run(dist_cases.train_run, synthetic_cfg(2, micro, accum, sync), str(tmp_path))
    s = r0["summary"]
    # 200 samples / 32 per step: 6 full windows + 1 partial (8 samples) per epoch, 2 epochs
    assert s["optimizer_steps"] == ref_summary["optimizer_steps"] == 14
    assert s["samples_seen"] == ref_summary["samples_seen"] == 400
    for name, ref in ref_params.items():
        torch.testing.assert_close(r0["params"][name], ref, rtol=1e-5, atol=1e-6, msg=name)
    assert abs(s["final_train_loss"] - ref_summary["final_train_loss"]) < 1e-5
    # training moved the parameters far from their initial values (the check has teeth)
    torch.manual_seed(3)
    init = MLP(8, 2, [16], "tanh").state_dict()
    assert max((ref_params[k] - init[k]).abs().max() for k in init) > 1e-2
    micro_batches_per_rank = 2 * -(-100 // micro)
    pbytes = sum(t.numel() * t.element_size() for t in ref_params.values())
    syncs = 14 if sync == "accumulate" else micro_batches_per_rank
    assert s["sync_backwards"] == [syncs, syncs]
    assert s["allreduce_bytes"] == [syncs * pbytes] * 2
    assert r1["summary"]["sync_backwards"] == [syncs, syncs]
