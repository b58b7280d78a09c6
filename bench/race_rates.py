"""The policy race over shaped links at several rates: each contestant's training seconds to the
target loss against the link's rate (one line per policy), from one
`gradsync-train -m experiment=policy_race network=shaped network.rate=R` sweep per rate. Runs
the sweeps (root, as network=shaped needs), or reads sweeps already run; the target is the
worst final eval loss over every job of every sweep, so each contestant is timed to the same
loss at every rate (python -m gradsync.run.sweep's target). Writes a PNG and a markdown table.

    python bench/race_rates.py --rates 20mbit,50mbit,200mbit
    python bench/race_rates.py --sweep 20mbit=<dir> --sweep 50mbit=<dir> --out docs/race-rates.png
"""

from __future__ import annotations

import argparse
import csv
import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "src"))

from gradsync.run.network import rate_bits  # noqa: E402


def run_sweep(rate: str, out: Path) -> Path:
    sweep = out / f"race-{rate}"
    cmd = [str(Path(sys.executable).parent / "gradsync-train"), "-m", "experiment=policy_race",
           "network=shaped", f"network.rate={rate}", f"hydra.sweep.dir={sweep}"]
    subprocess.run(cmd, check=True)
    return sweep


def seconds_to(job: Path, target: float) -> float | None:
    """The job's training seconds when its eval loss first reached `target` (interpolated
    between evaluations, as the sweep summary does); None: never."""
    rows = [json.loads(line) for line in (job / "evals.jsonl").read_text().splitlines()]
    prev = None
    for row in rows:
        if row["loss"] <= target:
            if prev is None or prev["loss"] == row["loss"]:
                return float(row["train_s"])
            f = (prev["loss"] - target) / (prev["loss"] - row["loss"])
            return float(prev["train_s"] + f * (row["train_s"] - prev["train_s"]))
        prev = row
    return None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rates", default="", help="run a sweep at each of these rates")
    ap.add_argument("--sweep", action="append", default=[], help="RATE=DIR: a sweep already run")
    ap.add_argument("--out", type=Path, default=REPO / "bench" / "results" / "race-rates.png")
    args = ap.parse_args()
    sweeps = dict(s.split("=", 1) for s in args.sweep)
    for rate in filter(None, args.rates.split(",")):
        sweeps[rate] = str(run_sweep(rate, args.out.parent))
    rates = sorted(sweeps, key=rate_bits)
    jobs: dict[str, dict[str, Path]] = {}  # policy -> rate -> job dir
    finals = []
    for rate in rates:
        for row in csv.DictReader(open(Path(sweeps[rate]) / "sweep_summary.csv")):
            jobs.setdefault(row["+experiment/race"], {})[rate] = Path(row["dir"])
            finals.append(float(row["eval_loss"]))
    target = max(finals)
    table = {policy: {rate: seconds_to(d, target) for rate, d in by_rate.items()}
             for policy, by_rate in jobs.items()}
    lines = [f"target eval loss {target:.5f} (the worst final one of every job)", "",
             "| contestant | " + " | ".join(rates) + " |", "|---|" + "---|" * len(rates)]
    for policy, by_rate in table.items():
        cells = ["-" if by_rate.get(r) is None else f"{by_rate[r]:.1f}" for r in rates]
        lines.append(f"| `{policy}` | " + " | ".join(cells) + " |")
    print("\n".join(lines))
    args.out.with_suffix(".md").write_text("\n".join(lines) + "\n")

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    xs = [rate_bits(r) / 1e6 for r in rates]
    for policy, by_rate in table.items():
        pts = [(x, by_rate.get(r)) for x, r in zip(xs, rates, strict=True)
               if by_rate.get(r) is not None]
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=policy)
    ax.set_xscale("log")
    ax.minorticks_off()
    ax.set_xticks(xs, rates)
    ax.set_xlabel("link rate (each direction of each rank's link)")
    ax.set_ylabel(f"training seconds to eval loss {target:.3f}")
    ax.set_title("policy race, 2 CPU ranks over shaped links")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(args.out, dpi=100)
    print(f"(written: {args.out}, {args.out.with_suffix('.md')})")


if __name__ == "__main__":
    main()
