"""Local SGD's averaging round, direct against the anchor's, in whole 2-rank runs of the
benchmark workload (`gradsync local_sgd H=8`): the fp32 round that averages the replicas
themselves (averaging.average_replicas, the default) against the same run forced through the
fp32 anchor (averaging.Anchor, what DiLoCo and a bf16 wire take), interleaved in pairs so that
a loaded machine moves both alike. Prints each run's CPU ms per micro-batch and samples/s, and
the median of the per-pair ratios.

    python bench/averaging_ab.py --n 1 --pairs 4
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
from pathlib import Path

import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parent))


def rank_main(rank: int, round_: str, n: int, port: str, out) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=port, RANK=str(rank),
                      WORLD_SIZE="2")
    import gradsync_runs
    from gradsync.sync import local_sgd

    if round_ == "anchor":  # what a round is when it cannot be direct
        local_sgd.ModelAveraging.direct = lambda self, model: False  # type: ignore[method-assign]
    r = gradsync_runs.run(n, "local_sgd", ("sync.every=8",))
    if rank == 0:
        out.put((r["cpu_ms_per_micro"], r["samples_per_s"]))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=1, help="micro-batches per window")
    ap.add_argument("--pairs", type=int, default=4)
    ap.add_argument("--port", type=int, default=29631)
    args = ap.parse_args()
    ctx = mp.get_context("spawn")
    res: dict[str, list[tuple[float, float]]] = {"anchor": [], "direct": []}
    for i in range(args.pairs):
        for round_ in (["anchor", "direct"] if i % 2 == 0 else ["direct", "anchor"]):
            out = ctx.SimpleQueue()
            mp.spawn(rank_main, args=(round_, args.n, str(args.port + len(res[round_]) * 2
                                                          + (round_ == "direct")), out),
                     nprocs=2)
            res[round_].append(out.get())
            print(f"  {round_:6s} CPU ms per micro-batch {res[round_][-1][0]:.2f}, "
                  f"samples/s {res[round_][-1][1]:.0f}", flush=True)
    cpu = statistics.median(d[0] / a[0] for a, d in zip(res["anchor"], res["direct"],
                                                         strict=True))
    sps = statistics.median(d[1] / a[1] for a, d in zip(res["anchor"], res["direct"],
                                                        strict=True))
    print(f"N = {args.n}, {args.pairs} pairs: direct / anchor, CPU ms per micro-batch {cpu:.3f}, "
          f"samples/s {sps:.3f}")


if __name__ == "__main__":
    main()
