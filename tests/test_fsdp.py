"""Sharded engines (engine=fsdp|hsdp, FSDP2's fully_shard) on the pool's 2 real gloo
ranks, through the worker's real run_training, against torch's DDP (engine=torch_ddp):

- fp32 `always` and `accumulate` in both flavours (reduce_scatter=boundary: no traffic until
  the window's synchronising micro-batch; every: a reduce-scatter after every backward) and, on
  HSDP, the third (reduce-scatter every micro-batch, all-reduce across replicas at the boundary)
  train the parameters DDP trains up to float rounding (1e-6 relative), on data that does not
  divide evenly (a prime number of samples, partial windows, the sampler's repeat) and with the
  loss normalised over the global token count;
- every reduce-scatter, all-gather and all-reduce is counted exactly, per group, against the
  number the units' padded shapes give, in summary.json and TensorBoard;
- the gradient bytes held between micro-batches are the analytic expectation (parameters x 4
  bytes, / shards once reduce-scattered, padding included);
- checkpoints are sharded (torch.distributed.checkpoint), complete with a per-file sidecar,
  and checkpoints/last.pt holds the consolidated model under torch_ddp's parameter names.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import sharded_cases
from cli_jobs import kill_9_when, start_job
from configs import SAME, losses, plain_cfg
from gradsync.components import ConfigError
from gradsync.run.main import compose_plain
from gradsync.run.preflight import preflight
from gradsync.train import checkpoint, dcp_safe

pytestmark = [pytest.mark.dist]

# 199 samples (prime), 2 ranks, micro 8: 100 positions and 13 micro-batches per rank and epoch,
# rank 1's last position the sampler's repeat; accum 3: windows 3,3,3,3,1 (5 windows, 13
# micro-batches); the global batch fixed (48: N = 3 on 2 ranks, 6 on 1). MLP 8-15-12-2: units
# "0" (15 x 8 + 15: padded to 16 rows on 2 shards), "2" (12 x 15 + 12) and the root (the output
# layer "4", 2 x 12 + 2).
MLP = ["data=synthetic", "data.num_samples=199", "data.eval_samples=31", "data.in_dim=8",
       "data.out_dim=2", "schedule.micro_batch_size=8", "model.hidden_sizes=[15,12]",
       "model.activation=tanh", "optimizer=adamw", "optimizer.lr=0.01",
       "schedule=global_batch", "schedule.global_batch_size=48", "lr_scheduler.warmup_steps=2",
       "trainer.max_epochs=1",
       "trainer.threads_per_worker=1", "trainer.progress_bar=false", "trainer.log_every_windows=2",
       "trainer.checkpoint_every_steps=0"]
WINDOWS, MICRO = 5, 13
CHECKPOINTS = ["trainer.checkpoint_every_steps=2", "trainer.keep_checkpoints=2"]  # steps 4, 5 kept
PARAMS = 15 * 8 + 15 + 12 * 15 + 12 + 2 * 12 + 2  # 353 numbers
PADDED = [16 * 8 + 16, 12 * 15 + 12, 2 * 12 + 2]  # per unit on 2 shards: 144, 192, 26
# token data: 53 sequences, micro 4 (7 micro-batches per rank, the last with rank 1's repeat),
# accum 2; the loss over the window's global token count; a 2-block transformer. SGD: the
# attention's key bias has a gradient of exactly 0 in exact arithmetic (softmax ignores a
# constant added to every score), so its computed gradient is rounding noise that AdamW would
# normalise into steps of size lr, different for every summation order
LM = ["model=transformer", "model.d_model=16", "model.mlp_ratio=2", "model.n_layers=2",
      "data=synthetic_lm", "data.num_samples=53", "data.eval_samples=16", "data.vocab_size=16",
      "data.min_len=2", "data.max_len=24", "schedule.micro_batch_size=4", "optimizer=sgd",
      "optimizer.lr=0.3", "optimizer.momentum=0.9", "schedule.window_size=2",
      "loss.normalize=tokens",
      "lr_scheduler=none", "trainer.max_epochs=1", "trainer.threads_per_worker=1",
      "trainer.progress_bar=false", "trainer.checkpoint_every_steps=0"]

FSDP, HSDP_2x1, HSDP_1x2 = (["engine=fsdp"],
                            ["engine=hsdp", "engine.replicas=2"],
                            ["engine=hsdp", "engine.replicas=1"])
EVERY = ["sync.reduce_scatter=every"]
EVERY_THEN_REPLICAS = [*EVERY, "sync.replica_all_reduce=boundary"]
ALWAYS = ["sync=always"]


def relative_error(got: dict, ref: dict) -> float:
    """The largest ||got - ref|| / ||ref|| over the parameters (the same names required)."""
    assert sorted(got) == sorted(ref)
    return max(((got[k] - ref[k]).norm() / ref[k].norm()).item() for k in ref)


@pytest.fixture(scope="module")
def runs(pool2, tmp_path_factory):
    """Every configuration once, cached: name -> rank 0's result (its run dir under "dir")."""
    cache: dict[str, dict] = {}

    def get(name: str, overrides: list[str]) -> dict:
        if name not in cache:
            run_dir = tmp_path_factory.mktemp(name.replace(" ", "_").replace(",", ""))
            cache[name] = pool2.run(sharded_cases.run, plain_cfg(overrides), str(run_dir),
                                    True)[0] | {"dir": run_dir, "cfg": plain_cfg(overrides)}
        return cache[name]

    return get


EXACT = {  # name -> (reference, overrides)
    "fsdp always": ("ddp always", [*MLP, *ALWAYS, *FSDP]),
    "fsdp boundary": ("ddp accumulate", [*MLP, *FSDP, *CHECKPOINTS]),
    "fsdp every": ("ddp accumulate", [*MLP, *FSDP, *EVERY]),
    "hsdp 2x1 boundary": ("ddp accumulate", [*MLP, *HSDP_2x1]),
    "hsdp 2x1 every": ("ddp accumulate", [*MLP, *HSDP_2x1, *EVERY]),
    "hsdp 2x1 every, replicas at the boundary": ("ddp accumulate",
                                                 [*MLP, *HSDP_2x1, *EVERY_THEN_REPLICAS]),
    "hsdp 1x2 every": ("ddp accumulate", [*MLP, *HSDP_1x2, *EVERY]),
    "lm fsdp boundary": ("lm ddp", [*LM, *FSDP]),
    "lm fsdp every": ("lm ddp", [*LM, *FSDP, *EVERY]),
    "lm hsdp 2x1 every, replicas at the boundary": ("lm ddp",
                                                    [*LM, *HSDP_2x1, *EVERY_THEN_REPLICAS]),
}
REFERENCES = {"ddp always": [*MLP, *ALWAYS], "ddp accumulate": MLP, "lm ddp": LM}


@pytest.mark.parametrize("name", list(EXACT))
def test_sharded_engines_train_what_torch_ddp_trains_up_to_rounding(runs, name):
    ref_name, overrides = EXACT[name]
    ref, out = runs(ref_name, REFERENCES[ref_name]), runs(name, overrides)
    err = relative_error(out["params"], ref["params"])
    assert err <= 1e-6, (name, err)
    assert [r["step"] for r in out["rows"]] == [r["step"] for r in ref["rows"]]
    assert out["summary"]["samples_seen"] == ref["summary"]["samples_seen"]
    assert out["summary"]["sync_backwards"] == ref["summary"]["sync_backwards"]
    losses = torch.tensor([r["loss"] for r in out["rows"]], dtype=torch.float64)
    ref_losses = torch.tensor([r["loss"] for r in ref["rows"]], dtype=torch.float64)
    torch.testing.assert_close(losses, ref_losses, rtol=1e-6, atol=0)
    # the comparison has teeth: the runs moved far from their common start
    assert relative_error(out["params"], sharded_cases.initial_model(out["cfg"])) > 1e-2


def test_last_pt_holds_the_consolidated_model_under_torch_ddps_names(runs):
    ref, out = runs("ddp accumulate", MLP), runs("fsdp boundary", EXACT["fsdp boundary"][1])
    assert {k: v.shape for k, v in out["params"].items()} == \
        {k: v.shape for k, v in ref["params"].items()}
    assert "sharded" in out["last_keys"] and "optimizer" not in out["last_keys"]
    assert out["summary"]["engine"]["name"] == "fsdp"
    assert [u["name"] for u in out["summary"]["engine"]["units"]] == ["0", "2", "<root>"]


# --- exact counts ---------------------------------------------------------------------------------
def test_fsdp_counts_every_reduce_scatter_and_all_gather_of_its_units(runs):
    """boundary: one reduce-scatter per unit per window; every: per unit per micro-batch. Each
    micro-batch all-gathers the three units for its forward and units 0 and 2 again for its
    backward (the root keeps its parameters between the two); the final evaluation gathers
    the three once more. Bytes: the whole padded tensors, fp32."""
    whole = sum(PADDED) * 4
    for name, syncs in (("fsdp boundary", WINDOWS), ("fsdp every", MICRO)):
        s = runs(name, EXACT[name][1])["summary"]
        assert s["reduce_scatter_calls"] == [3 * syncs] * 2, name
        assert s["reduce_scatter_bytes"] == [syncs * whole] * 2, name
        assert s["all_gather_calls"] == [5 * MICRO + 3] * 2, name
        assert s["all_gather_bytes"] == [MICRO * (whole + (PADDED[0] + PADDED[1]) * 4)
                                         + whole] * 2, name
        assert s["allreduce_calls"] == s["allreduce_bytes"] == [0, 0], name
        assert s["sync_backwards"] == [WINDOWS] * 2
        groups = s["sharded_groups"]
        assert groups["reduce_scatter"] == {"rest": {"calls": s["reduce_scatter_calls"],
                                                     "bytes": s["reduce_scatter_bytes"]}}


def test_hsdp_counts_the_all_reduces_across_replicas(runs):
    """Two replicas of one shard each: nothing to reduce-scatter or gather inside a replica,
    one all-reduce per unit of its whole (unpadded) gradient, at the boundary or on every
    micro-batch."""
    for name, syncs in (("hsdp 2x1 boundary", WINDOWS), ("hsdp 2x1 every", MICRO),
                        ("hsdp 2x1 every, replicas at the boundary", WINDOWS)):
        s = runs(name, EXACT[name][1])["summary"]
        assert s["allreduce_calls"] == [3 * syncs] * 2, name
        assert s["allreduce_bytes"] == [syncs * PARAMS * 4] * 2, name
        assert "reduce_scatter_calls" not in s, name  # none counted: groups of one rank
        assert s["allreduce_groups"] == {"rest": {"calls": s["allreduce_calls"],
                                                  "bytes": s["allreduce_bytes"]}}
    # one shard group of 2, one replica: what fsdp moves, and no all-reduce (a group of one)
    s, f = (runs(n, EXACT[n][1])["summary"] for n in ("hsdp 1x2 every", "fsdp every"))
    for key in ("reduce_scatter_bytes", "all_gather_bytes", "allreduce_bytes"):
        assert s[key] == f[key], key


@pytest.mark.parametrize("replicas", [1, 0])
def test_hsdp_with_one_replica_is_fsdp_on_a_1d_mesh(pool2, runs, tmp_path, replicas):
    """Issue 32 fault 1: engine.replicas=1 (or 0: one per host, the pool's one host) built the
    mesh (1, 2), and torch's FSDP2 then all-reduced every reduce-scattered shard over the
    1-rank replicate group with ReduceOp.AVG (wrong on NCCL < 2.29.7): 3 units x 13
    micro-batches = 39 such calls per rank here. Built as fsdp on a 1-D mesh: none, and the
    parameters fsdp trains, bit for bit."""
    cfg = plain_cfg([*MLP, "engine=hsdp", f"engine.replicas={replicas}", *EVERY])
    outs = pool2.run(sharded_cases.run_recording_all_reduces, cfg, str(tmp_path))
    for out in outs:
        assert out["all_reduce_sizes"].count(1) == 0, out["all_reduce_sizes"]
        assert out["log"] == ["engine=hsdp with one replica of 2 ranks: built as fsdp, "
                              "on a 1-D mesh (no all-reduce over a 1-rank replicate group)"]
    assert outs[0]["summary"]["engine"]["mesh"] == {"replicate": 1, "shard": 2}
    fsdp = runs("fsdp every", EXACT["fsdp every"][1])["params"]
    assert all(torch.equal(outs[0]["params"][k], v) for k, v in fsdp.items())


def test_bf16_gathers_bf16_parameters_and_reduces_in_the_policys_wire(runs):
    """precision=bf16 is FSDP's MixedPrecisionPolicy: the units compute with bf16 copies of
    the parameters (gathered in bf16: half the bytes) and reduce-scatter in the policy's wire,
    fp32 for accumulate, bf16 for amp_aware; the fp32 shards are what the optimizer steps."""
    fp32 = runs("fsdp boundary", EXACT["fsdp boundary"][1])["summary"]
    for name, overrides, rs_bytes in (
            ("fsdp bf16", [*MLP, *FSDP, "precision=bf16"], 4),
            ("fsdp bf16 amp_aware", [*MLP, *FSDP, "precision=bf16", "sync=amp_aware"], 2)):
        out = runs(name, overrides)
        s = out["summary"]
        assert s["engine"]["param_dtype"] == "bfloat16", name
        assert {u["reduce_dtype"] for u in s["engine"]["units"]} == \
            {"float32" if rs_bytes == 4 else "bfloat16"}, name
        assert s["all_gather_bytes"] == [b // 2 for b in fp32["all_gather_bytes"]], name
        assert s["reduce_scatter_bytes"] == [WINDOWS * sum(PADDED) * rs_bytes] * 2, name
        assert all(v.dtype == torch.float32 for v in out["params"].values())
        # bf16 rounding: close to the fp32 model, not equal to it
        err = relative_error(out["params"], runs("fsdp boundary", EXACT["fsdp boundary"][1])[
            "params"])
        assert 1e-6 < err < 0.05, (name, err)


def test_torch_ddp_reports_no_sharded_collectives_and_its_own_counts_unchanged(runs):
    s = runs("ddp accumulate", MLP)["summary"]
    assert s["allreduce_calls"] == [WINDOWS] * 2
    assert s["allreduce_bytes"] == [WINDOWS * PARAMS * 4] * 2
    assert not {"reduce_scatter_calls", "sharded_groups", "allreduce_groups"} & set(s)


def test_tensorboard_gets_the_sharded_counts_and_the_memory(runs):
    out = runs("fsdp every", EXACT["fsdp every"][1])
    tb, s = out["tb"], out["summary"]
    # at every log point (windows 2, 4 and the last): the counts so far, all but the final
    # evaluation's all-gathers in the summary
    assert [w for w, _ in tb["comm/reduce_scatter_bytes"]] == [2, 4, 5]
    assert tb["comm/reduce_scatter_bytes"][-1][1] == s["reduce_scatter_bytes"][0]
    assert tb["comm/reduce_scatter_bytes/rest"] == tb["comm/reduce_scatter_bytes"]
    assert tb["comm/all_gather_calls"][-1][1] == s["all_gather_calls"][0] - 3
    assert tb["mem/grad_sharded_bytes"][-1][1] == sum(PADDED) * 4 / 2
    assert tb["mem/grad_unsharded_bytes"][-1][1] == 0
    assert "mem/peak_mb" in tb
    ddp = runs("ddp accumulate", MLP)["tb"]
    assert "comm/reduce_scatter_bytes" not in ddp
    assert ddp["mem/grad_unsharded_bytes"][-1][1] == PARAMS * 4


# --- memory ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("name, unsharded, sharded", [
    # DDP: every rank holds the whole gradient (its buckets)
    ("ddp accumulate", PARAMS * 4, 0),
    # boundary: whole gradients between micro-batches, shards after the boundary
    ("fsdp boundary", PARAMS * 4, sum(PADDED) * 4 // 2),
    # every: only the shards, ever
    ("fsdp every", 0, sum(PADDED) * 4 // 2),
    # one shard per replica: the shard is the whole gradient (waiting for the all-reduce)
    ("hsdp 2x1 every, replicas at the boundary", 0, PARAMS * 4),
])
def test_gradient_memory_is_parameters_times_bytes_over_shards(runs, name, unsharded, sharded):
    overrides = EXACT[name][1] if name in EXACT else REFERENCES[name]
    mem = runs(name, overrides)["summary"]["memory"]
    assert mem["grad_unsharded_bytes"] == [unsharded] * 2
    assert mem["grad_sharded_bytes"] == [sharded] * 2
    assert mem["grad_held_bytes"] == [max(unsharded, sharded)] * 2
    # the peak (the rank's resident set since training started) holds at least the parameters,
    # AdamW's two moments (their shards) and the gradients held, and torch itself (> 100 MiB);
    # never more than the largest rank's peak over its whole life (summary.json's peak_rss_mb)
    whole = name.startswith(("ddp", "hsdp 2x1"))  # every rank holds whole parameters
    least = (PARAMS * 4 if whole else sum(PADDED) * 4 // 2) * 3 + max(unsharded, sharded)
    assert mem["peak_measure"] == "cpu_peak_rss"
    peak_rss_mb = runs(name, overrides)["summary"]["peak_rss_mb"]
    for mb in mem["peak_mb"]:
        assert max(least, 100 * 2**20) <= mb * 2**20 <= peak_rss_mb * 2**20, (name, least, mb)


# --- checkpoints ----------------------------------------------------------------------------------
def test_a_sharded_checkpoint_is_a_directory_with_every_files_digest(runs, tmp_path):
    out = runs("fsdp boundary", EXACT["fsdp boundary"][1])
    shutil.copytree(out["dir"], tmp_path / "run")
    ckpts = tmp_path / "run" / "checkpoints"
    # steps 2, 4 and the last (5): the newest two kept, with their sidecars; no temporary dirs
    assert sorted(p.name for p in ckpts.iterdir()) == [
        "last.pt", "step_00000004.dcp", "step_00000004.json", "step_00000005.dcp",
        "step_00000005.json"]
    newest = checkpoint.complete(ckpts)[0]
    meta = checkpoint.verify(newest)
    assert sorted(meta["files"]) == [".metadata", "__0_0.distcp", "__1_0.distcp",
                                     "train_state.pt"]
    assert meta["engine"] == "fsdp" and meta["progress"]["step"] == 5
    state = checkpoint.load(newest / "train_state.pt")  # weights_only=True
    assert "model" not in state and len(state["ranks"]) == 2
    shard = newest / "__1_0.distcp"
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))
    with pytest.raises(checkpoint.ResumeError, match="sha256 differs"):
        checkpoint.verify(newest)
    notes: list[str] = []
    assert checkpoint.resolve_resume("auto", tmp_path / "run", out["cfg"], 2, notes,
                                     sharded=True) == \
        (ckpts / "step_00000004.dcp").resolve()
    assert notes and "step_00000005.dcp: corrupt" in notes[0]


def test_resume_across_engines_and_world_sizes_is_refused_where_it_cannot_hold(runs,
                                                                               tmp_path):
    ddp, fsdp = runs("ddp accumulate", MLP), runs("fsdp boundary", EXACT["fsdp boundary"][1])
    ddp_ckpt = checkpoint.complete(ddp["dir"] / "checkpoints")[0]
    with pytest.raises(checkpoint.ResumeError, match="written by 2 processes, this run has 1"):
        checkpoint.resolve_resume(str(ddp_ckpt), tmp_path, ddp["cfg"], 1, [], sharded=False)
    with pytest.raises(checkpoint.ResumeError, match="replicated model's checkpoint; this run "
                                                     "has engine=fsdp"):
        checkpoint.resolve_resume(str(ddp_ckpt), tmp_path, fsdp["cfg"], 2, [], sharded=True)
    # with the global batch fixed, every world size that divides it cuts the same windows
    step_4 = fsdp["dir"] / "checkpoints" / "step_00000004.dcp"
    for world in (1, 3):
        assert checkpoint.resolve_resume(str(step_4), tmp_path, fsdp["cfg"], world, [],
                                         sharded=True) == step_4.resolve()
    with pytest.raises(checkpoint.ResumeError, match="is a sharded checkpoint"):
        checkpoint.resolve_resume(str(step_4), tmp_path, ddp["cfg"], 2, [], sharded=False)
    # with N fixed instead (3 micro-batches of 8 per window), step 4 is window 4 of the epoch on
    # 2 ranks: 4 x 3 x 8 x 2 = 192 samples, a whole number of 1 rank's windows (24 samples) but
    # not of 3 ranks' (72)
    constant = fsdp["cfg"] | {"schedule": {"name": "constant", "window_size": 3}}
    meta = checkpoint.verify(step_4) | {"config": constant}
    checkpoint.refuse_incompatible(step_4, meta, constant, 1, sharded=True)
    with pytest.raises(checkpoint.ResumeError, match="stopped after window 4 of epoch 0 on 2 "
                                                     "ranks, which is not a window boundary on 3"):
        checkpoint.refuse_incompatible(step_4, meta, constant, 3, sharded=True)


KILLED = [*MLP, "model.dropout=0.1", *FSDP, *CHECKPOINTS]  # dropout: every rank's RNG matters
COUNTS = (*SAME, "reduce_scatter_calls", "reduce_scatter_bytes", "all_gather_calls",
          "all_gather_bytes", "sharded_groups")


@pytest.mark.slow
def test_kill_9_then_resume_auto_ends_bitwise_like_the_uninterrupted_run(runs, pool2, tmp_path,
                                                                         cli_env):
    """The real command line dies by SIGKILL (the job and its workers) once the step-2
    checkpoint is complete; resume=auto in its run dir continues on the pool's ranks."""
    ref = runs("fsdp with dropout", KILLED)
    run_dir = tmp_path / "run"
    kill_9_when(start_job(run_dir, KILLED, cli_env),
                run_dir / "checkpoints" / "step_00000002.json")
    newest = checkpoint.complete(run_dir / "checkpoints")[0]
    assert checkpoint.is_sharded(newest) and newest.name < "step_00000005", newest
    resumed = pool2.run(sharded_cases.run, plain_cfg([*KILLED, "resume=auto"]), str(run_dir),
                        False)[0]
    assert losses(resumed["rows"]) == losses(ref["rows"])
    assert {k: resumed["summary"][k] for k in COUNTS} == {k: ref["summary"][k] for k in COUNTS}
    for name, value in ref["params"].items():
        assert torch.equal(resumed["params"][name], value), name


def test_a_sharded_checkpoint_resumes_on_another_world_size(runs, pool2, single_process_group,
                                                            tmp_path):
    """torch.distributed.checkpoint reshards: 2 ranks' step-4 checkpoint continues on 1 rank,
    and 1 rank's step-2 checkpoint on 2. The global batch is fixed (N = 6 on 1 rank, 3 on 2),
    so every window holds the same samples and the runs end where the uninterrupted 2-rank run
    ends, up to float rounding."""
    ref = runs("fsdp boundary", EXACT["fsdp boundary"][1])
    one_rank = [*MLP, *FSDP, "trainer.devices=1", "trainer.checkpoint_every_steps=2",
                "trainer.keep_checkpoints=10"]
    step_4 = ref["dir"] / "checkpoints" / "step_00000004.dcp"
    two_to_one = sharded_cases.run(plain_cfg([*one_rank, f"resume={step_4}"]),
                                   str(tmp_path / "2to1"))
    assert [(r["window"], r["step"]) for r in two_to_one["rows"]] == [(5, 5)]
    assert two_to_one["summary"]["world_size"] == 1
    assert two_to_one["summary"]["samples_seen"] == ref["summary"]["samples_seen"] == 199
    assert relative_error(two_to_one["params"], ref["params"]) <= 1e-6

    alone = sharded_cases.run(plain_cfg(one_rank), str(tmp_path / "one"))
    assert relative_error(alone["params"], ref["params"]) <= 1e-6
    step_2 = tmp_path / "one" / "checkpoints" / "step_00000002.dcp"
    one_to_two = pool2.run(sharded_cases.run,
                           plain_cfg([*MLP, *FSDP, f"resume={step_2}"]), str(tmp_path / "1to2"),
                           False)[0]
    assert [r["window"] for r in one_to_two["rows"]] == [3, 4, 5]
    assert relative_error(one_to_two["params"], ref["params"]) <= 1e-6
    assert one_to_two["summary"]["reduce_scatter_calls"] == [3 * 3] * 2  # counted afresh


# --- bad input: one line each, before any worker starts -------------------------------------------
@pytest.mark.parametrize("overrides, message", [
    ([*FSDP, "precision=fp16"], "precision=fp16 with engine=fsdp"),
    ([*FSDP, "sync=local_sgd"], "sync policy 'local_sgd' averages whole models"),
    ([*FSDP, "sync.compression=powersgd"], "sync.compression=powersgd compresses DDP's buckets"),
    ([*FSDP, "sync.replica_all_reduce=boundary"],
     "sync.replica_all_reduce=boundary is for engine=hsdp"),
    ([*FSDP, "trainer.check_replicas=1"], "trainer.check_replicas with engine=fsdp"),
    ([*FSDP, "engine.fsdp_units=layers.*"], "engine.fsdp_units='layers.*': 'layers.*' matches "
                                             "no module of the model; its modules: 0, 1, 2"),
    ([*FSDP, 'sync.groups=[{params: "0.weight", reduce_scatter: every}]'],
     "sync.groups: FSDP unit '0' holds parameters of groups '0.weight', 'rest' that reduce "
     "differently"),
    ([*FSDP, 'sync.groups=[{params: "0.*", every: 4}]'],
     "sync.groups[0].every with engine=fsdp"),
    (["engine=hsdp", "engine.replicas=3"], "engine.replicas=3 is not allowed"),
    (["sync.reduce_scatter=every"], "sync.reduce_scatter=every is for sharded engines"),
    ([*HSDP_2x1, "sync.replica_all_reduce=every"],
     "sync.replica_all_reduce=every with sync.reduce_scatter=boundary"),
    ([*HSDP_2x1, "sync.reduce_scatter=every",
      'sync.groups=[{params: "0.*", reduce_scatter: boundary, replica_all_reduce: every}]'],
     "sync.groups rule '0.*': replica_all_reduce=every with reduce_scatter=boundary"),
    ([*FSDP, "sync.reduce_scatter=sometimes"], "sync.reduce_scatter='sometimes' is not allowed"),
])
def test_combinations_that_cannot_hold_are_one_line_config_errors(overrides, message):
    with pytest.raises(ConfigError) as e:
        preflight(compose_plain(["model.hidden_sizes=[16]", *overrides]))
    assert message in str(e.value) and "\n" not in str(e.value), str(e.value)


@pytest.mark.parametrize("overrides, message", [
    # each engine owns its settings: another engine's is no key of this one (engines/fsdp.py)
    ([*FSDP, "engine.replicas=2"], "engine.replicas: unknown key; allowed keys: "
     "find_unused_parameters, fsdp_units, name"),
    (["engine.fsdp_units=0"], "engine.fsdp_units: unknown key; allowed keys: allreduce, "
     "bucket_cap_mb, find_unused_parameters, gradient_as_bucket_view, name, sync_batchnorm, "
     "trace_sync"),
])
def test_another_engines_setting_is_an_unknown_key_in_one_line(overrides, message):
    from gradsync.config.errors import one_line

    with pytest.raises(Exception) as e:
        compose_plain(["model.hidden_sizes=[16]", *overrides])
    assert one_line(e.value) == message


def test_per_unit_rules_pick_each_units_flavour_and_wire(runs):
    """sync.groups rules that follow the units: the hidden layers reduce-scatter on every
    micro-batch, the root only at the boundary, in bf16 (half the bytes)."""
    rules = ('sync.groups=[{params: "0.*|2.*", reduce_scatter: every, name: hidden}, '
             '{params: "4.*", comm_dtype: bf16, name: head}]')
    s = runs("per unit", [*MLP, *FSDP, rules])["summary"]
    rs = s["sharded_groups"]["reduce_scatter"]
    assert rs["hidden"] == {"calls": [2 * MICRO] * 2,
                            "bytes": [MICRO * (PADDED[0] + PADDED[1]) * 4] * 2}
    assert rs["head"] == {"calls": [WINDOWS] * 2, "bytes": [WINDOWS * PADDED[2] * 2] * 2}
    units = {u["name"]: u for u in s["engine"]["units"]}
    assert units["<root>"]["reduce_dtype"] == "bfloat16" and units["0"]["reduce_dtype"] is None
    assert units["0"]["reduce_scatter"] == "every" and units["<root>"]["reduce_scatter"] == \
        "boundary"
    # between micro-batches: the root's whole gradient (26 numbers, held in bf16 as FSDP
    # accumulates in the reduce dtype) and the hidden layers' shards
    mem = s["memory"]
    assert mem["grad_unsharded_bytes"] == [26 * 2] * 2
    assert mem["grad_sharded_bytes"] == [sum(PADDED) * 4 // 2] * 2


def test_inspect_params_shows_the_units(tmp_path, monkeypatch, capsys):
    from gradsync.run import main as train

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr("sys.argv", ["gradsync-train", "+inspect=params", *FSDP,
                                     "model.hidden_sizes=[15,12]", "data=synthetic",
                                     "data.in_dim=8", "data.out_dim=2"])
    train.main()
    out = capsys.readouterr().out
    assert "FSDP units (engine.fsdp_units), innermost first:" in out
    assert "  0: 2 tensors, 540 bytes, group rest, reduce_scatter=boundary" in out
    assert "  <root>: 2 tensors, 104 bytes" in out
    assert not list(tmp_path.iterdir())  # no run dir


def test_memory_vs_bytes_sweeps_every_variant_on_the_same_model_data_and_global_batch():
    from hydra import compose, initialize_config_dir

    from gradsync.config.hydra import CONF_DIR
    from gradsync.run.main import register_schemas

    register_schemas()
    with initialize_config_dir(config_dir=CONF_DIR, version_base="1.3"):
        cfg = compose("config", overrides=["experiment=memory_vs_bytes"],
                      return_hydra_config=True)
    key = "+experiment/memory_vs_bytes_variants"
    swept = cfg.hydra.sweeper.params[key].split(",")
    variants = Path(CONF_DIR) / "experiment" / "memory_vs_bytes_variants"
    assert sorted(swept) == sorted(p.stem for p in variants.glob("*.yaml"))
    same, engines = set(), {}
    for name in swept:
        plain = compose_plain(["experiment=memory_vs_bytes", f"{key}={name}"])
        preflight(plain)
        t = plain["trainer"]
        engines[name] = (plain["engine"]["name"], t["devices"], plain["sync"]["reduce_scatter"])
        same.add((plain["model"]["d_model"], plain["data"]["num_samples"],
                  plain["schedule"]["global_batch_size"], plain["seed"], t["max_epochs"]))
    assert len(same) == 1
    assert engines == {"ddp": ("torch_ddp", 2, "boundary"), "boundary": ("fsdp", 2, "boundary"),
                       "every": ("fsdp", 2, "every"), "per_unit": ("fsdp", 2, "boundary"),
                       "hsdp_4": ("hsdp", 4, "every")}


def test_the_sweep_columns_include_bytes_per_step_and_memory():
    from gradsync.train.metrics import final_metrics

    s = {"final_train_loss": 0.5, "eval": {"loss": 0.7}, "samples_per_s": 10.0,
         "sync_backwards": [3, 3], "allreduce_calls": [0, 0], "allreduce_bytes": [0, 0],
         "reduce_scatter_bytes": [300, 300], "all_gather_bytes": [900, 900],
         "optimizer_steps": 3, "peak_rss_mb": 300.0,
         "memory": {"grad_held_bytes": [40, 44], "peak_mb": [12.5, 13.0]}}
    m = final_metrics(s)
    assert m["comm_bytes_per_step"] == 400.0 and m["grad_held_bytes"] == 44
    assert m["peak_mem_mb"] == 13.0 and m["reduce_scatter_bytes"] == 300
    assert json.dumps(m)


# --- a checkpoint runs no one's code -------------------------------------------------------------
def _train_cli(run_dir: Path, args: list[str], env: dict) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "gradsync.run.main", f"hydra.run.dir={run_dir}",
                           *args], capture_output=True, text=True, env=env, timeout=240)


def _files(ckpt_dir: Path) -> dict[str, bytes]:
    return {str(f.relative_to(ckpt_dir)): f.read_bytes()
            for f in sorted(ckpt_dir.rglob("*")) if f.is_file()}


@pytest.mark.slow
@pytest.mark.parametrize("kind, named", [
    ("metadata", ".metadata: refused: it names posix.system, which is not part of a checkpoint's "
                 "index (nothing of it was run)"),
    ("value", "__0_0.distcp: refused: the value of optimizer.param_groups.0.lr: it names "
              "posix.system (nothing of it was run)")])
def test_a_planted_pickle_in_a_sharded_checkpoint_runs_nothing(runs, tmp_path, cli_env, kind,
                                                               named):
    """A real 2-rank FSDP run's checkpoints, a payload planted in DCP's pickled index or in one
    of its pickled values and the sidecar's digests rewritten to match: resume=<path> and
    resume=auto are refused with one line each, before any rank starts, the payload's file is
    never written and the checkpoints stay as they were."""
    ref = runs("fsdp boundary", EXACT["fsdp boundary"][1])
    run_dir, target = tmp_path / "run", tmp_path / "payload-ran"
    shutil.copytree(ref["dir"], run_dir)
    ckpts = run_dir / "checkpoints"
    for step in (4, 5):
        sharded_cases.plant(ckpts / f"step_0000000{step}.dcp", kind, str(target))
    before = _files(ckpts)
    step_5 = ckpts / "step_00000005.dcp"
    explicit = _train_cli(tmp_path / "other", [*EXACT["fsdp boundary"][1], f"resume={step_5}"],
                          cli_env)
    assert explicit.returncode == 2, explicit.stderr
    assert explicit.stderr.strip().splitlines() == [f"gradsync: resume refused: {step_5}/{named}"]
    auto = _train_cli(run_dir, [*EXACT["fsdp boundary"][1], "resume=auto"], cli_env)
    assert auto.returncode == 2, auto.stderr
    assert auto.stderr.strip().splitlines() == [
        *(f"gradsync: resume: skipping {ckpts}/step_0000000{s}.dcp/{named}" for s in (5, 4)),
        f"gradsync: resume refused: resume=auto: no intact checkpoint in {ckpts}"]
    assert not target.exists() and "Traceback" not in explicit.stderr + auto.stderr
    assert _files(ckpts) == before


@pytest.mark.parametrize("kind", ["metadata", "value"])
def test_the_ranks_read_a_checkpoint_restricted_too(runs, pool2, tmp_path, kind):
    """The job checked an intact checkpoint; a payload swapped in after that, before the ranks
    read it, is refused on every rank (CheckpointError naming the checkpoint) and runs
    nothing."""
    ref = runs("fsdp boundary", EXACT["fsdp boundary"][1])
    copy, target = tmp_path / "copy", tmp_path / "payload-ran"
    shutil.copytree(ref["dir"] / "checkpoints", copy / "checkpoints")
    ckpt = copy / "checkpoints" / "step_00000004.dcp"
    errors = pool2.run(sharded_cases.resume_planted, plain_cfg(EXACT["fsdp boundary"][1]),
                       str(tmp_path / "run"), str(ckpt), kind, str(target))
    assert not target.exists()
    for error in errors:
        assert error.startswith(f"CheckpointError: reading {ckpt} failed on rank "), error
        assert "refused: " in error and "posix.system" in error and "\n" not in error, error


@pytest.mark.slow
def test_a_failed_checkpoint_load_is_one_line_and_deletes_nothing(runs, tmp_path, cli_env):
    """torch's CheckpointException is a BaseException: a tensor in a shard file that torch
    cannot read (the end of its record zeroed, digests rewritten) ends the job with one line
    naming the checkpoint, exit 1, no traceback, the checkpoint as it was."""
    ref = runs("fsdp boundary", EXACT["fsdp boundary"][1])
    run_dir = tmp_path / "run"
    shutil.copytree(ref["dir"], run_dir)
    step_5 = run_dir / "checkpoints" / "step_00000005.dcp"
    info = next(i for k, i in dcp_safe.read_metadata(step_5).storage_data.items()
                if k.fqn == "model.0.weight" and i.relative_path == "__1_0.distcp")
    shard = bytearray((step_5 / info.relative_path).read_bytes())
    end = info.offset + info.length
    shard[end - 64:end] = bytes(64)  # its zip's central directory
    (step_5 / info.relative_path).write_bytes(shard)
    sharded_cases.reseal(step_5)
    before = _files(run_dir / "checkpoints")
    out = _train_cli(run_dir, [*EXACT["fsdp boundary"][1], "resume=auto"], cli_env)
    assert out.returncode == 1, out.stderr
    errors = [ln for ln in out.stderr.splitlines() if ln.startswith("gradsync: ")]
    assert re.fullmatch(rf"gradsync: training failed: rank [01] failed: CheckpointError: "
                        rf"reading {step_5} failed on rank 1: RuntimeError: PytorchStreamReader "
                        r"failed reading zip archive: failed finding central directory.*",
                        errors[-1]), errors
    assert "Traceback" not in out.stderr and "CheckpointException" not in out.stderr
    assert _files(run_dir / "checkpoints") == before
