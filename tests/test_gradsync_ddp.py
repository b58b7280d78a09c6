"""engine=gradsync (engines/gradsync_ddp.py) against torch's DDP on the pool's 2 real
gloo ranks: the same buckets in every synchronising backward; the same bits trained by every
policy (exact and approximate, gloo and shared memory, uneven data); buffers and unused
parameters handled as torch handles them; per-bucket decisions; the sync trace of both engines
(engine.trace_sync) and what it measures; the classic mistakes of docs/debugging.md."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

import engine_cases
from configs import losses, plain_cfg
from gradsync.config.validate import ConfigError
from gradsync.engines.trace import BucketRecord, MicroBatch, SyncTrace, table
from gradsync.run.preflight import preflight

pytestmark = [pytest.mark.dist]


# --- the buckets, buffers, unused parameters: both engines built directly ---------------------
@pytest.mark.parametrize("unused,cap", [(False, engine_cases.SMALL_CAP_MB), (False, None),
                                        (True, engine_cases.SMALL_CAP_MB)])
def test_the_buckets_are_torch_ddps(pool2, unused, cap):
    """The same buckets in every synchronising backward (one at first, then rebuilt in the
    order the gradients became ready; with find_unused_parameters cut in reverse parameter
    order and kept), and the same parameters after every window (AdamW: a gradient left None
    and one set to zeros would step differently)."""
    theirs = pool2.run(engine_cases.partitions, "torch_ddp", unused, cap)
    ours = pool2.run(engine_cases.partitions, "gradsync", unused, cap)
    for t, o in zip(theirs, ours, strict=True):
        assert o["buckets"] == t["buckets"]
        for a, b in zip(o["params"], t["params"], strict=True):
            for name in a:
                assert torch.equal(a[name], b[name]), name
        assert o["grads_none"] == t["grads_none"]
    first, rebuilt = ours[0]["buckets"][0], ours[0]["buckets"][1]
    if not unused:
        assert len(first) == 1 and len(first[0][1]) == 6  # everything in one bucket at first
        assert len(rebuilt) == (3 if cap else 1)
        assert rebuilt[0][1][:2] == ("c.bias", "c.weight")  # the first gradients ready
    else:  # never used anywhere: its gradient stays None, AdamW leaves it alone
        assert ours[0]["grads_none"] == ["never.weight", "never.bias"]
        assert torch.equal(ours[0]["params"][0]["never.weight"],
                           ours[0]["params"][-1]["never.weight"])
        # used on rank 0 only: all-reduced like any other gradient
        assert torch.equal(ours[0]["params"][-1]["sometimes.weight"],
                           ours[1]["params"][-1]["sometimes.weight"])


def test_a_parameter_without_gradient_is_an_error_that_names_it(pool2):
    ours = pool2.run(engine_cases.unused_error, "gradsync")
    theirs = pool2.run(engine_cases.unused_error, "torch_ddp")
    # at the end of the first synchronising backward, not at the next forward; rank 0 used
    # `sometimes` in it, rank 1 did not
    missing = ["2 parameter(s) got no gradient in this synchronising backward: never.weight, "
               "never.bias;", "4 parameter(s) got no gradient in this synchronising backward: "
               "never.weight, never.bias, sometimes.weight, sometimes.bias;"]
    for r, message in enumerate(ours):
        assert message.startswith(f"rank {r}: {missing[r]}")
        assert "engine.find_unused_parameters=true" in message
    # torch_ddp: the same parameters, named after the backward (DDP itself fails one forward
    # later, naming none: engines/unused.py)
    for r, message in enumerate(theirs):
        assert message.startswith(f"rank {r}: {missing[r]}")
        assert "engine.find_unused_parameters=true" in message


def test_buffers_and_copied_gradients_as_torch_ddp(pool2):
    """BatchNorm's running statistics: rank 0's broadcast before every forward that follows a
    synchronising one, or (a policy that averages the models itself) each rank's own; the
    start broadcast makes rank 1's different initial parameters rank 0's;
    gradient_as_bucket_view=false."""
    rank1 = {}
    for whole_model in (False, True):
        theirs = pool2.run(engine_cases.buffers_and_grads, "torch_ddp", whole_model)
        ours = pool2.run(engine_cases.buffers_and_grads, "gradsync", whole_model)
        for t, o in zip(theirs, ours, strict=True):
            for (tb, tg), (ob, og) in zip(t["steps"], o["steps"], strict=True):
                assert all(torch.equal(a, b) for a, b in zip(ob, tb, strict=True))
                assert all(torch.equal(a, b) for a, b in zip(og, tg, strict=True))
        assert all(torch.equal(a, b) for a, b in zip(ours[0]["start"], ours[1]["start"],
                                                     strict=True))
        rank1[whole_model] = ours[1]["steps"][2][0][0]  # after the 3rd forward
    # the broadcast before it (the 2nd backward synchronised) changed rank 1's statistics
    assert not torch.equal(rank1[False], rank1[True])


@pytest.mark.parametrize("engine", ["torch_ddp", "gradsync"])
def test_gradient_memory_counts_the_buckets_when_gradients_are_not_views(pool2, engine):
    """gradient_as_bucket_view=false: the buckets are a second copy of the gradients (Net: 332
    bytes of parameters), counted with them; true: the gradients are the buckets, once."""
    for view, copies in ((True, 1), (False, 2)):
        for r in pool2.run(engine_cases.gradient_memory, engine, view):
            assert r["params"] == 332
            assert r["reported"] == r["measured"] == copies * r["params"], (view, r)


# --- whole runs through the worker's run_training ---------------------------------------------
# 101 samples (prime), 2 ranks, micro 5: 51 positions per rank and epoch (rank 1's last is the
# sampler's repeat), 11 micro-batches, the last one of a single position; accum 2 -> windows
# 2,2,2,2,2,1. MLP 8-16-16-2 in 3 buckets of 100 bytes at most (after the rebuild).
RUN = ["data=synthetic", "data.num_samples=101", "data.eval_samples=31", "data.in_dim=8",
       "data.out_dim=2", "schedule.micro_batch_size=5", "model.hidden_sizes=[16,16]",
       "model.activation=tanh", "lr_scheduler=none", "schedule.window_size=2",
       "trainer.max_epochs=2", "trainer.threads_per_worker=1", "trainer.progress_bar=false",
       "trainer.log_every_windows=4", "trainer.checkpoint_every_steps=0",
       "engine.bucket_cap_mb=0.0001"]
ADAMW = [*RUN, "optimizer=adamw", "optimizer.lr=0.01"]
SGD = [*RUN, "optimizer=sgd", "optimizer.lr=0.05", "optimizer.momentum=0.9"]
CASES = {
    "always": [*ADAMW, "sync=always", "engine.allreduce=process_group"],
    "accumulate": [*ADAMW, "sync=accumulate"],  # through shared memory
    "amp_aware": [*ADAMW, "sync=amp_aware", "precision=bf16", "engine.allreduce=process_group"],
    "local_sgd": [*SGD, "sync=local_sgd", "sync.every=3", "sync.warmup_windows=2"],
    "diloco": [*SGD, "sync=diloco", "sync.every=3", "sync.warmup_windows=2"],
    "groups": [*SGD, "sync=accumulate", 'sync.groups=[{params: "*.bias", comm_dtype: bf16, '
               'name: biases}, {params: "0.*", every: 4, name: first}]'],
    # torch's powerSGD_hook on the engine's bucket: error feedback keyed by bucket.index()
    "powersgd": [*SGD, "sync=accumulate", "sync.compression=powersgd", "sync.powersgd_rank=1",
                 "sync.powersgd_start_backwards=2"],
}
SAME = ("optimizer_steps", "samples_seen", "final_train_loss", "eval", "sync_backwards",
        "allreduce_calls", "allreduce_bytes", "allreduce", "allreduce_groups", "averagings")
WINDOWS, MICRO_BATCHES = 12, 22  # per rank, 2 epochs


@pytest.fixture(scope="module")
def runs(pool2, tmp_path_factory):
    """(case, engine) -> both ranks' train_run_rows, each run once per module."""
    done: dict[tuple[str, str], list[dict]] = {}

    def run(case: str, engine: str, extra: tuple[str, ...] = ()) -> list[dict]:
        key = (case + "".join(extra), engine)
        if key not in done:
            cfg = plain_cfg([*CASES[case], f"engine={engine}", *extra])
            done[key] = pool2.run(engine_cases.dist_cases.train_run_rows, cfg,
                                  str(tmp_path_factory.mktemp(case)))
        return done[key]

    return run


@pytest.mark.parametrize("case", list(CASES))
def test_trains_the_bits_torch_ddp_trains(runs, case):
    theirs, ours = runs(case, "torch_ddp")[0], runs(case, "gradsync")[0]
    for key in SAME:
        assert ours["summary"].get(key) == theirs["summary"].get(key), key
    assert ours["summary"]["engine"]["name"] == "gradsync"
    assert len(ours["summary"]["engine"]["buckets"]) >= 3
    assert losses(ours["rows"]) == losses(theirs["rows"])
    for name, value in theirs["params"].items():
        assert torch.equal(ours["params"][name], value), name


def test_another_partition_trains_the_same_model(runs):
    """One bucket (the default 25 MB cap) against torch's three: fewer all-reduces of the same
    bytes, the same model up to float rounding (on 2 ranks each element's mean is computed
    alike in any bucket, so here the bits are the same too)."""
    theirs = runs("accumulate", "torch_ddp")[0]
    ours = runs("accumulate", "gradsync", ("engine.bucket_cap_mb=25",))[0]
    assert ours["summary"]["engine"]["buckets"] == [6]
    assert ours["summary"]["allreduce_calls"] == theirs["summary"]["sync_backwards"]
    assert theirs["summary"]["allreduce_calls"][0] > 2 * theirs["summary"]["sync_backwards"][0]
    assert ours["summary"]["allreduce_bytes"] == theirs["summary"]["allreduce_bytes"]
    for name, value in theirs["params"].items():
        torch.testing.assert_close(ours["params"][name], value, rtol=1e-6, atol=1e-7)


# --- per-bucket decisions -----------------------------------------------------------------------
PER_BUCKET = {"_target_": "components_for_tests.LastLayerAtWindowEnd", "params": "4.*"}


def test_a_per_bucket_policy_needs_the_gradsync_engine():
    cfg = plain_cfg(CASES["always"])
    cfg["sync"] = PER_BUCKET
    with pytest.raises(ConfigError, match=r"decides per gradient bucket \(sync_bucket\), which "
                       "engine=torch_ddp cannot carry out: set engine=gradsync"):
        preflight(cfg)


def test_a_bucket_kept_local_accumulates_into_the_next_synchronisation(runs, pool2, tmp_path):
    """`always`, but the last layer's bucket synchronises only at each window's end: the same
    training up to rounding, its bytes saved in every other backward, and the trace shows each
    bucket kept local."""
    cfg = plain_cfg([*CASES["always"], "engine=gradsync", "engine.trace_sync=true"])
    cfg["sync"] = PER_BUCKET
    preflight(cfg)
    ours = pool2.run(engine_cases.traced_run, cfg, str(tmp_path))[0]
    theirs = runs("always", "torch_ddp")[0]
    for name, value in theirs["params"].items():
        torch.testing.assert_close(ours["params"][name], value, rtol=1e-4, atol=1e-6)
    events = ours["trace"]["traceEvents"]
    kept = [e for e in events if e["name"].endswith("kept local") and e["pid"] == 0]
    assert len(kept) == MICRO_BATCHES - WINDOWS  # every backward but a window's last
    assert all("4.weight" in e["args"]["params"] for e in kept)
    sent = [e for e in events if e["name"].startswith("all-reduce") and e["pid"] == 0]
    assert sum(e["args"]["bytes"] for e in sent) == ours["summary"]["allreduce_bytes"][0]
    saved = theirs["summary"]["allreduce_bytes"][0] - ours["summary"]["allreduce_bytes"][0]
    assert saved >= (MICRO_BATCHES - WINDOWS - 1) * (32 + 2) * 4  # the last layer, at least


# --- the trace ----------------------------------------------------------------------------------
@pytest.mark.parametrize("engine", ["gradsync", "torch_ddp"])
def test_the_trace_records_every_bucket_of_every_step(pool2, tmp_path, engine):
    """amp_aware's bf16 wire: per rank and step, the micro-batches, each bucket's parameters,
    bytes (adding up to the counted bytes) and wire dtype, its ready, launch and finish times in
    order; each step's wait and overlap in metrics.jsonl and TensorBoard."""
    cfg = plain_cfg([*CASES["amp_aware"], f"engine={engine}", "engine.trace_sync=true"])
    r0, r1 = pool2.run(engine_cases.traced_run, cfg, str(tmp_path))
    events = r0["trace"]["traceEvents"]
    assert {e["args"]["name"] for e in events if e["name"] == "process_name"} == {"rank 0",
                                                                                "rank 1"}
    for rank, summary in ((0, r0["summary"]), (1, r1["summary"])):
        mine = [e for e in events if e["pid"] == rank and e["ph"] != "M"]
        steps = [e for e in mine if e["name"].startswith("step ")]
        assert [e["name"] for e in steps] == [f"step {k}" for k in range(1, WINDOWS + 1)]
        micro = [e for e in mine if e["name"].startswith("micro-batch")]
        assert len(micro) == MICRO_BATCHES
        assert sum(e["name"].endswith("(sync)") for e in micro) == WINDOWS
        sent = [e for e in mine if e["name"].startswith("all-reduce bucket")]
        assert len(sent) == summary["allreduce_calls"][rank]
        assert sum(e["args"]["bytes"] for e in sent) == summary["allreduce_bytes"][rank]
        assert {e["args"]["wire"] for e in sent} == {"bfloat16"}
        names = {n for e in sent for n in e["args"]["params"]}
        assert names == {f"{i}.{w}" for i in (0, 2, 4) for w in ("weight", "bias")}
        for e in sent:  # ready <= launched <= finished
            assert e["args"]["ready_to_launch_ms"] >= 0 and e["dur"] >= 0
        for e in steps:
            assert e["args"]["wait_ms"] >= 0 and 0 <= e["args"].get("overlap", 0) <= 1
        # the buckets' shares of the steps' waits add up to them
        assert sum(e["args"]["waited_ms"] for e in sent) == pytest.approx(
            sum(e["args"]["wait_ms"] for e in steps), rel=1e-6, abs=1e-6)
    summary_table = table(r0["trace"])  # python -m gradsync.engines trace RUN_DIR prints it
    assert f"rank 1: {WINDOWS} steps, wait " in summary_table
    assert "| 0 | 0 | " in summary_table and "| bfloat16 |" in summary_table
    rows = r0["rows"]
    assert all("sync_wait_ms" in r for r in rows)
    assert [s for s, _ in r0["tb"]["sync/wait_ms"]] == list(range(1, WINDOWS + 1))
    assert r0["summary"]["sync_trace"]["wait_ms_per_step"][0] >= 0


@pytest.mark.parametrize("engine", ["gradsync", "torch_ddp"])
def test_the_trace_measures_the_wait_for_a_slow_all_reduce(pool2, engine):
    """An all-reduce that takes 50 ms more than the backward: the step waits for it."""
    for r in pool2.run(engine_cases.overlap_of_a_slow_all_reduce, engine):
        assert 45 <= r["last"]["wait_ms"] < 2000
        assert r["last"]["overlap"] < 0.5
        waits = [e for e in r["events"] if e["name"] == "wait for all-reduce"]
        assert waits and waits[-1]["dur"] >= 45e6


def test_wait_and_overlap_from_the_times():
    """Two buckets: one launched during the backward and done before it ends (hidden), one
    launched at its end, finishing 30 later: a wait of 30, an overlap of 10 / 40."""
    trace = SyncTrace(0)
    m = MicroBatch(start=0, sync=True, end=200, compute_end=100)
    m.buckets = [BucketRecord(0, ["a"], 4, "float32", ready=80, launched=90, finished=100),
                 BucketRecord(1, ["b"], 4, "float32", ready=100, launched=100, finished=130)]
    trace.micro = [m]
    trace.step_end()
    assert trace.last == {"wait_ms": 30 / 1e6, "overlap": 10 / 40}
    waited = {e["name"]: e["args"]["waited_ms"] for e in trace.pending if "waited_ms" in e["args"]}
    assert waited == {"all-reduce bucket 0": 0.0, "all-reduce bucket 1": 30 / 1e6}


# --- the classic mistakes (docs/debugging.md, examples/debugging) -------------------------------
TINY = ["data=synthetic", "data.num_samples=96", "data.eval_samples=16", "data.in_dim=4",
        "data.out_dim=2", "schedule.micro_batch_size=8", "schedule.window_size=2",
        "trainer.max_epochs=1", "trainer.progress_bar=false", "trainer.threads_per_worker=1",
        "trainer.checkpoint_every_steps=0", "engine=gradsync"]


@pytest.fixture
def examples(monkeypatch):
    monkeypatch.syspath_prepend(str(engine_cases.EXAMPLES))

    def cfg(extra: list[str] = (), **nodes) -> dict:
        out = plain_cfg([*TINY, *extra])
        out.update(nodes)
        preflight(out)
        return out

    return cfg


def test_the_mistakes_of_the_debugging_page(examples, pool2, tmp_path):
    never = examples(sync={"_target_": "mistakes.policies.NeverSync"})
    first = examples(sync={"_target_": "mistakes.policies.SyncsFirst"})
    drifts = examples(["trainer.check_replicas=1"],
                      sync={"_target_": "mistakes.policies.ForgetsToAverage"})
    unused = {"_target_": "mistakes.models.UnusedHead", "hidden": 8}
    for cfg in (never, first):
        for m in pool2.run(engine_cases.example_run, cfg, str(tmp_path / "a"), "UnsyncedWindow"):
            assert "ends a window of 2 micro-batches (micro-batches 0-1 of the epoch) inside " \
                   "no_sync()" in m
    assert pool2.run(engine_cases.example_run, drifts, str(tmp_path / "b"), "RuntimeError") == [
        "replicas differ after optimizer step 1: parameter '0.weight' on rank 1 is not rank "
        "0's (trainer.check_replicas)"] * 2
    for engine in ("gradsync", "torch_ddp"):
        cfg = examples([f"engine={engine}"], model=unused)
        for m in pool2.run(engine_cases.example_run, cfg, str(tmp_path / engine),
                           "UnusedParameters"):
            assert "head.weight, head.bias" in m and "engine.find_unused_parameters=true" in m
    fine = examples(["engine.find_unused_parameters=true"], model=unused)
    r0, _ = pool2.run(engine_cases.example_run, fine, str(tmp_path / "fine"))
    assert r0["summary"]["optimizer_steps"] == 3
    torch.manual_seed(0)
    assert torch.equal(r0["params"]["head.weight"], _initial_head(fine))


def _initial_head(cfg: dict) -> torch.Tensor:
    """The unused head's initial weights (the worker seeds the model with cfg's seed)."""
    sys.path.insert(0, str(engine_cases.EXAMPLES))
    from mistakes.models import UnusedHead

    torch.manual_seed(cfg["seed"])
    return UnusedHead(4, 2, 8).head.weight.detach()


# --- the command line: trace.json and summary.json, written by the job process ------------------
@pytest.mark.slow
def test_a_failed_run_leaves_its_trace(tmp_path, cli_env):
    """The debugging page's first command: the job stops before its first step, and trace.json
    (merged by the job process from both ranks' files) shows the window's backwards, none of
    them synchronising."""
    import json
    import subprocess

    run_dir = tmp_path / "never"
    proc = subprocess.run(  # from examples/debugging, as the page runs it (its modules import)
        [sys.executable, "-m", "gradsync.run.main", "--config-dir", "conf",
         f"hydra.run.dir={run_dir}", "sync=never_sync", *TINY, "engine.trace_sync=true",
         "trainer.devices=2"],
        cwd=engine_cases.EXAMPLES, env=cli_env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 1, proc.stderr
    assert "UnsyncedWindow" in proc.stderr
    trace = json.loads((run_dir / "trace.json").read_text())["traceEvents"]
    for rank in (0, 1):
        mine = [e["name"] for e in trace if e["pid"] == rank and e["ph"] == "X"]
        assert mine == ["step 1 (unfinished)", "micro-batch 0 (no_sync)"]
    assert Path(run_dir / "trace" / "rank1.jsonl").is_file()
