"""The reference for `make bench-gpt` (bench/gpt.py): a hand-written nanoGPT-style loop, as
nanoGPT's train.py runs under torchrun on CPU ranks (gloo): nanoGPT's own GPT and its
configure_optimizers (AdamW, no decay below 2 dimensions), random windows of the training bytes
(get_batch), DDP with require_backward_grad_sync on the last of N micro-batches, loss / N,
nanoGPT's get_lr (linear warm-up, cosine to min_lr), clip_grad_norm_, zero_grad(set_to_none).
Run by torchrun with nanoGPT's model.py importable (PYTHONPATH); writes rank 0's step times and
final parameters where --out says.

    torchrun --standalone --nproc_per_node 2 bench/gpt_loop.py --out /tmp/ref --steps 40
"""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from gradsync.data import corpus


def get_lr(it: int, lr: float, warmup: int, decay_iters: int, min_lr: float) -> float:
    """nanoGPT's get_lr (train.py): linear warm-up, cosine to min_lr at decay_iters."""
    if it < warmup:
        return lr * (it + 1) / (warmup + 1)
    if it > decay_iters:
        return min_lr
    ratio = (it - warmup) / (decay_iters - warmup)
    return min_lr + 0.5 * (1.0 + math.cos(math.pi * ratio)) * (lr - min_lr)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--horizon", type=int, default=300, help="lr_decay_iters")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--micro", type=int, default=8)
    ap.add_argument("--accum", type=int, default=4, help="N per rank")
    ap.add_argument("--block", type=int, default=64)
    ap.add_argument("--max-bytes", type=int, default=2_000_000)
    a = ap.parse_args()
    from model import GPT, GPTConfig  # nanoGPT's model.py, unchanged

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    text = corpus.select(corpus.stdlib_root(), a.max_bytes, 0.1)  # data=stdlib_text's bytes
    data = torch.frombuffer(bytearray(b"".join(text.text[f] for f in text.train_files)),
                            dtype=torch.uint8).long()
    torch.manual_seed(a.seed)  # the same init on every rank (DDP broadcasts rank 0's anyway)
    model = GPT(GPTConfig(block_size=a.block, vocab_size=256, n_layer=4, n_head=4, n_embd=128,
                          dropout=0.0, bias=True))
    optimizer = model.configure_optimizers(0.1, 1e-3, (0.9, 0.99), "cpu")
    ddp = DDP(model)
    torch.manual_seed(a.seed * 1000 + 1 + rank)  # each rank its own batches

    def get_batch() -> tuple[torch.Tensor, torch.Tensor]:
        ix = torch.randint(len(data) - a.block, (a.micro,))
        x = torch.stack([data[i:i + a.block] for i in ix])
        y = torch.stack([data[i + 1:i + 1 + a.block] for i in ix])
        return x, y

    times = []
    x, y = get_batch()
    for it in range(a.steps):
        lr = get_lr(it, 1e-3, 30, a.horizon, 1e-4)
        for group in optimizer.param_groups:
            group["lr"] = lr
        for micro_step in range(a.accum):
            ddp.require_backward_grad_sync = micro_step == a.accum - 1
            _, loss = ddp(x, y)
            loss = loss / a.accum
            x, y = get_batch()
            loss.backward()
        torch.nn.utils.clip_grad_norm_(ddp.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        times.append(time.time())  # wall clock: bench/gpt.py matches it with CPU samples
    if rank == 0:
        a.out.mkdir(parents=True, exist_ok=True)
        (a.out / "times.json").write_text(json.dumps(times))
        torch.save(model.state_dict(), a.out / "model.pt")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
