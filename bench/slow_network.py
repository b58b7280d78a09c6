"""The projection (gradsync-project's model, run/project.py) against the shaped network
(network=shaped): for each rank count, policy and rate, one run over links shaped to that rate;
its step's compute is measured in the run itself (the step less the all-reduce wait that
engine.trace_sync times; local SGD: its steps without an averaging), the model adds the
collectives the run counted at that rate, and the sum is set against the run's measured step.
Compute and communication in the same run: a load that slows the machine between runs (it is
shared) slows both sides alike. Prints the table (markdown) and how many predictions lie within
15 % of the measured step, writes bench/results/<date>_slow_network.json and .md. Needs root,
ip and tc (as network=shaped does).

    python bench/slow_network.py                      # make network-check: the full grid
    python bench/slow_network.py --ranks 2 --rates 20mbit,1gbit --policies always

A step is timed from metrics.jsonl's per-step train_s (step 1 left out: the warm-up), as the
median over the steps (a step the load stretched moves a mean); local SGD's as its median step
without an averaging plus the median averaging step's excess over it, once per H steps.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "src"))

from gradsync.run.project import LinkSpec, allreduce_s  # noqa: E402

# policy: (overrides, steps, period, collectives per full step): the steps timed, the steps
# between averagings, the all-reduces of a step of whole windows (the median step's; a window
# cut short at an epoch's end has fewer)
POLICIES = {
    "always": (["sync=always"], 16, 1, 4.0),  # N=4, the schedule's default
    "accumulate-8": (["sync=accumulate", "schedule.window_size=8"], 16, 1, 1.0),
    "local_sgd": (["sync=local_sgd", "sync.every=8"], 24, 8, 1 / 8),
}
COMMON = ["trainer.checkpoint_every_steps=0", "trainer.log_every_windows=1", "logger=csv"]
WITHIN = 0.15


def run_job(run_dir: Path, overrides: list[str], period: int) -> dict:
    """Run a job; its summary, with step_s (the measured step) and compute_s (the step's
    compute: without the all-reduce wait; local SGD: a step without an averaging)."""
    cmd = [str(Path(sys.executable).parent / "gradsync-train"), f"hydra.run.dir={run_dir}",
           *COMMON, *overrides]
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{done.stderr[-2000:]}")
    summary = json.loads((run_dir / "summary.json").read_text())
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    rows = [r for r in rows if "train_s" in r and "step" in r]
    steps = {b["step"]: (b["train_s"] - a["train_s"], (b.get("sync_wait_ms") or 0.0) / 1e3)
             for a, b in zip(rows, rows[1:], strict=False)}
    if period == 1:
        summary["step_s"] = statistics.median(t for t, _ in steps.values())
        summary["compute_s"] = statistics.median(t - w for t, w in steps.values())
    else:
        plain = statistics.median(t for k, (t, _) in steps.items() if k % period)
        averaging = statistics.median(t for k, (t, _) in steps.items() if k % period == 0)
        summary["step_s"] = plain + (averaging - plain) / period
        summary["compute_s"] = plain
    return summary


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ranks", default="2,4")
    ap.add_argument("--rates", default="20mbit,100mbit,1gbit")
    ap.add_argument("--policies", default=",".join(POLICIES))
    ap.add_argument("--out", type=Path, default=REPO / "bench" / "results")
    args = ap.parse_args()
    ranks = [int(r) for r in args.ranks.split(",")]
    rates = args.rates.split(",")
    policies = args.policies.split(",")
    rows = []
    started = time.time()
    with tempfile.TemporaryDirectory(prefix="gradsync-slow-network-") as tmp:
        for p in ranks:
            for policy in policies:
                overrides, steps, period, calls = POLICIES[policy]
                job = [*overrides, f"trainer.devices={p}", f"trainer.max_steps={steps + 1}",
                       "engine.trace_sync=true"]
                for rate in rates:
                    shaped = run_job(Path(tmp) / f"shaped-{p}-{policy}-{rate}",
                                     [*job, "network=shaped", f"network.rate={rate}"], period)
                    per_call = shaped["allreduce_bytes"][0] / shaped["allreduce_calls"][0]
                    comm = allreduce_s(per_call * calls, calls, p, LinkSpec.parse(rate))
                    predicted = shaped["compute_s"] + comm
                    measured = shaped["step_s"]
                    net = shaped["network"]
                    rows.append({
                        "ranks": p, "policy": policy, "rate": rate,
                        "compute_ms": shaped["compute_s"] * 1e3,
                        "comm_ms": comm * 1e3, "predicted_ms": predicted * 1e3,
                        "measured_ms": measured * 1e3, "error": predicted / measured - 1,
                        "engine_mb": shaped["allreduce_bytes"][0] / 1e6,
                        "link_sent_mb": net["link_sent_bytes"][0] / 1e6})
                    r = rows[-1]
                    print(f"  {p} ranks {policy:12s} {rate:8s} predicted {predicted * 1e3:8.1f} "
                          f"ms measured {measured * 1e3:8.1f} ms ({r['error']:+.0%})",
                          flush=True)
    within = sum(abs(r["error"]) <= WITHIN for r in rows)
    stamp = time.strftime("%Y-%m-%d_%H%M%S")
    lines = [f"measured {stamp[:10]} ({len(rows)} pairs, {time.time() - started:.0f} s, "
             f"{os.cpu_count()} CPUs): {within} of {len(rows)} predictions within "
             f"{WITHIN:.0%} of the measured step", "",
             "| ranks | policy | rate | compute ms (measured) | + link ms (model) | predicted ms | "
             "measured ms | error | engine MB / link MB (rank 0) |",
             "|---|---|---|---|---|---|---|---|---|"]
    lines += [f"| {r['ranks']} | {r['policy']} | {r['rate']} | {r['compute_ms']:.1f} | "
              f"{r['comm_ms']:.1f} | {r['predicted_ms']:.1f} | {r['measured_ms']:.1f} | "
              f"{r['error']:+.0%} | {r['engine_mb']:.2f} / {r['link_sent_mb']:.2f} |"
              for r in rows]
    text = "\n".join(lines)
    print(text)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"{stamp}_slow_network.json").write_text(json.dumps(rows, indent=1))
    (args.out / f"{stamp}_slow_network.md").write_text(text + "\n")


if __name__ == "__main__":
    main()
