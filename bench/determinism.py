"""What torch's deterministic mode costs on CPU, op by op (docs/reproducibility.md).

One process, one optimizer step as a rank of a 2-rank run computes it, N = 4 forwards and
backwards, clip 1.0: --model nanogpt (nanoGPT's GPT from the clone --nanogpt names: 4 layers,
4 heads, width 128, vocab 256, micro-batch 8 of 64 tokens, AdamW; the GPT bench's), transformer
(gradsync's built-in Transformer of the same size), or mlp (make bench's workload: the
512-1024-1024-1024-512 MLP, micro-batch 32, MSE, SGD with momentum). Three settings,
interleaved round by round under torch.profiler: deterministic off, torch's deterministic mode
as torch ships it (trainer.deterministic=true: the NaN fill of new tensors included), and
gradsync's default on CPU (the mode without the fill). Prints the biggest ops' self CPU
milliseconds per optimizer step (and the allocation and fill ops, where the modes differ), the
total, and the process CPU time per step.

    python bench/determinism.py --model nanogpt --nanogpt /path/to/nanoGPT --rounds 4
    python bench/determinism.py --model mlp --threads 2
"""

from __future__ import annotations

import argparse
import collections
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F
import torch.utils.deterministic
from torch.profiler import ProfilerActivity, profile

MODES = {"off": (False, True), "torch (true)": (True, True), "gradsync (null)": (True, False)}


def workload(name: str, nanogpt: Path | None) -> tuple[torch.nn.Module, Callable[[], None],
                                                      torch.optim.Optimizer]:
    """The model, one micro-batch's forward and backward (its loss / 4), the optimizer."""
    from gradsync.data.tokens import token_loss_per_sample
    from gradsync.models import MLP, Transformer

    torch.manual_seed(0)
    g = torch.Generator().manual_seed(1)
    if name == "mlp":
        net: torch.nn.Module = MLP(512, 512, [1024, 1024, 1024], "relu")
        x, y = torch.randn(32, 512, generator=g), torch.randn(32, 512, generator=g)
        return net, lambda: (F.mse_loss(net(x), y) / 4).backward(), torch.optim.SGD(
            net.parameters(), lr=0.01, momentum=0.9)
    if name == "nanogpt":
        if nanogpt is None:
            sys.exit("--model nanogpt needs --nanogpt <a clone of karpathy/nanoGPT>")
        sys.path.insert(0, str(nanogpt))
        from model import GPT, GPTConfig

        net = GPT(GPTConfig(block_size=64, vocab_size=256, n_layer=4, n_head=4, n_embd=128,
                            dropout=0.0, bias=True))
    else:
        net = Transformer(256, 64, d_model=128, n_layers=4, n_heads=4)
    x, y = (torch.randint(0, 256, (8, 64), generator=g) for _ in range(2))

    def micro() -> None:
        out = net(x, y)[0] if name == "nanogpt" else net(x)  # nanoGPT: (logits, loss)
        sums, counts = token_loss_per_sample(out, y)
        (sums.sum() / (4 * counts.sum())).backward()

    return net, micro, torch.optim.AdamW(net.parameters(), lr=1e-3)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", choices=("nanogpt", "transformer", "mlp"), default="nanogpt")
    ap.add_argument("--nanogpt", type=Path, default=None)
    ap.add_argument("--threads", type=int, default=1, help="intra-op threads (a rank's)")
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--steps", type=int, default=3, help="profiled steps per mode and round")
    ap.add_argument("--top", type=int, default=16)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    net, micro, opt = workload(a.model, a.nanogpt)

    def step() -> None:
        for _ in range(4):
            micro()
        torch.nn.utils.clip_grad_norm_(net.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)

    for _ in range(3):
        step()
    ms: dict[str, collections.Counter] = {m: collections.Counter() for m in MODES}
    calls: dict[str, collections.Counter] = {m: collections.Counter() for m in MODES}
    cpu: dict[str, list[float]] = {m: [] for m in MODES}
    for r in range(a.rounds):
        for mode in MODES if r % 2 == 0 else list(MODES)[::-1]:
            deterministic, fill = MODES[mode]
            torch.use_deterministic_algorithms(deterministic)
            torch.utils.deterministic.fill_uninitialized_memory = fill  # type: ignore
            step()
            c = time.process_time()
            with profile(activities=[ProfilerActivity.CPU]) as prof:
                for _ in range(a.steps):
                    step()
            cpu[mode].append((time.process_time() - c) / a.steps * 1e3)
            for e in prof.key_averages():
                ms[mode][e.key] += e.self_cpu_time_total / 1e3 / (a.steps * a.rounds)
                calls[mode][e.key] += e.count / (a.steps * a.rounds)
    names = set().union(*ms.values())
    differ = [n for n in names if len({round(calls[m][n], 3) for m in MODES}) > 1]
    biggest = sorted(names, key=lambda n: -max(ms[m][n] for m in MODES))[:a.top]
    shown = biggest + [n for n in sorted(differ) if n not in biggest]
    print(f"{a.model}, {a.threads} thread(s), {a.rounds} rounds x {a.steps} steps; per "
          "optimizer step: self CPU ms (calls); the profiler's times count a thread the machine "
          "took away as the op's, its call counts are exact\n")
    print("| op | " + " | ".join(MODES) + " |")
    print("|---|" + "---|" * len(MODES))
    for n in shown:
        mark = " (calls differ)" if n in differ else ""
        print(f"| {n[:58]}{mark} | "
              + " | ".join(f"{ms[m][n]:.2f} ({calls[m][n]:.0f})" for m in MODES) + " |")
    print("| all ops | " + " | ".join(f"{sum(ms[m].values()):.1f}" for m in MODES) + " |")
    print("| process CPU ms per step (median) | "
          + " | ".join(f"{statistics.median(cpu[m]):.1f}" for m in MODES) + " |")


if __name__ == "__main__":
    main()
