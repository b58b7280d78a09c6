"""trainer.engine=gradsync (engines/gradsync_ddp.py) against torch's DDP on the pool's 2 real
gloo ranks."""

from __future__ import annotations

import pytest
import torch

import dist_cases
import engine_cases
from configs import losses, plain_cfg

pytestmark = [pytest.mark.dist]


@pytest.mark.parametrize("unused,cap", [(False, engine_cases.SMALL_CAP_MB), (False, None),
                                        (True, engine_cases.SMALL_CAP_MB)])
def test_the_buckets_are_torch_ddps(pool2, unused, cap):
    """The same partition in every synchronising backward: one bucket at first, then rebuilt
    in the order the gradients became ready; with find_unused_parameters cut in reverse
    parameter order and kept. And the same parameters after every window (AdamW)."""
    torch_ddp = pool2.run(engine_cases.partitions, "torch_ddp", unused, cap)
    ours = pool2.run(engine_cases.partitions, "gradsync", unused, cap)
    for theirs, mine in zip(torch_ddp, ours, strict=True):
        print(mine["buckets"])
        assert mine["buckets"] == theirs["buckets"]
        for a, b in zip(mine["params"], theirs["params"], strict=True):
            for name in a:
                assert torch.equal(a[name], b[name]), name
        assert mine["grads_none"] == theirs["grads_none"]


# 101 samples (prime), 2 ranks, micro 5: 51 positions per rank and epoch (rank 1's last is the
# sampler's repeat), 11 micro-batches, the last one of a single position; accum 2 -> windows
# 2,2,2,2,2,1. MLP 8-16-16-2 in 3 buckets of 100 bytes at most (after the rebuild).
RUN = ["data=synthetic", "data.num_samples=101", "data.eval_samples=31", "data.in_dim=8",
       "data.out_dim=2", "data.micro_batch_size=5", "model.hidden_sizes=[16,16]",
       "model.activation=tanh", "lr_scheduler=none", "schedule.accum_steps=2",
       "trainer.max_epochs=2", "trainer.threads_per_worker=1", "trainer.progress_bar=false",
       "trainer.log_every=4", "trainer.checkpoint_every=0", "trainer.bucket_cap_mb=0.0001"]
ADAMW = [*RUN, "optimizer=adamw", "optimizer.lr=0.01"]
SGD = [*RUN, "optimizer=sgd", "optimizer.lr=0.05", "optimizer.momentum=0.9"]
CASES = {
    "always": [*ADAMW, "sync=always", "trainer.allreduce=process_group"],
    "accumulate": [*ADAMW, "sync=accumulate"],  # through shared memory
    "amp_aware": [*ADAMW, "sync=amp_aware", "precision=bf16", "trainer.allreduce=process_group"],
    "local_sgd": [*SGD, "sync=local_sgd", "sync.every=3", "sync.warmup_steps=2"],
    "diloco": [*SGD, "sync=diloco", "sync.every=3", "sync.warmup_steps=2"],
    "groups": [*SGD, "sync=accumulate", 'sync.groups=[{params: "*.bias", comm_dtype: bf16, '
               'name: biases}, {params: "0.*", every: 4, name: first}]'],
}
SAME_COUNTS = ("optimizer_steps", "samples_seen", "final_train_loss", "eval", "sync_backwards",
               "allreduce_calls", "allreduce_bytes", "allreduce")


def run_both(pool2, tmp_path, overrides):
    out = {}
    for engine in ("torch_ddp", "gradsync"):
        cfg = plain_cfg([*overrides, f"trainer.engine={engine}"])
        out[engine] = pool2.run(dist_cases.train_run_rows, cfg, str(tmp_path / engine))
    return out


@pytest.mark.slow
@pytest.mark.parametrize("case", list(CASES))
def test_trains_the_bits_torch_ddp_trains(pool2, tmp_path, case):
    runs = run_both(pool2, tmp_path, CASES[case])
    (t0, t1), (g0, g1) = runs["torch_ddp"], runs["gradsync"]
    for key in SAME_COUNTS:
        assert g0["summary"][key] == t0["summary"][key], key
    assert len(g0["summary"]["engine"]["buckets"]) >= 3  # several buckets, as torch_ddp's
    assert losses(g0["rows"]) == losses(t0["rows"])
    for name, value in t0["params"].items():
        assert torch.equal(g0["params"][name], value), name
    print(case, g0["summary"]["allreduce_calls"], g0["summary"]["allreduce_bytes"])
