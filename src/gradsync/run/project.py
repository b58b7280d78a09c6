"""gradsync-project: what a finished run's optimizer step would take on p ranks over a link of
bandwidth B and latency L (docs/slow-network.md, its formulas and what they leave out).

    gradsync-project RUN_DIR --ranks 8,64,512 --link 10gbit,5us --link 400gbit,2us

From the run (summary.json): the optimizer steps, the micro-batches of a step (N), and per
rank and step the collectives the engine and policy issued (all-reduce calls and bytes: the
gradient syncs, local SGD's / DiLoCo's averagings, in the wire's dtype; a sharded engine's
reduce-scatters and all-gathers). The compute of one micro-batch is the run's training seconds
less what its own link took by the same model (network=shaped: its rate, and as L the latency
per hop the run measured as it began; network=local: no link), per micro-batch. Then, per step
on p ranks:

    all-reduce of S bytes (ring):        2 (p-1)/p * S * F / B + 2 (p-1) L
    reduce-scatter or all-gather of S:     (p-1)/p * S * F / B +   (p-1) L
        (a shaped run's own link, gloo's: a reduce-scatter is an all-reduce of the buffer)
    F = 1 + 1.5 * 66/1448: TCP/IPv4/Ethernet headers per full segment (MTU 1500), and the
        ACKs of what the rank receives meanwhile (one per two segments)
    step = N * compute per micro-batch + the step's collectives, one after another

A sweep dir gives one row per completed job (read as the sweep summary reads them,
run/sweep.py: Hydra's records, the evaluations; the steps to a target loss from the samples to
it, interpolated between evaluations, as the sweep summary's to-target columns); the fastest
job at each scale is marked. The table goes to stdout, everything to JSON
(<run or sweep dir>/projection.json, or --out).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from gradsync.run.network import HEADER_BYTES, SEGMENT_BYTES, rate_bits, seconds
from gradsync.run.sweep import (
    HYDRA_RECORD,
    Job,
    Point,
    job_label,
    read_job,
    read_jobs,
    swept_keys,
    to_target,
)

SUMMARY = "summary.json"
# what a rank's link carries per byte of the engine's: TCP/IPv4 over Ethernet, 66 B of headers
# per segment of 1448 B (MTU 1500), and the ACKs (66 B per two segments, delayed ACKs) of what
# it receives meanwhile (a ring's every rank sends and receives at once); the rendezvous and the
# job's own small collectives left out
FRAMING = 1 + 1.5 * HEADER_BYTES / SEGMENT_BYTES


class ProjectError(ValueError):
    """Bad input: one line, exit 2."""


@dataclass(frozen=True)
class LinkSpec:
    """A link: bandwidth (bits/s) and one-way latency (s), from "10gbit,5us"."""

    text: str
    bits_per_s: float
    latency_s: float

    @classmethod
    def parse(cls, text: str) -> LinkSpec:
        rate, _, latency = text.partition(",")
        try:
            return cls(text, rate_bits(rate), seconds(latency or "0"))
        except ValueError:
            raise ProjectError(f"--link {text!r}: RATE[,LATENCY], a tc rate and a time, e.g. "
                               "10gbit,5us") from None

    @property
    def bytes_per_s(self) -> float:
        return self.bits_per_s / 8


def allreduce_s(nbytes: float, calls: float, p: int, link: LinkSpec) -> float:
    """Ring all-reduce: each rank sends and receives 2(p-1)/p of the bytes, in 2(p-1) steps
    (a latency each) per call."""
    if p <= 1:
        return 0.0
    return (2 * (p - 1) / p * nbytes * FRAMING / link.bytes_per_s
            + calls * 2 * (p - 1) * link.latency_s)


def half_ring_s(nbytes: float, calls: float, p: int, link: LinkSpec) -> float:
    """A reduce-scatter or an all-gather (ring): (p-1)/p of the bytes, p-1 latencies per call."""
    if p <= 1:
        return 0.0
    return (p - 1) / p * nbytes * FRAMING / link.bytes_per_s + calls * (p - 1) * link.latency_s


@dataclass
class RunFacts:
    """What the projection takes from one finished run, per rank and optimizer step."""

    name: str
    policy: str
    engine: str
    world_size: int
    steps: int
    micro_per_step: float
    micro_batch_size: int  # samples per micro-batch and rank
    allreduce_bytes: float  # per step
    allreduce_calls: float
    reduce_scatter_bytes: float  # per step
    reduce_scatter_calls: float
    all_gather_bytes: float  # per step
    all_gather_calls: float
    train_s: float
    own_link: LinkSpec | None  # network=shaped: the run's own link
    evals: list[Point]  # where each evaluation's loss was measured (run/sweep.py)
    samples_per_step: float  # samples a step takes, all ranks

    def comm_s(self, p: int, link: LinkSpec, gloo: bool = False) -> float:
        """The step's collectives on p ranks over `link`. gloo: as gloo issues them (the
        shaped run's own link), whose reduce-scatter is an all-reduce of the whole buffer
        (ProcessGroupGloo::reduce_scatter_tensor_coalesced); else as a ring (NCCL's)."""
        scatter = (allreduce_s if gloo else half_ring_s)(self.reduce_scatter_bytes,
                                                         self.reduce_scatter_calls, p, link)
        return (allreduce_s(self.allreduce_bytes, self.allreduce_calls, p, link) + scatter
                + half_ring_s(self.all_gather_bytes, self.all_gather_calls, p, link))

    @property
    def compute_per_micro_s(self) -> float:
        """The run's seconds per step less its own link's share (the same model), per
        micro-batch."""
        step = self.train_s / self.steps
        if self.own_link is not None:
            step -= self.comm_s(self.world_size, self.own_link, gloo=True)
        return max(step, 0.0) / self.micro_per_step

    def step_s(self, p: int, link: LinkSpec) -> float:
        return self.micro_per_step * self.compute_per_micro_s + self.comm_s(p, link)

    def steps_to(self, target: float) -> float | None:
        """Optimizer steps to an eval loss, interpolated between evaluations as the sweep
        summary's to-target columns are (a run whose evaluations did not record their step:
        the samples to it over the samples of a step)."""
        reached = to_target(self.evals, target)
        if reached is None:
            return None
        return reached["step"] if math.isfinite(reached["step"]) else \
            reached["samples"] / self.samples_per_step


def read_runs(path: Path) -> list[RunFacts]:
    """A run dir's run, or a sweep dir's completed jobs (run/sweep.py reads both), named: a run
    by its dir, a sweep's jobs by their number and what sets them apart (their overrides that
    not every job shares)."""
    if (path / SUMMARY).exists():
        if not (path / HYDRA_RECORD).is_file():
            raise ProjectError(f"{path}: a run dir without {HYDRA_RECORD} (gradsync-train "
                               "writes it beside summary.json)")
        return [run_facts(read_job(path), path.name)]
    jobs = [j for j in read_jobs(path) if j.completed] if path.is_dir() else []
    if not jobs:
        raise ProjectError(f"{path}: neither a run dir nor a sweep dir with a completed job "
                           f"(no {SUMMARY})")
    keys = swept_keys(jobs) if len(jobs) > 1 else []
    return [run_facts(j, f"{j.num} {job_label(j, keys)}" if keys else str(j.num))
            for j in jobs]


def run_facts(job: Job, name: str) -> RunFacts:
    s, path = job.summary, job.dir / SUMMARY
    if s.get("status", "completed") != "completed" or not s.get("optimizer_steps"):
        raise ProjectError(f"{path}: not a completed run with optimizer steps (status "
                           f"{s.get('status')!r})")
    steps = int(s["optimizer_steps"])
    windows = s.get("windows")
    micro: float = sum(int(n) for n in windows.values()) if isinstance(windows, dict) else 0
    if not micro:  # the window size (a list: an adaptive schedule's, each window's)
        accum: Any = s.get("window_size")
        micro = steps * (accum if isinstance(accum, int) else sum(accum) / len(accum))
    net = s.get("network") or {}
    # its own link's latency per hop: what the run measured as it started (run/network.py
    # hop_latency), else netem's delay on both ends of a hop
    own = (LinkSpec(net["rate"], float(net["rate_bits_per_s"]),
                    float(net.get("hop_latency_s", 2 * seconds(net.get("delay", "0")))))
           if net.get("name") == "shaped" else None)
    engine = s.get("engine")
    engine_name = engine.get("name", "?") if isinstance(engine, dict) else str(engine)
    world, batch = int(s["world_size"]), int(s.get("micro_batch_size") or 1)
    return RunFacts(
        name=name, policy=str(s.get("sync_policy")), engine=engine_name,
        world_size=world, steps=steps, micro_per_step=micro / steps, micro_batch_size=batch,
        allreduce_bytes=s["allreduce_bytes"][0] / steps,
        allreduce_calls=s["allreduce_calls"][0] / steps,
        reduce_scatter_bytes=s.get("reduce_scatter_bytes", [0])[0] / steps,
        reduce_scatter_calls=s.get("reduce_scatter_calls", [0])[0] / steps,
        all_gather_bytes=s.get("all_gather_bytes", [0])[0] / steps,
        all_gather_calls=s.get("all_gather_calls", [0])[0] / steps,
        train_s=float(s["train_s"]), own_link=own, evals=job.evals,
        samples_per_step=float(s.get("samples_seen") or world * micro * batch) / steps)


def project(runs: Sequence[RunFacts], ranks: Sequence[int], links: Sequence[LinkSpec],
            target: float | None = None) -> list[dict[str, Any]]:
    """One row per run, link and rank count."""
    rows: list[dict[str, Any]] = []
    for link in links:
        for p in ranks:
            for run in runs:
                step = run.step_s(p, link)
                comm = run.comm_s(p, link)
                reached = run.steps_to(target) if target is not None else None
                rows.append({"run": run.name, "policy": run.policy, "engine": run.engine,
                             "link": link.text, "ranks": p, "step_s": step,
                             "comm_share": comm / step if step > 0 else 0.0,
                             "samples_per_s": None if step <= 0 else
                             p * run.micro_per_step * run.micro_batch_size / step,
                             "time_to_target_s": None if reached is None else reached * step,
                             "fastest": False})
            here = [r for r in rows if r["link"] == link.text and r["ranks"] == p]
            timed = [r for r in here if r["time_to_target_s"] is not None]
            if timed:  # the first to the target loss
                min(timed, key=lambda r: float(r["time_to_target_s"]))["fastest"] = True
            else:  # the fastest step
                min(here, key=lambda r: float(r["step_s"]))["fastest"] = True
    return rows


def _table(rows: list[dict[str, Any]], target: float | None) -> str:
    head = ["run", "policy", "link", "ranks", "step ms", "comm %"]
    if target is not None:
        head.append("to target s")
    lines = [" | ".join(head), " | ".join("---" for _ in head)]
    for r in rows:
        cells = [r["run"] + (" *" if r.get("fastest") else ""), r["policy"], r["link"],
                 str(r["ranks"]), f"{r['step_s'] * 1e3:.1f}", f"{r['comm_share'] * 100:.0f}"]
        if target is not None:
            t = r["time_to_target_s"]
            cells.append("-" if t is None else f"{t:.1f}")
        lines.append(" | ".join(cells))
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="gradsync-project",
        description="Project a finished run (or a sweep's jobs) to p ranks over a link.")
    parser.add_argument("run_dir", type=Path, help="a run dir, or a sweep dir")
    parser.add_argument("--ranks", default="8,64,512", help="rank counts, e.g. 8,64,512")
    parser.add_argument("--link", action="append", default=None,
                        help="RATE[,LATENCY], e.g. 10gbit,5us (repeatable)")
    parser.add_argument("--target-loss", type=float, default=None,
                        help="an eval loss: the time to it (the run's steps to it, evals.jsonl)")
    parser.add_argument("--out", type=Path, default=None, help="the JSON (default: "
                        "RUN_DIR/projection.json)")
    args = parser.parse_args(argv)
    try:
        try:
            ranks = [int(r) for r in args.ranks.split(",")]
        except ValueError:
            raise ProjectError(f"--ranks {args.ranks!r}: rank counts, e.g. 8,64,512") from None
        if not ranks or min(ranks) < 1:
            raise ProjectError(f"--ranks {args.ranks!r}: each at least 1")
        links = [LinkSpec.parse(t) for t in (args.link or ["10gbit,5us"])]
        runs = read_runs(args.run_dir)
    except ProjectError as e:
        print(f"gradsync-project: {e}", file=sys.stderr)
        sys.exit(2)
    rows = project(runs, ranks, links, args.target_loss)
    print(_table(rows, args.target_loss))
    out = args.out or args.run_dir / "projection.json"
    out.write_text(json.dumps({"runs": [asdict(r) | {"compute_per_micro_s":
                                                     r.compute_per_micro_s} for r in runs],
                               "links": [asdict(link) for link in links],
                               "target_loss": args.target_loss, "rows": rows}, indent=1))
    print(f"(written: {out})")


if __name__ == "__main__":
    main()
