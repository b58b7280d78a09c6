"""Fast unit tests: window plans, schedules, policies, LR schedule, loss normalisation."""

from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest
import torch
from torch.utils.data import TensorDataset

from gradsync.config.schema import GlobalBatchScheduleConfig
from gradsync.data.contract import cross_entropy_per_sample, mse_per_sample
from gradsync.data.loader import train_loader
from gradsync.sync.policies import AccumulateSync, AlwaysSync
from gradsync.train.lr_schedulers import WarmupCosine, warmup_cosine
from gradsync.train.schedules import EpochwiseSchedule, build_schedule, total_optimizer_steps
from gradsync.train.windows import Shard, Window
from windows import plan_epoch


def test_plan_epoch_counts_short_last_micro_batch_and_partial_window():
    # 100 samples per rank, micro 8 -> 13 micro-batches (12 x 8 + 4), N=4 -> 4 windows
    plan = plan_epoch(Shard(100), 8, 4)
    assert plan == [Window(0, 4, 32, 32, 32), Window(4, 8, 32, 32, 32),
                    Window(8, 12, 32, 32, 32), Window(12, 13, 4, 4, 4)]
    assert sum(w.local_samples for w in plan) == 100
    assert plan_epoch(Shard(96), 8, 4)[-1] == Window(8, 12, 32, 32, 32)
    assert plan_epoch(Shard(5), 8, 3) == [Window(0, 1, 5, 5, 5)]


def test_plan_epoch_tells_the_samplers_repeats_apart():
    # 101 samples on 3 ranks: 34 positions each (102 in all): rank 2's last position repeats
    # the epoch's first sample; micro 11 -> 3 x 11 + 1 per rank, N=2 -> 2 windows
    plans = [plan_epoch(Shard(101, r, 3), 11, 2) for r in range(3)]
    assert plans[0] == [Window(0, 2, 22, 22, 66), Window(2, 4, 12, 12, 35)]
    assert plans[2] == [Window(0, 2, 22, 22, 66), Window(2, 4, 12, 11, 35)]
    assert [[w.start for w in p] for p in plans] == [[0, 2]] * 3  # the same micro-batches
    # a data set smaller than the world: the repeats fill whole shares
    assert [plan_epoch(Shard(2, r, 5), 4, 1)[0].real for r in range(5)] == [1, 1, 0, 0, 0]
    assert plan_epoch(Shard(2, 4, 5), 4, 1)[0].global_real == 2


@pytest.mark.parametrize("n,world", [(101, 1), (101, 2), (101, 3), (1009, 4), (3, 4), (8, 4)])
def test_shard_matches_the_distributed_sampler(n, world):
    """Shard's arithmetic against the real sampler: over all ranks, the positions Shard calls
    real hold every index of the epoch exactly once, and the others only repeats."""
    seen: list[int] = []
    for rank in range(world):
        _, sampler = train_loader(TensorDataset(torch.arange(n)), 4, rank, world, seed=7)
        sampler.set_epoch(3)
        shard = Shard(n, rank, world)
        indices = list(sampler)
        assert len(indices) == len(shard)
        real = shard.real(0, len(shard))
        assert shard.real(real, len(shard)) == 0  # the repeats come last
        seen += indices[:real]
    assert sorted(seen) == list(range(n))
    assert Shard(n, 0, world).global_real(0, len(Shard(n, 0, world))) == n


@pytest.mark.parametrize("samples,micro,n", [(1, 1, 1), (7, 2, 3), (64, 8, 8), (65, 8, 8),
                                             (1000, 7, 5)])
def test_plan_epoch_covers_every_sample_once(samples, micro, n):
    plan = plan_epoch(Shard(samples), micro, n)
    assert sum(w.local_samples for w in plan) == samples
    assert all(0 < w.size <= n for w in plan)
    assert [w.start for w in plan[1:]] == [w.stop for w in plan[:-1]]
    for world in (2, 3):  # the same data on more ranks: every real sample counted once
        plans = [plan_epoch(Shard(samples, r, world), micro, n) for r in range(world)]
        assert sum(w.global_real for w in plans[0]) == samples
        assert sum(w.real for p in plans for w in p) == samples
        assert all(p[k].global_real == sum(q[k].real for q in plans)
                   for p in plans for k in range(len(p)))


def test_epochwise_schedule_holds_each_entry_until_the_next():
    s = EpochwiseSchedule({0: 1, 2: 4, 5: 8})
    assert [s.window_size(e) for e in range(7)] == [1, 1, 4, 4, 4, 8, 8]
    # keys arrive as strings or ints from YAML/CLI
    assert EpochwiseSchedule({"3": 2, "0": 1}).window_size(3) == 2


def test_global_batch_and_total_steps():
    s = build_schedule(GlobalBatchScheduleConfig(global_batch_size=64, micro_batch_size=8), 2)
    assert s.window_size(0) == 4
    # 100 local samples, micro 8, N=4 -> 4 steps/epoch; 3 epochs -> 12; capped by max_steps
    assert total_optimizer_steps(s, 3, -1, 100, 8) == 12
    assert total_optimizer_steps(s, 3, 5, 100, 8) == 5
    e = EpochwiseSchedule({0: 1, 1: 4})
    assert total_optimizer_steps(e, 2, -1, 100, 8) == 13 + 4


def test_policies_decide_per_micro_batch():
    acc, always = AccumulateSync(), AlwaysSync()
    assert [acc.should_sync(i, 4) for i in range(4)] == [False, False, False, True]
    assert [acc.should_sync(i, 1) for i in range(1)] == [True]  # a window of one syncs
    assert [always.should_sync(i, 4) for i in range(4)] == [True] * 4


def test_warmup_cosine_values():
    f = WarmupCosine(warmup_steps=4, total_steps=14, min_lr_ratio=0.1)  # gradsync's warm-up
    assert [f(s) for s in range(4)] == [0.25, 0.5, 0.75, 1.0]
    assert f(4) == pytest.approx(1.0)
    assert f(9) == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 0.5)))
    assert f(14) == pytest.approx(0.1) and f(20) == pytest.approx(0.1)
    nanogpt = WarmupCosine(warmup_steps=4, total_steps=14, min_lr_ratio=0.1, warmup="nanogpt")
    assert [nanogpt(s) for s in range(5)] == [0.2, 0.4, 0.6, 0.8, 1.0]
    hf = WarmupCosine(warmup_steps=4, total_steps=14, min_lr_ratio=0.1, warmup="hf")
    assert [hf(s) for s in range(5)] == [0.0, 0.25, 0.5, 0.75, 1.0]


def nanogpt_get_lr():
    """nanoGPT's train.py get_lr, as the GPT bench's reference loop runs it
    (bench/gpt_loop.py)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(
        "gpt_loop", Path(__file__).resolve().parents[1] / "bench" / "gpt_loop.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.get_lr


@pytest.mark.parametrize("warmup", ["nanogpt", "hf"])
def test_the_warmup_cosine_schedule_is_nanogpts_or_hugging_faces(warmup):
    """The LR of every optimizer step, through torch's LambdaLR, against nanoGPT's get_lr
    (min_lr 0.1 x lr; the GPT bench's reference loop steps by it) and transformers' own
    get_cosine_schedule_with_warmup (to 0)."""
    from transformers import get_cosine_schedule_with_warmup

    def lrs(make, n=70):
        p = torch.nn.Parameter(torch.zeros(1))
        opt = torch.optim.AdamW([p], lr=6e-4)
        sched, out = make(opt), []
        for _ in range(n):
            out.append(opt.param_groups[0]["lr"])
            opt.step()
            sched.step()
        return out

    ratio = 0.1 if warmup == "nanogpt" else 0.0
    mine = lrs(lambda o: warmup_cosine(o, 60, warmup_steps=30, min_lr_ratio=ratio,
                                       warmup=warmup))
    if warmup == "nanogpt":
        get_lr = nanogpt_get_lr()
        ref = [get_lr(it, 6e-4, 30, 60, 6e-5) for it in range(70)]
    else:
        ref = lrs(lambda o: get_cosine_schedule_with_warmup(o, 30, 60))[:61]
        mine = mine[:61]  # transformers' cosine goes back up after num_training_steps
    assert max(abs(a - b) for a, b in zip(mine, ref, strict=True)) < 1e-18


def test_lr_scheduler_state_survives_a_weights_only_round_trip(tmp_path):
    p = torch.nn.Parameter(torch.zeros(1))
    opt = torch.optim.SGD([p], lr=1.0)
    sched = warmup_cosine(opt, 10, warmup_steps=2, min_lr_ratio=0.0)
    for _ in range(3):
        opt.step()
        sched.step()
    torch.save(sched.state_dict(), tmp_path / "s.pt")
    state = torch.load(tmp_path / "s.pt", weights_only=True)
    assert state["last_epoch"] == 3 and state["lr_lambdas"][0]["total_steps"] == 10


@pytest.mark.parametrize("scaled", [False, True])
def test_a_replanned_schedule_replays_a_fresh_run_of_the_new_length(scaled):
    """lr_schedulers.replan: a 10-step run's scheduler (its cosine ends at 0) continued on a
    20-step horizon gives from step 10 on the LRs of a fresh 20-step run: for schedulers that
    compute each LR from the previous one (torch's PolynomialLR chained with an ExponentialLR:
    no last_epoch of its own), and for warmup_cosine through a ScaledLR's clock (1.5 ticks per
    step)."""
    from torch.optim.lr_scheduler import ChainedScheduler, ExponentialLR, PolynomialLR

    from gradsync.train.lr_scaling import ScaledLR
    from gradsync.train.lr_schedulers import replan

    def run(total: int, steps: int):
        opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
        if scaled:
            sched = ScaledLR(warmup_cosine(opt, total, warmup_steps=2), opt, "linear",
                             reference=32, tick="samples")
        else:
            sched = ChainedScheduler([PolynomialLR(opt, total_iters=total),
                                      ExponentialLR(opt, gamma=0.9)])
        lrs = []
        for _ in range(steps):
            if scaled:
                sched.before_step(Window(0, 1, 0, 0, 48), None)
            lrs.append(opt.param_groups[0]["lr"])
            opt.step()
            sched.step()
        return opt, sched, lrs

    short_opt, short, _ = run(10 if not scaled else 15, 10)
    assert short_opt.param_groups[0]["lr"] == 0.0
    _, _, fresh = run(20 if not scaled else 30, 20)
    opt, sched, _ = run(20 if not scaled else 30, 0)
    fresh_lrs = [g["lr"] for g in opt.param_groups]
    opt.load_state_dict(short_opt.state_dict())
    replan(sched, short.state_dict(), opt, fresh_lrs, steps=10)
    lrs = []
    for _ in range(10):
        if scaled:
            sched.before_step(Window(0, 1, 0, 0, 48), None)
        lrs.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    assert lrs == fresh[10:] and min(lrs) > 0


def test_per_sample_losses_are_each_samples_mean_with_a_count_of_one():
    out = torch.tensor([[1.0, 3.0], [0.0, 0.0]])
    y = torch.zeros(2, 2)
    sums, counts = mse_per_sample(out, y)
    assert sums.tolist() == [(1 + 9) / 2, 0.0] and counts.tolist() == [1.0, 1.0]
    logits = torch.zeros(3, 4)
    assert cross_entropy_per_sample(logits, torch.tensor([0, 1, 2]))[0].sum().item() == \
        pytest.approx(3 * math.log(4))


def test_cpu_peak_memory_is_the_resident_peak_since_training_started():
    from gradsync.core.memory import MemoryMeter, resident_peak_bytes

    big = torch.ones(96 * 2**20 // 4)  # 96 MiB, touched: resident
    del big
    meter = MemoryMeter(torch.device("cpu"))
    meter.start()  # the peak resets to the resident set now, the 96 MiB freed
    after_reset = meter.peak_mb()
    assert meter.measure == "cpu_peak_rss"
    assert resident_peak_bytes() / 2**20 == pytest.approx(after_reset, abs=8)
    block = torch.ones(64 * 2**20 // 4)  # 64 MiB more, touched
    peak = meter.peak_mb()
    del block
    assert after_reset is not None and peak is not None
    assert 64 - 1 <= peak - after_reset <= 64 + 16
    assert meter.summary()["peak_mb"] >= peak - 1  # a peak stays after the free (Linux
    # counts a thread's resident pages in batches: within a MiB)
    meter.record(unsharded=40, sharded=8)
    meter.record(unsharded=0, sharded=24)
    assert meter.summary() | {"peak_mb": 0} == {
        "grad_unsharded_bytes": 40, "grad_sharded_bytes": 24, "grad_held_bytes": 48,
        "peak_mb": 0, "peak_measure": "cpu_peak_rss"}


def test_each_engine_declares_what_it_can_carry_out_on_its_class():
    """The checks ask an engine's capabilities (engines/base.py), never its name."""
    from gradsync.components import ConfigError
    from gradsync.engines import ENGINES, able, capabilities
    from gradsync.engines.fsdp import FSDPEngine, HSDPEngine
    from gradsync.engines.gradsync_ddp import GradsyncDDP
    from gradsync.engines.torch_ddp import TorchDDP

    assert list(ENGINES) == ["torch_ddp", "fsdp", "hsdp", "gradsync"]  # the default first
    assert [capabilities(n) is ENGINES[n].engine.capabilities for n in ENGINES] == [True] * 4
    assert able("sharded") == ["fsdp", "hsdp"] and able("replicas") == ["hsdp"]
    assert able("per_bucket") == ["gradsync"]
    assert able("gradient_probe") == able("trace_sync") == able("sync_batchnorm") == \
        able("shared_memory") == ["torch_ddp", "gradsync"]
    assert [capabilities(n).compile_min_bucket_mb for n in ENGINES] == [1.0, 0.0, 0.0, 0.0]
    assert [ENGINES[n].engine for n in ENGINES] == [TorchDDP, FSDPEngine, HSDPEngine, GradsyncDDP]
    assert issubclass(HSDPEngine, FSDPEngine)
    with pytest.raises(ConfigError, match=r"^engine.name='ddp' is not allowed: one of torch_ddp, "
                                          r"fsdp, hsdp, gradsync$"):
        capabilities("ddp")


def test_a_new_engine_is_its_module_registering_it(tmp_path, monkeypatch):
    """A module in gradsync/engines/ that registers an engine at its end is found: no list to
    edit (its other file is conf/engine/<name>.yaml, tests/test_config.py)."""
    import gradsync.engines as engines

    (tmp_path / "planted_engine.py").write_text(
        "from dataclasses import dataclass\n"
        "from gradsync.engines.base import Capabilities, Registered\n"
        "@dataclass\n"
        "class PlantedSettings:\n"
        "    depth: int = 1\n"
        "    def check(self, device_type): pass\n"
        "class Planted:\n"
        "    capabilities = Capabilities(per_bucket=True, compile_min_bucket_mb=2.5)\n"
        "    def __init__(self, model, world_size):\n"
        "        self.model, self.world_size = model, world_size\n"
        "def build_planted(model, world_size, depth):\n"
        "    return Planted(model, world_size * depth)\n"
        "ENGINES = {'planted': Registered(Planted, build_planted, PlantedSettings)}\n")
    monkeypatch.setattr(engines, "__path__", [*engines.__path__, str(tmp_path)])
    try:
        monkeypatch.setattr(engines, "ENGINES", engines._collect())
    finally:
        sys.modules.pop("gradsync.engines.planted_engine", None)
    assert list(engines.ENGINES) == ["torch_ddp", "fsdp", "hsdp", "gradsync", "planted"]
    assert engines.ENGINES["planted"].engine.__name__ == "Planted"
    assert engines.able("per_bucket") == ["gradsync", "planted"]
    assert engines.capabilities("planted").compile_min_bucket_mb == 2.5
    built = engines.build_engine("planted", AlwaysSync(), model="m", world_size=3, counts=None,
                                 compile=None)
    assert (built.model, built.world_size) == ("m", 3)  # only the keywords it names
    deeper = engines.build_engine("planted", AlwaysSync(), model="m", world_size=3, depth=2)
    assert deeper.world_size == 6  # its settings as keywords: the default's other values
