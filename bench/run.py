"""make bench: every variant on the same workload (workload.py), side by side in one run.

Variants are interleaved (a shuffled order per round and N) and repeated; each run is a fresh
pair of processes, so peak RSS is per variant. Reports the median samples/s of the timed epoch
with min-max, ratios to the hand-written loop and to the no-communication bound, the ranks'
mean CPU milliseconds per micro-batch (what a loaded machine moves far less), all-reduce
calls and bytes per optimizer step (measured by a counting comm hook; for the variants that do
not install one themselves, in a separate untimed run so the hook cannot slow them down), the
largest worker's peak RSS and the timed epoch's mean loss. Writes outputs/bench/<date>.md
(ignored by git; --out elsewhere), a PNG of samples/s against N and the raw numbers. Says how
many runs it plans and, after each, "[k/N ETA ...]". Ctrl-C stops it at once: the running pair
of processes is killed, their scratch dir removed, nothing written.
"""

from __future__ import annotations

import argparse
import importlib
import os
import random
import shutil
import signal
import socket
import sys
import tempfile
import time
from pathlib import Path

import torch.multiprocessing as mp

from gradsync.core.numerics import worker_environment
from gradsync.core.progress import eta

BENCH = Path(__file__).resolve().parent
OUT = BENCH.parent / "outputs" / "bench"  # ignored; bench/results/ keeps the runs docs quote
sys.path.insert(0, str(BENCH))

# name -> (module, function, kwargs); gradsync's variants count their own traffic
VARIANTS: dict[str, tuple[str, str, dict]] = {
    "handwritten": ("handwritten", "run", {}),
    "nocomm": ("handwritten", "run", {"ddp": False}),
    "gradsync always": ("gradsync_runs", "run", {"sync": "always"}),
    # the same bits on any x86-64 CPU with AVX2 (core/numerics.py): what pinning them costs
    "gradsync accumulate (portable bits)": (
        "gradsync_runs", "run", {"sync": "accumulate", "overrides": ("trainer.bits=portable",)}),
    "gradsync accumulate": ("gradsync_runs", "run", {"sync": "accumulate"}),
    # the policy machinery alone: gradsync's loop on the all-reduce the other variants use
    "gradsync accumulate (gloo all-reduce)": (
        "gradsync_runs", "run",
        {"sync": "accumulate", "overrides": ("engine.allreduce=process_group",)}),
    "gradsync amp_aware (bf16 wire)": ("gradsync_runs", "run", {"sync": "amp_aware"}),
    # approximate: rank-4 factors of the weight gradients from the first timed step on
    "gradsync accumulate + PowerSGD": (
        "gradsync_runs", "run",
        {"sync": "accumulate", "overrides": ("sync.compression=powersgd", "sync.powersgd_rank=4",
                                             "sync.powersgd_start_backwards=2")}),
    # the same bits as SGD's for-loop step (tests/test_config.py), in half the time
    "gradsync accumulate + fused SGD": (
        "gradsync_runs", "run", {"sync": "accumulate", "overrides": ("optimizer.fused=true",)}),
    # approximate: no gradient all-reduce; the models meet every 8 windows (docs/local-sgd.md)
    "gradsync local_sgd H=8": ("gradsync_runs", "run",
                               {"sync": "local_sgd", "overrides": ("sync.every=8",)}),
    # where local SGD's time goes (docs/benchmark.md): its rows' logging off, then its
    # averaging off too (the loop on no_sync() alone)
    "gradsync local_sgd H=8 (no logging)": (
        "gradsync_runs", "run", {"sync": "local_sgd", "overrides": (
            "sync.every=8", "trainer.log_every_windows=1000000")}),
    "gradsync local_sgd (no logging or averaging)": (
        "gradsync_runs", "run", {"sync": "local_sgd", "overrides": (
            "sync.every=1000000", "trainer.log_every_windows=1000000")}),
    "gradsync diloco H=8": ("gradsync_runs", "run",
                            {"sync": "diloco", "overrides": ("sync.every=8",)}),
    # engine=gradsync (engines/gradsync_ddp.py) beside torch's DDP (the rows above),
    # and the sync trace's cost on each engine (engine.trace_sync)
    "gradsync accumulate (engine=gradsync)": (
        "gradsync_runs", "run", {"sync": "accumulate", "overrides": ("engine=gradsync",)}),
    "gradsync accumulate (gloo all-reduce) engine=gradsync": (
        "gradsync_runs", "run",
        {"sync": "accumulate", "overrides": ("engine=gradsync",
                                             "engine.allreduce=process_group")}),
    # torch.compile (inductor) of the gradsync engine's model; the warm-up compiles it, untimed
    # (torch's DDP leaves an nn.Sequential such as this MLP uncompiled: docs/components.md)
    "gradsync accumulate (engine=gradsync) + compile": (
        "gradsync_runs", "run", {"sync": "accumulate", "overrides": ("engine=gradsync",
                                                                     "compile.enabled=true")}),
    "gradsync accumulate + trace": (
        "gradsync_runs", "run", {"sync": "accumulate", "overrides": ("engine.trace_sync=true",)}),
    "gradsync accumulate (engine=gradsync) + trace": (
        "gradsync_runs", "run",
        {"sync": "accumulate", "overrides": ("engine=gradsync",
                                             "engine.trace_sync=true")}),
    # FSDP2 (docs/sharded.md): whole gradients held until the window's last micro-batch, or a
    # reduce-scatter after every micro-batch; parameters all-gathered for every forward and
    # backward (MB / step counts the reduce-scatters and all-gathers too)
    "gradsync fsdp accumulate (boundary)": (
        "gradsync_runs", "run", {"sync": "accumulate", "overrides": ("engine=fsdp",)}),
    "gradsync fsdp accumulate (every)": (
        "gradsync_runs", "run", {"sync": "accumulate",
                                 "overrides": ("engine=fsdp",
                                               "sync.reduce_scatter=every")}),
    "lightning": ("frameworks", "lightning", {}),
    "accelerate": ("frameworks", "accelerate", {}),
}
SELF_COUNTING = {name for name, (mod, _, _) in VARIANTS.items() if mod == "gradsync_runs"}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(rank: int, world: int, port: int, module: str, fn: str, kwargs: dict, accum: int,
           count: bool, out, scratch: str) -> None:
    # Ctrl-C reaches the whole process group: the harness alone decides (it kills the pair)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    tempfile.tempdir = scratch  # the run's temporary files: the harness removes the dir
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), GROUP_RANK="0",
                      WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), TMPDIR=scratch)
    sys.path.insert(0, str(BENCH))
    try:
        hook = importlib.import_module("counting").install if count else None
        res = getattr(importlib.import_module(module), fn)(accum, count_hook=hook, **kwargs)
        if count:
            res.update(importlib.import_module("counting").per_step(accum))
        out.put((rank, res))
    except Exception as e:  # report, don't hang the harness
        out.put((rank, {"error": f"{type(e).__name__}: {e}"}))
        raise


def run_variant(name: str, accum: int, count: bool = False, timeout: float = 600) -> dict:
    module, fn, kwargs = VARIANTS[name]
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    port = _free_port()
    scratch = tempfile.mkdtemp(prefix="gradsync-bench-")
    procs = [ctx.Process(target=_entry, args=(r, 2, port, module, fn, kwargs, accum, count, out,
                                              scratch))
             for r in range(2)]
    # portable bits: the pins in the ranks' environment before they import torch, as the
    # launcher sets them (run/launch.py)
    portable = "trainer.bits=portable" in kwargs.get("overrides", ())
    results = {}
    try:
        with worker_environment("portable" if portable else "native"):
            for p in procs:
                p.start()
        for _ in procs:
            rank, res = out.get(timeout=timeout)
            results[rank] = res
    except BaseException:  # Ctrl-C, a timeout: no rank is left behind
        for p in procs:
            if p.pid is not None:
                p.kill()
        raise
    finally:
        for p in procs:
            if p.pid is None:
                continue
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
                p.join()
        shutil.rmtree(scratch, ignore_errors=True)
    errors = [r["error"] for r in results.values() if "error" in r]
    if errors:
        raise RuntimeError(f"{name} N={accum}: {errors[0]}")
    r0 = dict(results[0])
    r0["peak_rss_mb"] = max(r["peak_rss_mb"] for r in results.values())
    r0["cpu_ms_per_micro"] = sum(r["cpu_ms_per_micro"] for r in results.values()) / len(results)
    return r0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--n", default="1,4,8", help="accumulation steps to compare")
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--out", default=str(OUT), help="where the table, plot and numbers go "
                    "(default outputs/bench, ignored by git)")
    ap.add_argument("--seed", type=int, default=0, help="seeds the interleaving order")
    ap.add_argument("--samples", type=int, help="the workload's data set size (default 8192); "
                    "a smaller one only to test the harness")
    ap.add_argument("--report", metavar="JSON", help="only re-render the table and plot of a "
                    "saved run (results/<date>.json)")
    args = ap.parse_args()
    if args.report:
        import report

        print(report.rerender(Path(args.report)).read_text())
        return
    if args.samples:  # read by workload.py in every rank this harness spawns, and by report.py
        os.environ["GRADSYNC_BENCH_SAMPLES"] = str(args.samples)
    ns = [int(n) for n in args.n.split(",")]
    names = args.variants.split(",")
    rng = random.Random(args.seed)
    counted = [name for name in names if name not in SELF_COUNTING and name != "nocomm"]
    total = args.rounds * len(ns) * len(names) + len(ns) * len(counted)
    print(f"bench: {total} runs ({args.rounds} rounds x {len(ns)} N x {len(names)} variants, "
          f"+ {len(ns) * len(counted)} untimed traffic counts); results to {args.out}; Ctrl-C "
          "stops it", flush=True)
    started, done = time.monotonic(), 0

    def step() -> str:
        nonlocal done
        done += 1
        return f"[{done}/{total} ETA {eta(total, done, time.monotonic() - started)}]"

    runs: dict[tuple[str, int], list[dict]] = {}
    traffic = {}
    try:
        for rnd in range(args.rounds):
            for n in ns:
                order = names[:]
                rng.shuffle(order)
                for name in order:
                    res = run_variant(name, n)
                    runs.setdefault((name, n), []).append(res)
                    print(f"{step()} round {rnd + 1} N={n} {name:22s} "
                          f"{res['samples_per_s']:8.0f} samples/s  loss {res['epoch_loss']:.6f}"
                          f"  rss {res['peak_rss_mb']:.0f} MB", flush=True)
        for n in ns:
            for name in names:
                if name in SELF_COUNTING:
                    traffic[(name, n)] = runs[(name, n)][0]
                elif name != "nocomm":
                    traffic[(name, n)] = run_variant(name, n, count=True)
                    print(f"{step()} traffic N={n} {name}", flush=True)
    except KeyboardInterrupt:
        print(f"bench: interrupted after {done} of {total} runs; nothing written",
              file=sys.stderr, flush=True)
        sys.exit(128 + signal.SIGINT)
    import report

    path = report.save(Path(args.out), runs, traffic, ns, names, args.rounds)
    print(f"\nwrote {path} and {path.with_suffix('.png')}")
    print(path.read_text())


if __name__ == "__main__":
    main()
