"""The engines' own cost, measured where machine noise cannot hide it: one process (a world of
one gloo rank, so no all-reduce waits on another process), the benchmark workload's model and
micro-batches, torch_ddp and gradsync with and without the sync trace on four copies of the
model, their windows interleaved one by one (ABCD DCBA ...). Prints each variant's median thread
CPU and wall time per window and the median over rounds of the per-round time ratios, which a
slow drift of the machine's load moves alike. `make bench` compares whole runs on 2 ranks;
this isolates what an engine adds to a window.

    python bench/engine_ab.py --n 1 --rounds 200
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))

VARIANTS = {"torch_ddp": ("torch_ddp", False), "gradsync": ("gradsync", False),
            "torch_ddp + trace": ("torch_ddp", True), "gradsync + trace": ("gradsync", True)}
RATIOS = [("gradsync", "torch_ddp"), ("torch_ddp + trace", "torch_ddp"),
          ("gradsync + trace", "gradsync")]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=1, help="micro-batches per window")
    ap.add_argument("--rounds", type=int, default=200)
    args = ap.parse_args()
    import workload as w
    from gradsync.engines import build_engine
    from gradsync.engines.trace import SyncTrace
    from gradsync.sync.comm import CommCounts
    from gradsync.sync.policies import AccumulateSync

    torch.set_num_threads(1)
    store = dist.TCPStore("127.0.0.1", 0, 1, is_master=True)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    tmp = tempfile.TemporaryDirectory()
    parts = {}
    for name, (engine, traced) in VARIANTS.items():
        policy, trace = AccumulateSync(), SyncTrace(0) if traced else None
        eng = build_engine(engine, model=w.model(), policy=policy, device=torch.device("cpu"),
                           world_size=1, counts=CommCounts(), trace=trace)
        if trace:
            trace.open(Path(tmp.name) / f"{engine}.jsonl")
        parts[name] = (eng, policy, w.optimizer(eng.parameters()))
    g = torch.Generator().manual_seed(w.SEED)
    batches = [(torch.randn(w.MICRO, w.IN_DIM, generator=g),
                torch.randn(w.MICRO, w.OUT_DIM, generator=g)) for _ in range(8)]

    def window(name: str) -> None:
        eng, policy, opt = parts[name]
        for i in range(args.n):
            x, y = batches[i % len(batches)]
            with eng.micro_batch(policy.should_sync(i, args.n)):
                (w.loss_fn(eng(x), y) / args.n).backward()
        opt.step()
        eng.zero_grad(opt)

    for name in parts:  # past the first synchronising backward and the bucket rebuild
        for _ in range(3):
            window(name)
    wall: dict[str, list[float]] = {k: [] for k in parts}
    cpu: dict[str, list[float]] = {k: [] for k in parts}
    order = list(parts)
    for r in range(args.rounds):
        for name in order if r % 2 == 0 else order[::-1]:
            t0, c0 = time.perf_counter(), time.thread_time()
            window(name)
            cpu[name].append(time.thread_time() - c0)
            wall[name].append(time.perf_counter() - t0)
    print(f"N = {args.n}, {args.rounds} rounds, load average {os.getloadavg()[0]:.1f}")
    for k in parts:
        print(f"  {k:18s} per window: CPU {statistics.median(cpu[k]) * 1e3:7.2f} ms, "
              f"wall {statistics.median(wall[k]) * 1e3:7.2f} ms (medians)")
    for a, b in RATIOS:
        c = statistics.median(x / y for x, y in zip(cpu[a], cpu[b], strict=True))
        t = statistics.median(x / y for x, y in zip(wall[a], wall[b], strict=True))
        print(f"  time {a} / {b}: CPU {c:.3f}, wall {t:.3f} (samples/s ratio {1 / t:.3f})")
    dist.destroy_process_group()
    tmp.cleanup()


if __name__ == "__main__":
    main()
