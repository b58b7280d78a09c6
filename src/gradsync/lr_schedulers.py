"""LR schedulers, stepped once per optimizer step (never per micro-batch)."""

from __future__ import annotations

import math
from typing import Any

import torch
from torch.optim.lr_scheduler import LambdaLR


class WarmupCosine:
    """Linear warm-up over warmup_steps (the first step already uses lr/warmup_steps), then a
    cosine decay to min_lr_ratio x lr at total_steps. A callable object, not a lambda, so
    LambdaLR's state_dict keeps it."""

    def __init__(self, warmup_steps: int, total_steps: int, min_lr_ratio: float):
        self.warmup_steps = warmup_steps
        self.total_steps = total_steps
        self.min_lr_ratio = min_lr_ratio

    def __call__(self, step: int) -> float:
        if step < self.warmup_steps:
            return (step + 1) / self.warmup_steps
        span = max(1, self.total_steps - self.warmup_steps)
        progress = min(1.0, (step - self.warmup_steps) / span)
        cosine = 0.5 * (1 + math.cos(math.pi * progress))
        return self.min_lr_ratio + (1 - self.min_lr_ratio) * cosine


class Constant:
    def __call__(self, step: int) -> float:
        return 1.0


def build_lr_scheduler(cfg: dict[str, Any], optimizer: torch.optim.Optimizer,
                       total_steps: int) -> LambdaLR:
    if cfg["name"] == "cosine":
        fn: Any = WarmupCosine(cfg["warmup_steps"], total_steps, cfg["min_lr_ratio"])
    elif cfg["name"] == "none":
        fn = Constant()
    else:
        raise ValueError(f"unknown lr_scheduler {cfg['name']!r}")
    return LambdaLR(optimizer, fn)
