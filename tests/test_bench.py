"""The benchmark harness for one tiny round (no timing is asserted: benchmarks are not tests):
it runs real variants side by side on the bench workload and writes its table, plot and raw
numbers, and the variants it compares train the same model."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from conftest import REPO, cli_environ

pytestmark = [pytest.mark.dist]

VARIANTS = "handwritten,nocomm,gradsync accumulate"
GRAD_MB = 3_149_312 * 4 / 2**20  # the bench MLP's gradients, fp32


@pytest.mark.slow
def test_one_round_of_the_bench_writes_its_table_plot_and_numbers(tmp_path):
    done = subprocess.run(
        [sys.executable, str(REPO / "bench" / "run.py"), "--rounds", "1", "--n", "8",
         "--samples", "1024", "--variants", VARIANTS, "--out", str(tmp_path)],
        env=cli_environ(), capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    md, png, raw = (sorted(tmp_path.glob(f"*.{ext}")) for ext in ("md", "png", "json"))
    assert len(md) == len(png) == len(raw) == 1 and png[0].stat().st_size > 10_000
    runs = {k: v[0] for k, v in json.loads(raw[0].read_text())["runs"].items()}
    traffic = json.loads(raw[0].read_text())["traffic"]
    assert set(runs) == {f"{v}|8" for v in VARIANTS.split(",")}
    assert all(r["samples_per_s"] > 0 and r["peak_rss_mb"] > 100 for r in runs.values())
    # CPU time per micro-batch (the ranks' mean): the bench MLP's forward and backward alone are
    # milliseconds, and at N = 8 two all-reduces add little to any variant
    cpu = {k.split("|")[0]: r["cpu_ms_per_micro"] for k, r in runs.items()}
    assert all(0.5 < c < 1000 and 0.5 < c / cpu["nocomm"] < 3 for c in cpu.values()), cpu
    # one workload: the same data order, model and updates in every variant
    losses = [r["epoch_loss"] for r in runs.values()]
    assert max(losses) - min(losses) < 1e-6 * abs(losses[0])
    # N = 8: 2 optimizer steps in the timed epoch (1024 samples), each one synchronising backward
    for name in ("handwritten", "gradsync accumulate"):
        t = traffic[f"{name}|8"]
        assert t["allreduce_bytes"] / 2**20 == pytest.approx(GRAD_MB, rel=1e-9)
        assert t["allreduce_calls"] >= 1
    table = md[0].read_text()
    for v in VARIANTS.split(","):
        assert f"| {v} |" in table
    assert "| 8 | gradsync accumulate / hand-written |" in table
    assert "CPU ms / micro-batch |" in table
    assert "| 8 | gradsync accumulate / no-comm bound, in CPU ms per micro-batch |" in table
    assert "| handwritten | " in table and "| 1.000 | " in table


def test_the_model_averaging_rows_run_their_policy_every_8_windows():
    """The bench's local SGD / DiLoCo rows compose (as the harness composes them) into the
    policy they are named after (the full rows are too heavy for a test: make bench)."""
    import importlib.util

    from gradsync.components import build

    sys.path.insert(0, str(REPO / "bench"))
    spec = importlib.util.spec_from_file_location("bench_run", REPO / "bench" / "run.py")
    assert spec is not None and spec.loader is not None
    harness = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(harness)
    import gradsync_runs

    for name, policy in [("gradsync local_sgd H=8", "local_sgd"),
                         ("gradsync diloco H=8", "diloco")]:
        module, _, kwargs = harness.VARIANTS[name]
        assert module == "gradsync_runs" and name in harness.SELF_COUNTING
        cfg = gradsync_runs.config(4, kwargs["sync"], list(kwargs["overrides"]))
        built = build(cfg["sync"])
        assert (built.name, built.every, built.averager.whole_model) == (policy, 8, True)
    # the rows that take local SGD's cost apart: logging off, then averaging off too
    for name, every in [("gradsync local_sgd H=8 (no logging)", 8),
                        ("gradsync local_sgd (no logging or averaging)", 1_000_000)]:
        _, _, kwargs = harness.VARIANTS[name]
        cfg = gradsync_runs.config(1, kwargs["sync"], list(kwargs["overrides"]))
        assert (build(cfg["sync"]).every, cfg["trainer"]["log_every"]) == (every, 1_000_000)
        assert "," not in name  # --variants splits on commas


def test_the_startup_table_gives_each_variant_as_a_multiple_of_the_floor():
    sys.path.insert(0, str(REPO / "bench"))
    import startup

    table = startup.markdown({startup.FLOOR_NAME: [(2.0, 2.1), (3.0, 3.1), (2.5, 2.6)],
                              "fork (default on CPU)": [(5.0, 6.0), (6.0, 7.0), (5.5, 6.5)]})
    rows = {line.split(" | ")[0].lstrip("| "): line.split(" | ")[1:]
            for line in table.splitlines() if line.startswith("| ") and "variant" not in line}
    assert rows[startup.FLOOR_NAME][:2] == ["2.50 (2.00-3.00)", "1.00"]
    assert rows["fork (default on CPU)"] == ["5.50 (5.00-6.00)", "2.20", "6.50 (6.00-7.00) |"]


def test_the_engine_rows_run_the_gradsync_engine_and_the_trace():
    """The bench's rows for engine=gradsync and engine.trace_sync compose (as the
    harness composes them) into the engine and trace they are named after, and the report
    checks them against their torch_ddp / untraced twins."""
    import importlib.util

    sys.path.insert(0, str(REPO / "bench"))
    spec = importlib.util.spec_from_file_location("bench_run", REPO / "bench" / "run.py")
    assert spec is not None and spec.loader is not None
    harness = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(harness)
    import gradsync_runs
    import report

    pairs = [*report.ENGINE_PAIRS, *report.TRACED, *report.COMPILED]
    for ours, theirs in pairs:
        assert ours in harness.VARIANTS and theirs in harness.VARIANTS
        assert "," not in ours  # --variants splits on commas
    for name, engine, trace in [("gradsync accumulate (engine=gradsync)", "gradsync", False),
                                ("gradsync accumulate + trace", "torch_ddp", True),
                                ("gradsync accumulate (engine=gradsync) + trace", "gradsync",
                                 True)]:
        _, _, kwargs = harness.VARIANTS[name]
        eng = gradsync_runs.config(4, kwargs["sync"], list(kwargs["overrides"]))["engine"]
        assert (eng["name"], eng["trace_sync"]) == (engine, trace)
    _, _, kwargs = harness.VARIANTS["gradsync accumulate (engine=gradsync) + compile"]
    cfg = gradsync_runs.config(4, kwargs["sync"], list(kwargs["overrides"]))
    assert (cfg["engine"]["name"], cfg["compile"]["enabled"], cfg["compile"]["backend"]) == (
        "gradsync", True, "inductor")
