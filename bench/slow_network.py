"""The projection (gradsync-project's model, run/project.py) against the shaped network
(network=shaped), in two parts (docs/slow-network.md):

1. the grid: for each rank count, policy and rate, one run over links shaped to that rate; its
   step's compute is measured in the run itself (the step less the all-reduce wait that
   engine.trace_sync times, on the rank that came to it last; local SGD: its steps without an
   averaging), the model adds the
   collectives the run counted at that rate and the per-hop latency the run measured on its
   links as it began (summary.json's network.hop_latency_s), and the sum is set against the
   run's measured step. Compute and communication in the same run: a load that slows the
   machine between runs (it is shared) slows both sides alike.
2. the pair: always against accumulate-8 at one rate (50mbit), in one sweep (gradsync-train -m)
   over the shaped links, and the same sweep on network=local; gradsync-project of the local
   sweep at that rate predicts each job's samples/s, set against the shaped sweep's.

The model is the default MLP made wider (hidden 512 x 512: 1.2 MB of gradients) so that a sync
is bytes rather than a hop's wake-up on this 2-core machine (docs: what the model leaves out).
Prints the tables (markdown) and how many predictions lie within 15 %, writes
bench/results/<date>_slow_network.json and .md. Needs root, ip and tc (as network=shaped does).

    python bench/slow_network.py                      # make network-check: the grid and the pair
    python bench/slow_network.py --ranks 2 --rates 20mbit,1gbit --policies always --no-pair

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
MODEL = ["model.hidden_sizes=[512,512]"]  # 1.2 MB of gradients in one bucket
COMMON = ["trainer.checkpoint_every_steps=0", "trainer.log_every_windows=1", "logger=csv",
          *MODEL]
PAIR = ["sync=always,accumulate", "schedule.window_size=8", "trainer.max_steps=16",
        "trainer.devices=2", "engine.allreduce=process_group"]
WITHIN = 0.15
TRAIN = str(Path(sys.executable).parent / "gradsync-train")


def _run(cmd: list[str]) -> None:
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{done.stderr[-2000:]}")


def read_job(run_dir: Path, period: int = 1) -> dict:
    """A finished job's summary, with step_s (the measured step) and compute_s (the step's
    compute: without the all-reduce wait; local SGD: a step without an averaging)."""
    summary = json.loads((run_dir / "summary.json").read_text())
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    rows = [r for r in rows if "train_s" in r and "step" in r]
    steps = {b["step"]: (b["train_s"] - a["train_s"], (b.get("sync_wait_ms") or 0.0) / 1e3)
             for a, b in zip(rows, rows[1:], strict=False)}
    if period == 1:
        # the step's compute is its critical path's: the rank that came to the all-reduce last
        # waited least; rank 0 (whose steps metrics.jsonl times) waited longer by its lag
        waits = (summary.get("sync_trace") or {}).get("wait_ms_per_step") or [0.0]
        lag = (waits[0] - min(waits)) / 1e3
        summary["step_s"] = statistics.median(t for t, _ in steps.values())
        summary["compute_s"] = statistics.median(t - w for t, w in steps.values()) + lag
    else:
        plain = statistics.median(t for k, (t, _) in steps.items() if k % period)
        averaging = statistics.median(t for k, (t, _) in steps.items() if k % period == 0)
        summary["step_s"] = plain + (averaging - plain) / period
        summary["compute_s"] = plain
    return summary


def link_of(job: dict) -> LinkSpec:
    """The shaped run's own link: its rate, and the latency per hop it measured."""
    net = job["network"]
    return LinkSpec(net["rate"], float(net["rate_bits_per_s"]), float(net["hop_latency_s"]))


def grid(ranks: list[int], policies: list[str], rates: list[str], tmp: Path) -> list[dict]:
    rows = []
    for p in ranks:
        for policy in policies:
            overrides, steps, period, calls = POLICIES[policy]
            job = [*overrides, f"trainer.devices={p}", f"trainer.max_steps={steps + 1}",
                   "engine.trace_sync=true"]
            for rate in rates:
                run_dir = tmp / f"shaped-{p}-{policy}-{rate}"
                _run([TRAIN, f"hydra.run.dir={run_dir}", *COMMON, *job, "network=shaped",
                      f"network.rate={rate}"])
                shaped = read_job(run_dir, period)
                link = link_of(shaped)
                per_call = shaped["allreduce_bytes"][0] / shaped["allreduce_calls"][0]
                comm = allreduce_s(per_call * calls, calls, p, link)
                predicted = shaped["compute_s"] + comm
                measured = shaped["step_s"]
                rows.append({
                    "ranks": p, "policy": policy, "rate": rate,
                    "hop_latency_us": link.latency_s * 1e6,
                    "compute_ms": shaped["compute_s"] * 1e3,
                    "comm_ms": comm * 1e3, "predicted_ms": predicted * 1e3,
                    "measured_ms": measured * 1e3, "error": predicted / measured - 1,
                    "engine_mb": shaped["allreduce_bytes"][0] / 1e6,
                    "link_sent_mb": shaped["network"]["link_sent_bytes"][0] / 1e6})
                r = rows[-1]
                print(f"  {p} ranks {policy:12s} {rate:8s} predicted {predicted * 1e3:8.1f} "
                      f"ms measured {measured * 1e3:8.1f} ms ({r['error']:+.0%})", flush=True)
    return rows


def pair(rate: str, tmp: Path) -> list[dict]:
    """always and accumulate-8 in one sweep over links shaped to `rate`, and in one on
    network=local; gradsync-project of the local sweep at `rate` (and the latency per hop the
    shaped jobs measured) against the shaped jobs' samples/s."""
    shaped_dir, local_dir = tmp / f"pair-shaped-{rate}", tmp / "pair-local"
    _run([TRAIN, "-m", f"hydra.sweep.dir={shaped_dir}", *COMMON, *PAIR, "network=shaped",
          f"network.rate={rate}"])
    _run([TRAIN, "-m", f"hydra.sweep.dir={local_dir}", *COMMON, *PAIR])
    shaped = [json.loads((shaped_dir / str(j) / "summary.json").read_text()) for j in (0, 1)]
    hop = statistics.median(s["network"]["hop_latency_s"] for s in shaped)
    out = tmp / "projection.json"
    _run([str(Path(TRAIN).parent / "gradsync-project"), str(local_dir), "--ranks", "2",
          "--link", f"{rate},{hop * 1e6:.1f}us", "--out", str(out)])
    projected = json.loads(out.read_text())["rows"]
    rows = []
    for job, s, row in zip((0, 1), shaped, projected, strict=True):
        rows.append({"policy": s["sync_policy"], "rate": rate,
                     "predicted_samples_per_s": row["samples_per_s"],
                     "measured_samples_per_s": s["samples_per_s"],
                     "error": row["samples_per_s"] / s["samples_per_s"] - 1,
                     "eval_loss": s["eval"]["loss"],
                     "local_eval_loss": json.loads((local_dir / str(job) / "summary.json")
                                                   .read_text())["eval"]["loss"]})
        r = rows[-1]
        print(f"  pair {r['policy']:12s} {rate}: predicted {r['predicted_samples_per_s']:8.0f} "
              f"samples/s measured {r['measured_samples_per_s']:8.0f} ({r['error']:+.0%})",
              flush=True)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ranks", default="2,4")
    ap.add_argument("--rates", default="20mbit,100mbit,1gbit")
    ap.add_argument("--policies", default=",".join(POLICIES))
    ap.add_argument("--pair-rate", default="50mbit")
    ap.add_argument("--no-pair", action="store_true")
    ap.add_argument("--no-grid", action="store_true")
    ap.add_argument("--out", type=Path, default=REPO / "bench" / "results")
    args = ap.parse_args()
    started = time.time()
    with tempfile.TemporaryDirectory(prefix="gradsync-slow-network-") as tmp:
        rows = [] if args.no_grid else grid([int(r) for r in args.ranks.split(",")],
                                            args.policies.split(","), args.rates.split(","),
                                            Path(tmp))
        pairs = [] if args.no_pair else pair(args.pair_rate, Path(tmp))
    stamp = time.strftime("%Y-%m-%d_%H%M%S")
    within = sum(abs(r["error"]) <= WITHIN for r in rows)
    lines = [f"measured {stamp[:10]} ({time.time() - started:.0f} s, {os.cpu_count()} CPUs, "
             f"load average {os.getloadavg()[0]:.1f} at the end)", ""]
    if rows:
        lines += [f"The grid: {within} of {len(rows)} predicted steps within {WITHIN:.0%} of "
                  "the measured step", "",
                  "| ranks | policy | rate | latency per hop us (measured) | compute ms "
                  "(measured) | + link ms (model) | predicted ms | measured ms | error | "
                  "engine MB / link MB (rank 0) |",
                  "|---|---|---|---|---|---|---|---|---|---|"]
        lines += [f"| {r['ranks']} | {r['policy']} | {r['rate']} | {r['hop_latency_us']:.0f} | "
                  f"{r['compute_ms']:.1f} | {r['comm_ms']:.1f} | {r['predicted_ms']:.1f} | "
                  f"{r['measured_ms']:.1f} | {r['error']:+.0%} | {r['engine_mb']:.2f} / "
                  f"{r['link_sent_mb']:.2f} |" for r in rows]
        lines.append("")
    if pairs:
        a, b = pairs
        lines += [f"The pair at {args.pair_rate}, 2 ranks: gradsync-project of the "
                  "network=local sweep against the shaped sweep", "",
                  "| policy | predicted samples/s | measured samples/s | error | eval loss "
                  "(shaped / local) |", "|---|---|---|---|---|"]
        lines += [f"| {r['policy']} | {r['predicted_samples_per_s']:,.0f} | "
                  f"{r['measured_samples_per_s']:,.0f} | {r['error']:+.0%} | "
                  f"{r['eval_loss']:.4f} / {r['local_eval_loss']:.4f} |" for r in pairs]
        ratio_p = a["predicted_samples_per_s"] / b["predicted_samples_per_s"]
        ratio_m = a["measured_samples_per_s"] / b["measured_samples_per_s"]
        lines += ["", f"{a['policy']} / {b['policy']} samples/s: predicted {ratio_p:.3f}, "
                  f"measured {ratio_m:.3f} ({ratio_p / ratio_m - 1:+.0%})"]
    text = "\n".join(lines)
    print(text)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"{stamp}_slow_network.json").write_text(
        json.dumps({"grid": rows, "pair": pairs}, indent=1))
    (args.out / f"{stamp}_slow_network.md").write_text(text + "\n")


if __name__ == "__main__":
    main()
