"""LR schedulers, stepped once per optimizer step (never per micro-batch). ``_target_``
components (conf/lr_scheduler/): a callable taking the optimizer (and ``total_steps``, the run's
optimizer steps, if it names it) plus its config's keyword arguments, returning a torch LR
scheduler."""

from __future__ import annotations

import math
from typing import Any

import torch
from torch.optim.lr_scheduler import LambdaLR

from gradsync.components import CheckContext, checks, require

WARMUPS = ("gradsync", "nanogpt", "hf")  # lr_scheduler.warmup: whose linear warm-up


class WarmupCosine:
    """Linear warm-up over warmup_steps, then a cosine decay to min_lr_ratio x lr at
    total_steps (after it: min_lr_ratio x lr). The warm-up's step s (0-based) takes
    ``warmup="gradsync"`` (the default): (s + 1) / warmup_steps of the LR (the full LR at the
    warm-up's last step); ``"nanogpt"``: (s + 1) / (warmup_steps + 1), nanoGPT's ``get_lr`` (the
    full LR first at step warmup_steps, where the cosine starts); ``"hf"``: s / warmup_steps,
    transformers' ``get_cosine_schedule_with_warmup`` (step 0 at LR 0). With nanogpt or hf the
    whole schedule is that library's, with total_steps as nanoGPT's ``lr_decay_iters``
    (transformers: ``num_training_steps``, whose cosine ends at 0: min_lr_ratio 0). A callable
    object, not a lambda, so LambdaLR's state_dict keeps it."""

    def __init__(self, warmup_steps: int, total_steps: int, min_lr_ratio: float,
                 warmup: str = "gradsync"):
        self.warmup_steps = warmup_steps
        self.total_steps = total_steps
        self.min_lr_ratio = min_lr_ratio
        self.warmup = warmup

    def __call__(self, step: int) -> float:
        if step < self.warmup_steps:
            if self.warmup == "hf":
                return step / self.warmup_steps
            if self.warmup == "nanogpt":
                return (step + 1) / (self.warmup_steps + 1)
            return (step + 1) / self.warmup_steps
        span = max(1, self.total_steps - self.warmup_steps)
        progress = min(1.0, (step - self.warmup_steps) / span)
        cosine = 0.5 * (1 + math.cos(math.pi * progress))
        return self.min_lr_ratio + (1 - self.min_lr_ratio) * cosine


class Constant:
    def __call__(self, step: int) -> float:
        return 1.0


def _check_cosine(a: dict[str, Any], ctx: CheckContext) -> None:
    require(a["warmup_steps"] >= 0, "lr_scheduler.warmup_steps", "an integer >= 0",
            a["warmup_steps"])
    require(0.0 <= a["min_lr_ratio"] <= 1.0, "lr_scheduler.min_lr_ratio", "a number in [0, 1]",
            a["min_lr_ratio"])
    require(a["warmup"] in WARMUPS, "lr_scheduler.warmup", f"one of {', '.join(WARMUPS)}",
            a["warmup"])


@checks(_check_cosine)
def warmup_cosine(optimizer: torch.optim.Optimizer, total_steps: int, warmup_steps: int = 5,
                  min_lr_ratio: float = 0.0, warmup: str = "gradsync") -> LambdaLR:
    """Linear warm-up (gradsync's, nanoGPT's or Hugging Face's: WarmupCosine), then cosine
    decay to min_lr_ratio x lr at the run's last step."""
    return LambdaLR(optimizer, WarmupCosine(warmup_steps, total_steps, min_lr_ratio, warmup))


def constant(optimizer: torch.optim.Optimizer) -> LambdaLR:
    """The optimizer's own learning rate throughout."""
    return LambdaLR(optimizer, Constant())
