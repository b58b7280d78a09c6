"""gradsync's loop against the nanoGPT-style loop where a loaded machine cannot hide a few
percent: both in the same 2 gloo processes (bench/gpt.py runs fresh jobs instead), steps of
each interleaved in short phases, on nanoGPT's GPT in the GPT bench's setting (bench/gpt.py
SETTING: micro 8, N = 4, AdamW with nanoGPT's groups, clip 1.0). gradsync runs its worker's
real build_parts and loop (shared-memory all-reduce, the stop agreement's polls, rank-0
metrics and TensorBoard) under each trainer.deterministic setting, switched between phases
as its worker sets it (train/repro.py); the reference runs nanoGPT's train.py loop (DDP,
require_backward_grad_sync, loss / N, get_batch) with torch's deterministic mode off, as
nanoGPT runs. Prints, per rank, the median over phases of CPU and wall milliseconds per
optimizer step and of each phase's ratio to the reference phase next to it.

    python bench/gpt_ab.py --nanogpt /path/to/nanoGPT --rounds 10
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.multiprocessing as mp

BENCH = Path(__file__).resolve().parent
REPO = BENCH.parent
SETTINGS = {"gradsync (null)": None, "gradsync (true)": True, "gradsync (false)": False}


def worker(rank: int, port: int, nanogpt: str, rounds: int, steps: int, queue: mp.Queue) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE="2")
    sys.path[:0] = [nanogpt, str(BENCH)]
    from datetime import timedelta

    import torch.distributed as dist
    import yaml
    from model import GPT, GPTConfig
    from torch.nn.parallel import DistributedDataParallel as DDP

    import gpt
    from gradsync.config.schema import RunConfig
    from gradsync.data import corpus
    from gradsync.run.faults import PROCESS_FLAG, StopAgreement
    from gradsync.run.main import compose_plain
    from gradsync.run.worker import build_parts
    from gradsync.train.loop import Progress, train
    from gradsync.train.metrics import RunLog
    from gradsync.train.repro import set_deterministic

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    cfg = compose_plain(["data=stdlib_text", "optimizer=adamw", *gpt.SETTING,
                         "trainer.backend=gloo", "trainer.progress_bar=false",
                         "trainer.max_steps=100000"])
    cfg["model"] = yaml.safe_load((REPO / "examples" / "nanogpt" / "conf" / "model" /
                                   "nanogpt.yaml").read_text())
    p = build_parts(RunConfig.from_plain(cfg), rank, 2, torch.device("cpu"))
    p.evaluate = dict
    control = dist.new_group(backend="gloo", timeout=timedelta(seconds=300))
    p.stop = StopAgreement(PROCESS_FLAG, control, 2)
    log = RunLog(Path(tempfile.mkdtemp()), active=rank == 0)
    state = Progress()

    text = corpus.select(corpus.stdlib_root(), 2_000_000, 0.1)
    data = torch.frombuffer(bytearray(b"".join(text.text[f] for f in text.train_files)),
                            dtype=torch.uint8).long()
    torch.manual_seed(0)
    model = GPT(GPTConfig(block_size=64, vocab_size=256, n_layer=4, n_head=4, n_embd=128,
                          dropout=0.0, bias=True))
    optimizer = model.configure_optimizers(0.1, 1e-3, (0.9, 0.99), "cpu")
    ddp = DDP(model)

    def get_batch() -> tuple[torch.Tensor, torch.Tensor]:
        ix = torch.randint(len(data) - 64, (8,))
        return (torch.stack([data[i:i + 64] for i in ix]),
                torch.stack([data[i + 1:i + 65] for i in ix]))

    def reference(n: int) -> None:
        set_deterministic(False, "cpu")
        x, y = get_batch()
        for _ in range(n):
            for micro_step in range(4):
                ddp.require_backward_grad_sync = micro_step == 3
                _, loss = ddp(x, y)
                loss = loss / 4
                x, y = get_batch()
                loss.backward()
            torch.nn.utils.clip_grad_norm_(ddp.parameters(), 1.0)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)

    def gradsync(setting: bool | None):
        def run(n: int) -> None:
            set_deterministic(setting, "cpu")
            p.trainer.max_steps = state.step + n
            train(p, state, log)
        return run

    phases = {"nanogpt loop": reference, **{k: gradsync(v) for k, v in SETTINGS.items()}}
    for run in phases.values():
        run(2)
    cpu: dict[str, list[float]] = {k: [] for k in phases}
    wall: dict[str, list[float]] = {k: [] for k in phases}
    for r in range(rounds):
        for name in list(phases) if r % 2 == 0 else list(phases)[::-1]:
            dist.barrier()
            c, w = time.process_time(), time.perf_counter()
            phases[name](steps)
            cpu[name].append((time.process_time() - c) / steps * 1e3)
            wall[name].append((time.perf_counter() - w) / steps * 1e3)
    queue.put((rank, cpu, wall))
    p.stop.close()
    dist.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--nanogpt", type=Path, default=os.environ.get("NANOGPT"))
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--steps", type=int, default=4, help="optimizer steps per phase")
    a = ap.parse_args()
    if a.nanogpt is None or not (Path(a.nanogpt) / "model.py").is_file():
        sys.exit("gpt_ab: --nanogpt <a clone of karpathy/nanoGPT>")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    queue = ctx.SimpleQueue()
    mp.spawn(worker, (port, str(Path(a.nanogpt).resolve()), a.rounds, a.steps, queue), nprocs=2)
    print(f"{a.rounds} rounds x {a.steps} steps per phase; 1-min load average "
          f"{os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs\n")
    print("| rank | phase | CPU ms/step | x nanoGPT loop, by CPU | wall ms/step | "
          "x nanoGPT loop, by wall |")
    print("|---|---|---|---|---|---|")
    for _ in range(2):
        rank, cpu, wall = queue.get()
        ref_c, ref_w = cpu["nanogpt loop"], wall["nanogpt loop"]
        for name in cpu:
            by_cpu = statistics.median(r / c for r, c in zip(ref_c, cpu[name], strict=True))
            by_wall = statistics.median(r / w for r, w in zip(ref_w, wall[name], strict=True))
            print(f"| {rank} | {name} | {statistics.median(cpu[name]):.1f} | {by_cpu:.3f} | "
                  f"{statistics.median(wall[name]):.1f} | {by_wall:.3f} |")


if __name__ == "__main__":
    main()
