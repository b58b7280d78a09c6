"""Local SGD and DiLoCo on the pool's 2 real gloo ranks, through the worker's real run_training:
H=1 with SGD + momentum trains accumulate's parameters; DiLoCo with outer lr 1 and no momentum is
local SGD bit for bit; the replicas are bitwise equal right after every averaging and apart in
between; every averaging moves exactly the model's bytes; an fp16 overflow on one rank only skips
that rank's step and the averagings stay on schedule; bad options are refused. (Resuming between
two averagings, from a checkpoint and after a kill -9: tests/test_resume.py.)"""

from __future__ import annotations

import pytest
import torch

import dist_cases
import local_sgd_cases
from configs import plain_cfg
from gradsync.config.validate import ConfigError
from gradsync.run.main import compose_plain
from gradsync.run.preflight import preflight

pytestmark = [pytest.mark.dist]

# 104 samples, 2 ranks, micro 8: 7 micro-batches per rank and epoch (the last one 4 samples),
# accum 2 -> windows 2,2,2,1; 3 epochs: 12 windows. MLP 8-16-2: 178 parameters, no buffers.
RUN = ["data=synthetic", "data.num_samples=104", "data.eval_samples=32", "data.in_dim=8",
       "data.out_dim=2", "schedule.micro_batch_size=8", "model.hidden_sizes=[16]",
       "model.activation=tanh", "lr_scheduler=none", "schedule.window_size=2",
       "trainer.max_epochs=3", "trainer.threads_per_worker=1", "trainer.progress_bar=false",
       "trainer.log_every_windows=5", "trainer.checkpoint_every_steps=0"]
BASE = [*RUN, "optimizer=sgd", "optimizer.lr=0.05", "optimizer.momentum=0.9"]
WINDOWS, PARAMS = 12, 178
# warm-up windows 1-2 exact, then averagings after windows 5, 8, 11 and at the end (12)
# trainer.check_replicas=1: the cross-rank checksum runs whenever the policy says the replicas
# are in sync (warm-up windows, right after each averaging) and stops the run if they are not
LOCAL = [*BASE, "sync=local_sgd", "sync.every=3", "sync.warmup_windows=2",
         "trainer.check_replicas=1"]
AVERAGED = {5, 8, 11, "finish"}


def params(ckpt: dict) -> torch.Tensor:
    return torch.cat([v.flatten() for v in ckpt["model"].values()])


@pytest.fixture(scope="module")
def local(pool2, tmp_path_factory):
    return pool2.run(local_sgd_cases.recorded_run, plain_cfg(LOCAL),
                     str(tmp_path_factory.mktemp("local")))


def test_replicas_are_bitwise_equal_right_after_each_averaging_and_apart_between(local):
    r0, r1 = local
    assert [s[:2] for s in r0["snaps"]] == [s[:2] for s in r1["snaps"]]
    averaged = [w for w, did, _ in r0["snaps"] if did]
    assert set(averaged) == AVERAGED
    for (w, _, a), (_, _, b) in zip(r0["snaps"], r1["snaps"], strict=True):
        if w in AVERAGED or w in (1, 2):  # warm-up: exact all-reduced steps
            assert torch.equal(a, b), w
        else:
            assert (a - b).abs().max() > 1e-6, w
    # the final replicas are the consensus: the checkpoint's model is both ranks' parameters
    assert torch.equal(params(r0["ckpt"]), r0["snaps"][-1][2])
    assert torch.equal(params(r0["ckpt"]), r1["snaps"][-1][2])


def test_drift_is_logged_at_every_averaging_and_its_max_in_the_summary(local):
    r0, r1 = local
    drift = {r["window"]: r["replica_drift"] for r in r0["rows"] if "replica_drift" in r}
    assert set(drift) == {5, 8, 11, 12}  # the final averaging's drift in the last row
    assert all(0 < d < 1 for d in drift.values())
    # each row holds the max over ranks of the ranks' own drifts (riding on the loss's
    # all-reduce), and the ranks' own drifts differ
    assert drift == {w: max(r0["drifts"][w], r1["drifts"][w]) for w in drift}
    assert any(r0["drifts"][w] != r1["drifts"][w] for w in drift)
    print(f"replica drift before each averaging: {drift}")
    assert r0["summary"]["max_replica_drift"] == max(drift.values())
    assert r0["summary"]["averagings"] == 4
    assert r0["summary"]["optimizer_steps"] == r0["summary"]["windows"] == WINDOWS


@pytest.mark.parametrize("wire", ["fp32", "bf16"])
def test_the_averaging_goes_through_shared_memory_with_the_bits_of_a_gloo_all_reduce(
        local, pool2, tmp_path, wire):
    """CPU ranks of one host average through the slots of the shared-memory all-reduce (idle
    after warm-up); over gloo (engine.allreduce=process_group) every window ends with the same
    bits on both ranks, the drift is the same number and the same bytes are counted."""
    cfg = [*LOCAL, f"sync.comm_dtype={wire}"]
    shm = local if wire == "fp32" else pool2.run(local_sgd_cases.recorded_run, plain_cfg(cfg),
                                                 str(tmp_path / "shm"))
    gloo = pool2.run(local_sgd_cases.recorded_run,
                     plain_cfg([*cfg, "engine.allreduce=process_group"]), str(tmp_path / "gloo"))
    for a, b in zip(shm, gloo, strict=True):
        assert a["averaged_through_shm"] == [True] * 4 and b["averaged_through_shm"] == [False] * 4
        for (wa, da, xa), (wb, db, xb) in zip(a["snaps"], b["snaps"], strict=True):
            assert (wa, da) == (wb, db) and torch.equal(xa, xb), wa
        for key in ("allreduce_calls", "allreduce_bytes", "max_replica_drift"):
            assert a["summary"][key] == b["summary"][key], key
    assert not torch.equal(shm[0]["snaps"][3][2], shm[1]["snaps"][3][2])  # window 4: apart


def test_every_averaging_moves_exactly_the_models_bytes(local, pool2, tmp_path):
    r0, r1 = local
    for r in (r0, r1):  # 2 exact warm-up all-reduces (one bucket) + 4 averagings, fp32
        s = r["summary"]
        assert s["sync_backwards"] == [2, 2]
        assert s["allreduce_calls"] == [2 + 4, 2 + 4]
        assert s["allreduce_bytes"] == [(2 + 4) * PARAMS * 4] * 2
    bf16 = pool2.run(local_sgd_cases.recorded_run,
                     plain_cfg([*BASE, "sync=local_sgd", "sync.every=3", "sync.comm_dtype=bf16"]),
                     str(tmp_path))
    s = bf16[0]["summary"]
    assert (s["averagings"], s["sync_backwards"]) == (4, [0, 0])  # after windows 3, 6, 9, 12
    assert s["allreduce_calls"] == [4, 4] and s["allreduce_bytes"] == [4 * PARAMS * 2] * 2
    assert torch.equal(bf16[0]["snaps"][-1][2], bf16[1]["snaps"][-1][2])


def test_local_sgd_every_1_with_sgd_momentum_trains_accumulates_parameters(local, pool2,
                                                                          tmp_path):
    """Averaging is linear: the mean of the ranks' momentum buffers is DDP's buffer."""
    exact, _ = pool2.run(dist_cases.train_run, plain_cfg([*BASE, "sync=accumulate"]),
                         str(tmp_path / "accumulate"))
    h1, _ = pool2.run(dist_cases.train_run,
                      plain_cfg([*BASE, "sync=local_sgd", "sync.every=1"]), str(tmp_path / "h1"))
    a, b = torch.cat([v.flatten() for v in exact["params"].values()]), \
        torch.cat([v.flatten() for v in h1["params"].values()])
    gap = (a - b).abs().max().item()
    print(f"local_sgd H=1 vs accumulate: max |param difference| {gap:.3g}")
    assert gap < 1e-6, gap  # float rounding only
    assert h1["summary"]["averagings"] == WINDOWS and h1["summary"]["sync_backwards"] == [0, 0]
    assert exact["summary"]["final_train_loss"] == pytest.approx(
        h1["summary"]["final_train_loss"], rel=1e-5)
    # H=3 (the local fixture, 2 warm-up windows) really trains other parameters
    assert (params(local[0]["ckpt"]) - a).abs().max() > 1e3 * max(gap, 1e-9)


# A prime number of samples, 13, on 2 ranks, micro 2, accum 3: 7 positions per rank (rank 1's
# last is the sampler's repeat of the epoch's first sample), windows of 6 positions and then 1.
# That last window of each epoch holds one real sample on rank 0 and none on rank 1. 2 epochs:
# 4 windows; H=3 averages after window 3 and at the end, so windows 2 and 4 are local steps.
PRIME = ["data=synthetic", "data.num_samples=13", "data.eval_samples=8", "data.in_dim=8",
         "data.out_dim=2", "schedule.micro_batch_size=2", "model.hidden_sizes=[16]",
         "model.activation=tanh", "lr_scheduler=none", "schedule.window_size=3",
         "trainer.max_epochs=2", "trainer.threads_per_worker=1", "trainer.progress_bar=false",
         "optimizer=sgd", "optimizer.lr=0.05", "optimizer.momentum=0.9"]
LR, MOMENTUM = 0.05, 0.9


def test_a_non_finite_parameter_on_one_rank_stops_every_rank_at_once_with_one_line(pool2,
                                                                                 tmp_path):
    """Local SGD averages every 4 steps; rank 1's replica alone goes inf after step 3, a
    checkpoint step: every rank stops there with the same line naming rank 1, promptly (before:
    rank 1 raised, rank 0 waited in the checkpoint's gather for the group's 60 s timeout)."""
    cfg = plain_cfg([*BASE, "sync=local_sgd", "sync.every=4", "sync.warmup_windows=0",
                     "trainer.checkpoint_every_steps=3"])
    out = pool2.run(local_sgd_cases.non_finite_on_one_rank, cfg, str(tmp_path), 1, 3,
                    timeout=45)
    line = ("non-finite parameters on rank 1 after optimizer step 3 (fp32); stopped, the last "
            "good checkpoint stays in checkpoints/")
    assert [r["error"] for r in out] == [line, line]
    assert all(r["seconds"] < 30 for r in out), out  # the group's timeout: 60 s
    assert not (tmp_path / "checkpoints" / "last.pt").exists()  # nothing diverged was saved


def rank_windows(n: int, seed: int, epochs: int, world: int, window: int) -> list[list[list]]:
    """Per rank, every window's real sample indices, from torch's documented DistributedSampler
    layout: randperm(n) seeded with seed + epoch, padded with its head to a multiple of the
    world size, rank r taking positions r, r + W, ...; padded positions (>= n) are repeats."""
    per_rank = -(-n // world)
    out: list[list[list]] = [[] for _ in range(world)]
    for epoch in range(epochs):
        perm = torch.randperm(n, generator=torch.Generator().manual_seed(seed + epoch)).tolist()
        padded = perm + perm[:per_rank * world - n]
        for r in range(world):
            positions = list(range(r, per_rank * world, world))
            for start in range(0, per_rank, window):
                out[r].append([padded[j] for j in positions[start:start + window] if j < n])
    return out


def test_local_steps_on_uneven_data_are_each_ranks_own_mean_and_a_rank_without_data_rests(
        pool2):
    """H > 1: between averagings each rank trains exactly as one process would on its own real
    samples: each local step applies the gradient of the rank's own mean loss over its real
    samples in the window (rank 0's lone sample: its gradient once, not W times), and a rank
    without a real sample in the window does not step (no momentum step either). Checked
    step by step against plain autograd, and the whole run against an independent reference
    (hand-written SGD with momentum per rank, the mean of the replicas at each averaging)."""
    from test_uneven import mean_loss, reference_model

    cfg = plain_cfg([*PRIME, "sync=local_sgd", "sync.every=3"])
    runs = pool2.run(dist_cases.train_recording_steps, cfg)
    plan = rank_windows(13, cfg["seed"], 2, 2, 6)
    assert [[len(w) for w in ws] for ws in plan] == [[6, 1, 6, 1], [6, 0, 6, 0]]
    for rank, (run, windows) in enumerate(zip(runs, plan, strict=True)):
        assert len(run["steps"]) == 4
        for k, samples in enumerate(windows):
            params, grads = run["steps"][k]
            if not samples:  # no step: the next window starts where this one did
                assert all(g is None for g in grads), (rank, k)
                after = run["steps"][k + 1][0] if k + 1 < 4 else None
                if after is not None:
                    assert all(torch.equal(a, b) for a, b in zip(after, params, strict=True))
                continue
            model, data = reference_model(cfg, params)
            mean_loss("synthetic", model, [data.train[i] for i in samples]).backward()
            err = rel(grads, [q.grad for q in model.parameters()])
            assert err < 1e-5, f"rank {rank}, window {k + 1} ({len(samples)} samples): {err:.3g}"

    # the whole run, independently: SGD with momentum (torch's: buf = m buf + g, the first
    # buf = g) on each rank's own windows, the replicas' mean after window 3 and at the end
    model, data = reference_model(cfg, runs[0]["steps"][0][0])
    start = [q.detach().clone() for q in model.parameters()]
    replicas = [[q.clone() for q in start] for _ in range(2)]
    bufs: list[list | None] = [None, None]
    for k in range(4):
        for r in range(2):
            if not plan[r][k]:
                continue
            ref, _ = reference_model(cfg, replicas[r])
            mean_loss("synthetic", ref, [data.train[i] for i in plan[r][k]]).backward()
            grads = [q.grad for q in ref.parameters()]
            bufs[r] = grads if bufs[r] is None else [MOMENTUM * b + g for b, g in
                                                     zip(bufs[r], grads, strict=True)]
            replicas[r] = [q - LR * b for q, b in zip(replicas[r], bufs[r], strict=True)]
        if k + 1 in (3, 4):
            mean = [(a + b) / 2 for a, b in zip(*replicas, strict=True)]
            replicas = [mean, [q.clone() for q in mean]]
    for run in runs:
        for got, want in zip(run["params"], replicas[0], strict=True):
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    assert rel(runs[0]["params"], start) > 1e-2  # it trained: the check has teeth
    # the logged loss is still the window's mean over every rank's real samples: window 4
    # holds rank 0's lone sample, scored with rank 0's parameters
    model, data = reference_model(cfg, runs[0]["steps"][3][0])
    with torch.no_grad():
        lone = float(mean_loss("synthetic", model, [data.train[i] for i in plan[0][3]]))
    assert runs[0]["last_loss"] == pytest.approx(lone, rel=1e-6)


def test_local_sgd_every_1_on_uneven_data_still_trains_accumulates_parameters(pool2, tmp_path):
    """H = 1 keeps the shared divisor (global real samples / W): the mean of the ranks' steps is
    the step of the window's global mean, rank 0's lone sample and rank 1's empty window
    included."""
    exact, _ = pool2.run(dist_cases.train_run, plain_cfg([*PRIME, "sync=accumulate"]),
                         str(tmp_path / "accumulate"))
    h1, _ = pool2.run(dist_cases.train_run, plain_cfg([*PRIME, "sync=local_sgd", "sync.every=1"]),
                      str(tmp_path / "h1"))
    a, b = torch.cat([v.flatten() for v in exact["params"].values()]), \
        torch.cat([v.flatten() for v in h1["params"].values()])
    gap = (a - b).abs().max().item()
    print(f"local_sgd H=1 vs accumulate on 13 samples: max |param difference| {gap:.3g}")
    assert gap < 1e-6, gap
    assert h1["summary"]["averagings"] == 4 and h1["summary"]["samples_seen"] == 26


def rel(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    fa, fb = torch.cat([t.flatten() for t in a]), torch.cat([t.flatten() for t in b])
    return float((fa - fb).norm() / fb.norm())


def test_diloco_with_outer_lr_1_and_no_momentum_is_local_sgd_bit_for_bit(local, pool2,
                                                                         tmp_path):
    outer = ["sync=diloco", "sync.every=3", "sync.warmup_windows=2", "sync.outer_lr=1.0",
             "sync.outer_momentum=0.0", "sync.outer_nesterov=false"]
    plain, _ = pool2.run(dist_cases.train_run_rows, plain_cfg([*BASE, *outer]),
                         str(tmp_path / "plain"))
    assert torch.equal(torch.cat([v.flatten() for v in plain["params"].values()]),
                       params(local[0]["ckpt"]))
    assert [r["loss"] for r in plain["rows"]] == [r["loss"] for r in local[0]["rows"]]
    assert plain["summary"]["allreduce_bytes"] == local[0]["summary"]["allreduce_bytes"]
    # the paper's outer step (lr 0.7, Nesterov momentum 0.9) moves elsewhere
    nesterov, _ = pool2.run(dist_cases.train_run, plain_cfg([*BASE, *outer[:3]]),
                            str(tmp_path / "nesterov"))
    assert not torch.equal(nesterov["params"]["0.weight"], plain["params"]["0.weight"])
    assert nesterov["summary"]["allreduce_bytes"] == plain["summary"]["allreduce_bytes"]


def test_fp16_overflow_on_one_rank_skips_its_step_only_and_averaging_stays_on_schedule(
        pool2, tmp_path):
    cfg = plain_cfg([*BASE, "sync=local_sgd", "sync.every=3", "precision=fp16"])
    r0, r1 = pool2.run(local_sgd_cases.recorded_run, cfg, str(tmp_path), 1, 2)
    s = r0["summary"]
    assert s["local_skipped_steps"] == [0, 1]  # rank 1's scaler alone skipped window 2
    assert s["amp_skipped_steps"] == 0 and s["optimizer_steps"] == WINDOWS
    assert s["averagings"] == 4 and s["allreduce_calls"] == [4, 4]
    # each rank its own scaler: rank 1 backed off once at window 2
    assert r1["scales"][1] == r0["scales"][1] / 2
    for (w, did, a), (_, did1, b) in zip(r0["snaps"], r1["snaps"], strict=True):
        assert did == did1 == (w in (3, 6, 9, 12)), w
        assert torch.equal(a, b) == (w in (3, 6, 9, 12, "finish")), w


BAD = [
    (["sync=local_sgd", "sync.every=0"], "sync.every=0 is not allowed: an integer >= 1"),
    (["sync=diloco", "sync.every=-2"], "sync.every=-2 is not allowed"),
    (["sync=local_sgd", "sync.warmup_windows=-1"], "sync.warmup_windows=-1 is not allowed"),
    (["sync=local_sgd", "+sync.compression=powersgd"],
     "sync.compression: unknown key for gradsync.sync.local_sgd.local_sgd; accepted keys: "
     "comm_dtype, every, warmup_windows"),
    (["sync=diloco", "+sync.powersgd_rank=2"], "sync.powersgd_rank: unknown key for "
     "gradsync.sync.local_sgd.diloco"),
    (["sync=local_sgd", "+sync.overflow_consensus=true"],
     "sync.overflow_consensus: unknown key for gradsync.sync.local_sgd.local_sgd"),
    (["sync=local_sgd", "sync.comm_dtype=fp16"], "sync.comm_dtype='fp16' is not allowed: one "
     "of fp32, bf16"),
    (["sync=diloco", "sync.outer_momentum=0"], "sync.outer_nesterov=true needs "
     "sync.outer_momentum > 0"),
    (["sync=diloco", "sync.outer_lr=0"], "sync.outer_lr=0 is not allowed: a number > 0"),
    # renamed to say their unit: the old name names the new one
    (["sync=local_sgd", "+sync.warmup_steps=2"],
     "sync.warmup_steps was renamed: use sync.warmup_windows"),
    (["sync=diloco", "+sync.warmup_steps=2"],
     "sync.warmup_steps was renamed: use sync.warmup_windows"),
    (["sync=amp_aware", "+sync.powersgd_start_step=2"],
     "sync.powersgd_start_step was renamed: use sync.powersgd_start_backwards"),
]


@pytest.mark.parametrize("args,expected", BAD, ids=[" ".join(a) for a, _ in BAD])
def test_bad_options_are_one_line_config_errors(args, expected):
    cfg = compose_plain(args)
    with pytest.raises(ConfigError) as e:
        preflight(cfg)
    assert expected in str(e.value) and "\n" not in str(e.value)


def test_diloco_outer_step_is_nesterov_sgd_on_the_mean_pseudo_gradient():
    """OuterSGD (fused torch SGD) against the update written out: buf = m * buf + d,
    global -= lr * (d + m * buf), from zero momentum, over three rounds."""
    from gradsync.sync.local_sgd import OuterSGD

    gen = torch.Generator().manual_seed(0)
    globals_ = [torch.randn(5, 3, generator=gen), torch.randn(7, generator=gen)]
    expected = [g.clone() for g in globals_]
    bufs = [torch.zeros_like(g) for g in globals_]
    outer = OuterSGD(lr=0.7, momentum=0.9, nesterov=True)
    for _ in range(3):
        pseudo = [torch.randn(g.shape, generator=gen) * 0.01 for g in globals_]
        outer.step(globals_, [d.clone() for d in pseudo])
        for e, b, d in zip(expected, bufs, pseudo, strict=True):
            b.mul_(0.9).add_(d)
            e.sub_(0.7 * (d + 0.9 * b))
    for g, e in zip(globals_, expected, strict=True):
        torch.testing.assert_close(g, e, rtol=1e-6, atol=1e-7)
        assert g.grad is None  # the pseudo-gradient is not left behind


def test_an_fp32_round_averages_the_replicas_themselves_against_a_float64_mean(pool2):
    """local SGD's fp32 round (averaging.average_replicas, no fp32 anchor): parameters and
    float buffers become the float64 mean of the replicas up to fp32 rounding, the drift is
    the float64 one, and shared memory and the process group give the same bits."""
    shm = pool2.run(local_sgd_cases.direct_round_against_float64, True)
    gloo = pool2.run(local_sgd_cases.direct_round_against_float64, False)
    for a, b in zip(shm, gloo, strict=True):
        assert a["slot_written"] and not b["slot_written"]
        assert torch.equal(a["params"], b["params"]) and a["drift"] == b["drift"]
        assert max(a["mean_err"]) < 1e-7, a["mean_err"]
        for d, ref in zip(a["drift"], a["drift_ref"], strict=True):
            assert 0.005 < ref and abs(d - ref) < 1e-5 * ref, (d, ref)
        # Linear 6*5+5 and BatchNorm 5+5 parameters, running mean and var 5+5: 55 floats
        assert (a["calls"], a["bytes"]) == (3, 3 * 55 * 4)
    assert torch.equal(shm[0]["params"], shm[1]["params"])


@pytest.mark.parametrize(("make", "anchored"), [
    ("local_sgd()", False), ("local_sgd(comm_dtype='bf16')", True), ("diloco()", True),
    ("diloco(outer_lr=1.0, outer_momentum=0.0, outer_nesterov=False)", False)])
def test_only_a_round_that_rounds_or_steps_keeps_the_fp32_anchor(make, anchored):
    """The anchor (an fp32 copy of the model, and a second for a round's pseudo-gradient) is
    kept where the round needs it: a bf16 wire (the updates are rounded, never the weights) and
    DiLoCo's outer step. The plain fp32 mean needs none."""
    from gradsync.sync.local_sgd import diloco, local_sgd  # noqa: F401 (eval)

    policy = eval(make)
    policy.start(torch.nn.Linear(3, 2), 0)
    assert (policy.anchor is not None) == anchored
    assert (policy.state_dict()["anchor"] is not None) == anchored
