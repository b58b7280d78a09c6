"""The benchmark harness for one tiny round (no timing is asserted: benchmarks are not tests):
it runs real variants side by side on the bench workload and writes its table, plot and raw
numbers, and the variants it compares train the same model."""

from __future__ import annotations

import json
import re
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
    # 3 timed runs and hand-written's untimed traffic count, each "[k/4 ETA ...]"
    assert done.stdout.startswith("bench: 4 runs (1 rounds x 1 N x 3 variants, + 1 untimed ")
    steps = [line.split("]")[0] for line in done.stdout.splitlines() if line.startswith("[")]
    assert [s.split(" ETA ")[0] for s in steps] == ["[1/4", "[2/4", "[3/4", "[4/4"]
    assert steps[-1] == "[4/4 ETA 0 s"
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


@pytest.mark.slow
def test_ctrl_c_stops_the_bench_within_5_s_leaving_no_process_and_nothing_written(tmp_path):
    """Ctrl-C (SIGINT to the terminal's process group) while the first of 5 runs' ranks start
    and train: the harness kills the pair, removes their scratch dir and ends, exit 130, within
    5 s; no process is left, nothing is written (its "k of N" lines: the test above)."""
    import os
    import signal
    import threading
    import time

    import psutil

    out, scratch = tmp_path / "out", tmp_path / "tmp"
    scratch.mkdir()
    proc = subprocess.Popen(
        [sys.executable, str(REPO / "bench" / "run.py"), "--rounds", "2", "--n", "8",
         "--samples", "1024", "--variants", "handwritten,gradsync accumulate", "--out", str(out)],
        env={**cli_environ(), "TMPDIR": str(scratch)}, stdout=subprocess.PIPE,
        stderr=subprocess.PIPE, text=True, start_new_session=True)
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(proc.stdout), daemon=True)
    reader.start()
    seen: dict[int, float] = {}

    def is_rank(pid: int) -> bool:
        try:
            return "spawn_main" in " ".join(psutil.Process(pid).cmdline())
        except psutil.Error:
            return False

    ranks_up, end = None, time.monotonic() + 300
    while ranks_up is None or time.monotonic() < ranks_up + 4:  # importing torch, training
        assert proc.poll() is None and time.monotonic() < end, lines
        for child in psutil.Process(proc.pid).children(recursive=True):
            seen.setdefault(child.pid, child.create_time())
        if ranks_up is None and sum(map(is_rank, seen)) >= 2:
            ranks_up = time.monotonic()
        time.sleep(0.05)
    sent = time.monotonic()
    os.killpg(proc.pid, signal.SIGINT)
    code = proc.wait(timeout=60)
    took = time.monotonic() - sent
    err = proc.stderr.read()
    assert code == 128 + signal.SIGINT and took < 5, (took, err)
    assert lines[0].startswith("bench: 5 runs") and len(seen) >= 3  # 2 ranks and more
    assert re.match(r"bench: interrupted after [01] of 5 runs; nothing written$",
                    err.strip().splitlines()[-1]), err
    alive = [pid for pid, created in seen.items() if psutil.pid_exists(pid)
             and psutil.Process(pid).create_time() == created
             and psutil.Process(pid).status() != psutil.STATUS_ZOMBIE]
    assert alive == [] and not out.exists()
    assert list(scratch.iterdir()) == []  # the runs' temporary files too


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
        assert (build(cfg["sync"]).every, cfg["trainer"]["log_every_windows"]) == (every, 1_000_000)
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
