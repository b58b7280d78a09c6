"""How fast a job starts: the default experiment for one optimizer step, from the command to its
first optimizer step (the moment metrics.jsonl gets its first row: a 1-step run writes it right
after the step) and to its exit. Variants are interleaved, round after round, so a machine whose
load drifts affects each alike; the table (outputs/bench/<date>_startup.md, ignored by git)
gives the median and the range. Each run prints "[k/N ETA ...]"; Ctrl-C stops it within about a
second (the job running stops itself), nothing written.

    python bench/startup.py [--rounds 5] [--variant LABEL=KEY=VALUE,...]

By default: the floor (a bare torch process taking one SGD step: what any torch training command
pays), this tree as it starts workers (fork on CPU), and the same tree with
GRADSYNC_START_METHOD=spawn (a fresh interpreter per worker, as before). A variant may set
PYTHONPATH to another checkout's src/ to compare code (before/after a change). `make bench`
runs it after the throughput benchmark (STARTUP_ARGS=...).
"""

from __future__ import annotations

import argparse
import datetime as dt
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from gradsync.core.progress import eta

REPO = Path(__file__).resolve().parents[1]
COMMAND = ["-m", "gradsync.run.main", "trainer.max_steps=1", "trainer.progress_bar=false"]
# The floor under any torch training command: one process imports torch, takes one SGD step
# (whose first call imports torch._dynamo: torch.optim wraps its methods in
# torch._disable_dynamo) and writes its row. No gradsync, no Hydra, no second process.
FLOOR = """import json, pathlib, sys, torch
model = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(), torch.nn.Linear(128, 10))
opt = torch.optim.SGD(model.parameters(), lr=0.1)
x, y = torch.randn(32, 64), torch.randint(0, 10, (32,))
torch.nn.functional.cross_entropy(model(x), y).backward()
opt.step()
run = pathlib.Path(sys.argv[1]); run.mkdir()
(run / "metrics.jsonl").write_text(json.dumps({"step": 1}) + "\\n")
"""
FLOOR_NAME = "floor: import torch + 1 SGD step"
DEFAULT_VARIANTS: dict[str, dict[str, str] | None] = {
    FLOOR_NAME: None, "fork (default on CPU)": {}, "spawn": {"GRADSYNC_START_METHOD": "spawn"}}


def one_run(env_extra: dict[str, str] | None, timeout: float = 300) -> tuple[float, float]:
    """Seconds from the command to the first optimizer step, and to the exit (None: the
    floor's command instead of gradsync's)."""
    env = dict(os.environ)
    env.setdefault("PYTHONPATH", str(REPO / "src"))
    env.update(env_extra or {})
    with tempfile.TemporaryDirectory() as tmp:
        rows = Path(tmp) / "run" / "metrics.jsonl"
        command = (["-c", FLOOR, f"{tmp}/run"] if env_extra is None
                   else [*COMMAND, f"hydra.run.dir={tmp}/run"])
        start = time.perf_counter()
        proc = subprocess.Popen([sys.executable, *command],
                                stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                                env=env, cwd=tmp)
        first = None
        try:
            while proc.poll() is None and time.perf_counter() - start < timeout:
                if first is None and rows.exists() and rows.stat().st_size > 0:
                    first = time.perf_counter() - start
                time.sleep(0.01)
        except BaseException:  # Ctrl-C (the job got it too: it stops itself), then the dir goes
            try:
                proc.wait(timeout=3)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
            raise
        if proc.poll() is None:
            proc.kill()
        _, err = proc.communicate()
        end = time.perf_counter() - start
        if proc.returncode != 0 or first is None:
            raise RuntimeError(f"startup run failed ({proc.returncode}): {err[-2000:]}")
    return first, end


def measure(variants: dict[str, dict[str, str] | None], rounds: int) -> dict[str, list[tuple]]:
    out: dict[str, list[tuple]] = {name: [] for name in variants}
    total, started = rounds * len(variants), time.monotonic()
    for rnd in range(rounds):
        order = list(variants) if rnd % 2 == 0 else list(reversed(variants))
        for name in order:
            first, end = one_run(variants[name])
            out[name].append((first, end))
            done = sum(map(len, out.values()))
            print(f"[{done}/{total} ETA {eta(total, done, time.monotonic() - started)}] "
                  f"startup round {rnd + 1} {name:28s} first step {first:6.2f} s  "
                  f"exit {end:6.2f} s", flush=True)
    return out


def markdown(results: dict[str, list[tuple]]) -> str:
    def cell(values: list[float]) -> str:
        return f"{statistics.median(values):.2f} ({min(values):.2f}-{max(values):.2f})"

    lines = ["## Start-up: the default experiment, 1 optimizer step", "",
             f"`python {' '.join(COMMAND)}`; median (min-max) seconds over "
             f"{len(next(iter(results.values())))} interleaved rounds.", "",
             "| variant | command -> first optimizer step s | x floor | command -> exit s |",
             "|---|---|---|---|"]
    floor = statistics.median(r[0] for r in results[FLOOR_NAME]) if FLOOR_NAME in results \
        else None
    for name, runs in results.items():
        first = [r[0] for r in runs]
        ratio = f"{statistics.median(first) / floor:.2f}" if floor else "-"
        lines.append(f"| {name} | {cell(first)} | {ratio} | {cell([r[1] for r in runs])} |")
    return "\n".join(lines) + "\n"


def parse_variants(specs: list[str]) -> dict[str, dict[str, str] | None]:
    """LABEL=KEY=VALUE[,KEY=VALUE...] (LABEL= alone: no extra environment); the floor is
    always measured beside them."""
    variants: dict[str, dict[str, str] | None] = {FLOOR_NAME: None}
    for spec in specs:
        label, _, rest = spec.partition("=")
        variants[label] = dict(kv.split("=", 1) for kv in rest.split(",") if kv)
    return variants


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--variant", action="append", default=[],
                    help="LABEL=KEY=VALUE,...: a variant's extra environment (repeatable)")
    ap.add_argument("--out", default=str(REPO / "outputs" / "bench"),
                    help="writes <date>_startup.md here (default outputs/bench, ignored by git)")
    args = ap.parse_args()
    variants = parse_variants(args.variant) if args.variant else DEFAULT_VARIANTS
    try:
        results = measure(variants, args.rounds)
    except KeyboardInterrupt:
        print("startup: interrupted; nothing written", file=sys.stderr, flush=True)
        sys.exit(128 + signal.SIGINT)
    text = markdown(results)
    path = Path(args.out) / f"{dt.datetime.now():%Y-%m-%d_%H%M%S}_startup.md"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    print(f"\nwrote {path}\n{text}")


if __name__ == "__main__":
    main()
