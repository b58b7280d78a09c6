"""make bench-gpt: nanoGPT's GPT through gradsync beside a hand-written nanoGPT-style loop.

The setting of issue 43 (examples/nanogpt/conf/experiment/nanogpt.yaml): nanoGPT's model.py
unchanged (4 layers, 4 heads, width 128, block 64, dropout 0) on byte windows of this Python's
standard library, 2 CPU ranks on gloo, micro-batch 8, N = 4 (4,096 tokens per optimizer
step), AdamW with nanoGPT's decay groups, warm-up 30 then cosine, clip 1.0. Each run is a fresh
job: gradsync through its command line (`gradsync-train --config-dir examples/nanogpt/conf
experiment=nanogpt`, its default settings otherwise), the reference through torchrun
(bench/gpt_loop.py). Runs are interleaved, each round in the order of the round before
reversed; tokens/s is timed on rank 0 from the end of optimizer step --skip to the last one
(gradsync: the wall times of its TensorBoard rows, every 10 steps), the ratio taken per round
against the reference of that round, and the table gives medians with min-max; beside it the
CPU milliseconds all the job's processes spent per optimizer step over the same span (sampled
every 0.1 s), which a machine loaded by others moves far less than the wall time.

--quality trains --seeds seeds of 300 steps with gradsync and the reference and scores every
final model with nanoGPT's GPT on the same held-out windows (the eval split, every byte once).

    make bench-gpt NANOGPT=/path/to/nanoGPT                 # ~5 minutes on 2 cores
    python bench/gpt.py --nanogpt /path/to/nanoGPT --rounds 5
    python bench/gpt.py --nanogpt /path/to/nanoGPT --quality --seeds 3

nanoGPT is not part of gradsync: clone karpathy/nanoGPT (measured at commit 3adf61e, whose
model.py is that of f08abb4, June 2023) and pass its directory.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
TOKENS_PER_STEP = 2 * 8 * 4 * 64
# the reference's settings, stated on gradsync's command line too (the experiment YAML holds
# the same), so the two cannot drift apart
SETTING = ["data.max_len=65", "data.packed=true", "schedule.micro_batch_size=8",
           "schedule.window_size=4", "optimizer.lr=0.001", "optimizer.betas=[0.9,0.99]",
           "optimizer.weight_decay=0.1", "optimizer.no_decay=[bias,norm]",
           "lr_scheduler.warmup_steps=30", "lr_scheduler.min_lr_ratio=0.1",
           "lr_scheduler.warmup=nanogpt", "trainer.devices=2", "trainer.clip_grad_norm=1.0"]
REFERENCE = "nanogpt loop"
VARIANTS = {REFERENCE: None, "gradsync": [],
            "gradsync deterministic=false": ["trainer.deterministic=false"],
            "gradsync deterministic=true": ["trainer.deterministic=true"],
            "gradsync allreduce=process_group": ["engine.allreduce=process_group"]}


def env(nanogpt: Path) -> dict[str, str]:
    e = dict(os.environ)
    e["PYTHONPATH"] = os.pathsep.join([str(nanogpt), str(REPO / "src"),
                                       *filter(None, [e.get("PYTHONPATH")])])
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        e.pop(key, None)
    return e


def job(command: list[str], nanogpt: Path, cwd: Path) -> list[tuple[float, float]]:
    """Run a job to its end; returns (wall time, CPU seconds of the job's processes so far),
    sampled every 0.1 s: the CPU its ranks spent between two moments, which a machine loaded
    by others moves far less than the wall time."""
    import psutil

    samples: list[tuple[float, float]] = []
    seen: dict[int, float] = {}  # each process's CPU seconds at its last sample
    with tempfile.TemporaryFile("w+") as err:
        proc = subprocess.Popen(command, env=env(nanogpt), cwd=cwd, stdout=subprocess.DEVNULL,
                                stderr=err, text=True)
        root = psutil.Process(proc.pid)
        while proc.poll() is None:
            try:
                for p in [root, *root.children(recursive=True)]:
                    t = p.cpu_times()
                    seen[p.pid] = t.user + t.system
            except psutil.Error:
                pass  # a process that just ended keeps its last sample
            samples.append((time.time(), sum(seen.values())))
            time.sleep(0.1)
        if proc.returncode != 0:
            err.seek(0)
            sys.exit(f"bench-gpt: {' '.join(command[:4])} ... failed:\n{err.read()[-3000:]}")
    return samples


def cpu_at(samples: list[tuple[float, float]], t: float) -> float:
    """The job's CPU seconds at wall time t, between the samples around it."""
    i = next(k for k, (w, _) in enumerate(samples) if w >= t)
    (w0, c0), (w1, c1) = samples[max(i - 1, 0)], samples[i]
    return c0 if w1 == w0 else c0 + (c1 - c0) * (t - w0) / (w1 - w0)


def run_reference(nanogpt: Path, out: Path, steps: int, horizon: int,
                  seed: int) -> tuple[list[tuple[int, float]], list[tuple[float, float]]]:
    """(step, wall time) at the end of every optimizer step, and the CPU samples."""
    cpu = job([sys.executable, "-m", "torch.distributed.run", "--standalone",
               "--nproc_per_node", "2", str(REPO / "bench" / "gpt_loop.py"), "--out", str(out),
               "--steps", str(steps), "--horizon", str(horizon), "--seed", str(seed)],
              nanogpt, out.parent)
    return list(enumerate(json.loads((out / "times.json").read_text()), start=1)), cpu


def run_gradsync(nanogpt: Path, out: Path, steps: int, horizon: int, seed: int,
                 extra: list[str]) -> tuple[list[tuple[int, float]], list[tuple[float, float]]]:
    """(step, wall time) of gradsync's TensorBoard rows, one every 10 optimizer steps, and the
    CPU samples."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    exe = Path(sys.executable).with_name("gradsync-train")
    cpu = job([str(exe), "--config-dir", str(REPO / "examples" / "nanogpt" / "conf"),
         "experiment=nanogpt", *SETTING, f"trainer.max_steps={steps}", f"seed={seed}",
         "trainer.progress_bar=false", "trainer.log_every_windows=10",
         "trainer.checkpoint_every_steps=0",
         f"hydra.run.dir={out}", *extra], nanogpt, out.parent)
    assert horizon == steps, "gradsync's cosine ends at trainer.max_steps"
    ea = EventAccumulator(str(out / "tb"))
    ea.Reload()
    return [(e.step, e.wall_time) for e in ea.Scalars("train/loss")], cpu


def rate(points: list[tuple[int, float]], cpu: list[tuple[float, float]],
         skip: int) -> tuple[float, float]:
    """tokens/s from the end of step `skip` to the last step timed, and the CPU milliseconds
    all the job's processes spent per optimizer step meanwhile."""
    (s0, t0), (s1, t1) = next(p for p in points if p[0] >= skip), points[-1]
    return (TOKENS_PER_STEP * (s1 - s0) / (t1 - t0),
            (cpu_at(cpu, t1) - cpu_at(cpu, t0)) / (s1 - s0) * 1e3)


def speed(args: argparse.Namespace) -> None:
    names = [n for n in VARIANTS if n in args.variants]
    tps: dict[str, list[float]] = {n: [] for n in names}
    cpu: dict[str, list[float]] = {n: [] for n in names}
    ratio: dict[str, list[float]] = {n: [] for n in names}
    cpu_ratio: dict[str, list[float]] = {n: [] for n in names}
    loads = []
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.rounds):
            this: dict[str, tuple[float, float]] = {}
            for name in names if r % 2 == 0 else names[::-1]:
                out = Path(tmp) / f"{r}-{names.index(name)}"
                if VARIANTS[name] is None:
                    points, samples = run_reference(args.nanogpt, out, args.steps, args.steps, 0)
                else:
                    points, samples = run_gradsync(args.nanogpt, out, args.steps, args.steps, 0,
                                                   VARIANTS[name])
                this[name] = rate(points, samples, args.skip)
                shutil.rmtree(out, ignore_errors=True)
                tps[name].append(this[name][0])
                cpu[name].append(this[name][1])
                loads.append(os.getloadavg()[0])
                print(f"  round {r + 1} {name}: {this[name][0]:,.0f} tokens/s, "
                      f"{this[name][1]:,.0f} CPU ms per step, load {loads[-1]:.1f}", flush=True)
            ref = this[REFERENCE]
            for name in names:
                ratio[name].append(this[name][0] / ref[0])
                cpu_ratio[name].append(ref[1] / this[name][1])
    print(f"\n{args.rounds} rounds, steps {args.skip}-{args.steps} timed, {TOKENS_PER_STEP:,} "
          f"tokens a step; 1-min load average during the runs {min(loads):.1f}-{max(loads):.1f} "
          f"on {os.cpu_count()} CPUs\n")
    print("| variant | tokens/s: median (min-max) | x nanoGPT loop | CPU ms per step (all "
          "processes): median (min-max) | x nanoGPT loop, by CPU |")
    print("|---|---|---|---|---|")
    for name in names:
        v, c = tps[name], cpu[name]
        print(f"| {name} | {statistics.median(v):,.0f} ({min(v):,.0f}-{max(v):,.0f}) | "
              f"{statistics.median(ratio[name]):.3f} | {statistics.median(c):,.0f} "
              f"({min(c):,.0f}-{max(c):,.0f}) | {statistics.median(cpu_ratio[name]):.3f} |")
    print("\n(x nanoGPT loop: the median over rounds of each round's ratio; by CPU: the "
          "reference's CPU per step over the variant's, so > 1 is less work per token)")


def quality(args: argparse.Namespace) -> None:
    """Final held-out loss of --seeds runs of 300 steps each, gradsync's and the reference's,
    every model scored by nanoGPT's GPT on the eval split's windows."""
    sys.path.insert(0, str(args.nanogpt))
    import torch
    from model import GPT, GPTConfig

    from gradsync.data.corpus import stdlib_text

    held_out = torch.stack(stdlib_text(max_len=65, packed=True).eval.seqs)

    def score(state: dict) -> float:
        model = GPT(GPTConfig(block_size=64, vocab_size=256, n_layer=4, n_head=4, n_embd=128,
                              dropout=0.0, bias=True))
        model.load_state_dict(state)
        model.eval()
        with torch.no_grad():
            losses = [model(w[:, :-1].contiguous(), w[:, 1:].contiguous())[1]
                      for w in held_out.split(256)]
        sizes = [len(w) for w in held_out.split(256)]
        return float(sum(loss * n for loss, n in zip(losses, sizes, strict=True)) / sum(sizes))

    finals: dict[str, list[float]] = {"nanogpt loop": [], "gradsync": []}
    with tempfile.TemporaryDirectory() as tmp:
        for seed in range(args.first_seed, args.first_seed + args.seeds):
            out = Path(tmp) / f"ref{seed}"
            run_reference(args.nanogpt, out, 300, 300, seed)
            finals["nanogpt loop"].append(score(torch.load(out / "model.pt")))
            out = Path(tmp) / f"gs{seed}"
            run_gradsync(args.nanogpt, out, 300, 300, seed, [])
            model = torch.load(out / "checkpoints" / "last.pt", weights_only=True)["model"]
            finals["gradsync"].append(score(model))
            print(f"  seed {seed}: nanoGPT loop {finals['nanogpt loop'][-1]:.4f}, gradsync "
                  f"{finals['gradsync'][-1]:.4f}", flush=True)
    for name, v in finals.items():
        print(f"{name}: final held-out loss {statistics.mean(v):.4f} (seeds: "
              f"{', '.join(f'{x:.4f}' for x in v)})")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--nanogpt", type=Path, default=os.environ.get("NANOGPT"),
                    help="a clone of karpathy/nanoGPT (its model.py is imported unchanged)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=40, help="optimizer steps per run")
    ap.add_argument("--skip", type=int, default=10, help="steps before the timed ones")
    ap.add_argument("--variants", default=",".join(list(VARIANTS)[:3]),
                    help=f"comma-separated, of: {', '.join(VARIANTS)}")
    ap.add_argument("--quality", action="store_true", help="final held-out loss, 300 steps")
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--first-seed", type=int, default=0)
    args = ap.parse_args()
    if args.nanogpt is None or not (Path(args.nanogpt) / "model.py").is_file():
        sys.exit("bench-gpt: NANOGPT=<a clone of karpathy/nanoGPT> (its model.py), e.g. "
                 "git clone https://github.com/karpathy/nanoGPT && make bench-gpt "
                 "NANOGPT=$PWD/nanoGPT")
    args.nanogpt = Path(args.nanogpt).resolve()
    args.variants = args.variants.split(",")
    quality(args) if args.quality else speed(args)


if __name__ == "__main__":
    main()
