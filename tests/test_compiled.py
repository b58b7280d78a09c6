"""compile.enabled on real 2-rank gloo groups (engines/compiled.py): a compiled model trains what
the eager one trains, for the DDP engines and the policies that decide differently (every
micro-batch, the window's last, local SGD's and DiLoCo's own steps, amp_aware's bf16 wire,
PowerSGD's factors) and for FSDP2's units, with the graphs
dynamo built counted (no recompilation between synchronising and no_sync() micro-batches)
and the compile seconds left out of samples/s; what cannot compile is refused in one line.

The backend is aot_eager: dynamo's capture, DDP's graph split and AOT autograd's joint graph,
without inductor's C++ code generation (tens of seconds per graph on these 2 cores); inductor
lowers the same graphs (make bench's compiled row runs it)."""

from __future__ import annotations

import pytest
import torch

import dist_cases
from configs import plain_cfg
from gradsync.config.validate import ConfigError
from gradsync.run.preflight import preflight

pytestmark = [pytest.mark.dist]

# the transformer on 64 token sequences of 4 to 16 tokens: lengths vary between micro-batches
TOKENS = ["model=transformer", "data=synthetic_lm", "data.num_samples=64", "data.eval_samples=16",
          "data.max_len=16", "schedule.micro_batch_size=4", "schedule.window_size=2",
          "trainer.max_epochs=1", "optimizer.lr=0.1", "lr_scheduler.warmup_steps=1",
          "trainer.log_every_windows=1", "trainer.threads_per_worker=1",
          "trainer.progress_bar=false", "trainer.backend=gloo", "trainer.timeout_s=120", "seed=3"]
COMPILED = ["compile.enabled=true", "compile.backend=aot_eager"]
CASES = {"torch_ddp accumulate": ["sync=accumulate"],
         "torch_ddp always": ["sync=always"],
         "torch_ddp local_sgd": ["sync=local_sgd", "sync.every=2"],
         "gradsync accumulate": ["sync=accumulate", "engine=gradsync"],
         "torch_ddp diloco": ["sync=diloco", "sync.every=2"],
         "torch_ddp amp_aware bf16": ["sync=amp_aware", "precision=bf16"],
         "torch_ddp powersgd": ["sync=accumulate", "sync.compression=powersgd",
                                "sync.powersgd_start_backwards=2"],
         "fsdp accumulate": ["sync=accumulate", "engine=fsdp"]}
# PowerSGD is approximate: compiled, it ends 2.0e-2 relative from eager (every exact policy: 0).
# Likely cause, not pinned down: its random projections go tensor by tensor in the order of
# DDP's bucket, which DDP rebuilds from the order gradients arrive in (a graph at a time)
TOLERANCE = {"torch_ddp powersgd": 0.05}
# dynamo's graphs per rank: the first shapes, then one dynamic graph once a length changes
# (evaluation runs the module eager: no graph for no_grad)
GRAPHS = {"torch_ddp": 2, "gradsync": 2, "fsdp": 2}


@pytest.fixture(scope="module")
def runs(pool2, tmp_path_factory):
    done: dict[tuple[str, bool], list[dict]] = {}

    def get(case: str, compiled: bool) -> list[dict]:
        key = (case, compiled)
        if key not in done:
            cfg = plain_cfg([*TOKENS, *CASES[case], *(COMPILED if compiled else [])])
            done[key] = pool2.run(dist_cases.train_run_rows, cfg,
                                  str(tmp_path_factory.mktemp(case.replace(" ", "_"))))
        return done[key]
    return get


@pytest.mark.parametrize("case", list(CASES))
def test_a_compiled_model_trains_what_the_eager_model_trains(runs, case):
    eager, compiled = runs(case, False)[0], runs(case, True)[0]
    s, e = compiled["summary"], eager["summary"]
    for key in ("optimizer_steps", "samples_seen", "sync_backwards", "allreduce_calls",
                "allreduce_bytes"):
        assert s[key] == e[key], key
    worst = max(float((compiled["params"][n] - p).abs().max() / p.abs().max())
                for n, p in eager["params"].items())
    print(f"{case}: worst relative difference {worst:.3g}")
    assert worst < TOLERANCE.get(case, 1e-5), worst  # measured: 0 (bitwise), powersgd aside
    assert sorted(compiled["params"]) == sorted(eager["params"])  # the module's own names
    assert "compile" not in e


@pytest.mark.parametrize("case", list(CASES))
def test_the_graphs_dynamo_built_and_its_seconds_are_counted_apart(runs, case):
    out = runs(case, True)[0]
    s = out["summary"]
    engine = case.split()[0]
    c = s["compile"]
    assert (c["backend"], c["mode"], c["dynamic"]) == ("aot_eager", None, None)
    # as many graphs whichever micro-batches synchronise: no_sync() recompiles nothing
    assert c["graphs"] == [GRAPHS[engine]] * 2, c
    assert all(t > 0 for t in c["compile_s"]) and c["compile_s"][0] < s["train_s"]
    assert s["samples_per_s"] == pytest.approx(s["samples_seen"] /
                                               (s["train_s"] - c["compile_s"][0]), rel=1e-12)


@pytest.mark.parametrize("overrides,message", [
    (["engine.bucket_cap_mb=0.5"], "engine.bucket_cap_mb=0.5 with compile.enabled=true: "
                                    "torch's DDPOptimizer needs buckets of at least 1 MB"),
    (["compile.backend=nope"], "compile.backend='nope' is not allowed: one of"),
    (["compile.mode=max-autotune"], "compile.mode='max-autotune' is not "
                                            "allowed: null with compile.backend other"),
    (["compile.enabled=false"], "compile.backend='aot_eager' is for "
                                "compile.enabled=true (it is false: nothing is compiled)"),
    (["compile.backend=inductor", "compile.mode=fastest"],
     "compile.mode='fastest' is not allowed: null or one of default")])
def test_what_cannot_compile_is_one_line_before_any_worker(overrides, message):
    with pytest.raises(ConfigError) as e:
        preflight(plain_cfg([*TOKENS, *COMPILED, *overrides]))
    assert str(e.value).startswith(message) and "\n" not in str(e.value), e.value


def test_the_compiled_forward_leaves_the_module_and_counts_its_graphs():
    from gradsync.engines.compiled import Compile
    from gradsync.models import Transformer

    model = Transformer(8, 6)
    names = list(model.state_dict())
    forward = Compile("aot_eager").wrap(model)
    x = torch.randint(0, 8, (2, 5))
    forward(x).sum().backward()
    assert list(model.state_dict()) == names and model.tok.weight.grad is not None
    report = Compile("aot_eager").report()  # counted from apply(): this model's one graph
    assert report["graphs"] == 1 and report["compile_s"] > 0, report
