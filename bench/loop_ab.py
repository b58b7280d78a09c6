"""gradsync's loop against the hand-written loop where machine noise cannot hide a few percent:
one process (a world of one gloo rank, so no all-reduce waits on another process), the
benchmark workload (half an epoch per run), the two loops' whole runs interleaved ABBA, on
`engine.allreduce=process_group` (the policy machinery alone, on the all-reduce the
hand-written loop uses). Prints each loop's median time per optimizer step and the median over
rounds of the per-round time ratio. `make bench` compares whole 2-rank runs; this isolates what
gradsync's loop adds to a step.

    python bench/loop_ab.py --n 1 --rounds 6
    python bench/loop_ab.py --n 1 --rounds 6 --tiny     # a 16-16-16 MLP: the loop's own cost
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=1, help="micro-batches per window")
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--tiny", action="store_true", help="a model too small to hide the loop")
    ap.add_argument("--port", default="29611")
    args = ap.parse_args()
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=args.port, RANK="0", WORLD_SIZE="1")
    import workload as w

    w.WORLD, w.SAMPLES = 1, 4096
    if args.tiny:
        w.SAMPLES, w.IN_DIM, w.OUT_DIM, w.HIDDEN, w.MICRO = 8192, 16, 16, [16], 8
    w.DATA_CFG.update(num_samples=w.SAMPLES, in_dim=w.IN_DIM, out_dim=w.OUT_DIM)
    import gradsync_runs
    import handwritten

    loops = {"hand-written": lambda: handwritten.run(args.n),
             "gradsync": lambda: gradsync_runs.run(
                 args.n, "accumulate", ("engine.allreduce=process_group",))}
    steps = w.SAMPLES // w.MICRO / args.n
    ms: dict[str, list[float]] = {name: [] for name in loops}
    for r in range(args.rounds):
        for name in (list(loops) if r % 2 == 0 else list(loops)[::-1]):
            ms[name].append(w.SAMPLES / loops[name]()["samples_per_s"] / steps * 1e3)
    for name, v in ms.items():
        print(f"  {name:12s} ms per step: median {statistics.median(v):.3f} "
              f"[{min(v):.3f}-{max(v):.3f}]")
    pairs = zip(ms["gradsync"], ms["hand-written"], strict=True)
    ratio = statistics.median(g / h for g, h in pairs)
    print(f"N = {args.n}{' (tiny model)' if args.tiny else ''}, {args.rounds} rounds: time "
          f"gradsync / hand-written {ratio:.3f} (samples/s ratio {1 / ratio:.3f})")


if __name__ == "__main__":
    main()
