"""LR schedulers, stepped once per optimizer step (never per micro-batch). ``_target_``
components (conf/lr_scheduler/): a callable taking the optimizer (and ``total_steps``, the run's
optimizer steps, if it names it) plus its config's keyword arguments, returning a torch LR
scheduler.

A resumed run whose length changed (trainer.max_epochs / max_steps, or the world size of a
resharded checkpoint) has another horizon than the one its checkpoint's schedule was built for:
the schedule is then re-planned (``replan``): the scheduler built for this run's horizon is
stepped to where the checkpoint stood, so every step from there on uses the LR a fresh run of
this length uses at that step (docs/reproducibility.md). Kept as it was, a cosine that had
decayed to 0 would train every added step at LR 0."""

from __future__ import annotations

import math
import warnings
from collections.abc import Sequence
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


def advance(scheduler: Any, steps: int) -> None:
    """Step a scheduler `steps` times without optimizer steps between (torch warns about that
    order, which is meant for training, not for replaying a schedule)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=r"Detected call of `lr_scheduler\.step\(\)`")
        for _ in range(steps):
            scheduler.step()


def replan(scheduler: Any, saved: dict[str, Any], optimizer: torch.optim.Optimizer,
           fresh_lrs: Sequence[float], steps: int) -> None:
    """Continue a checkpointed schedule on this run's horizon. `scheduler` was built for it
    (fresh, not loaded); `saved` is the checkpoint's scheduler state (where it stood: a torch
    scheduler's ``last_epoch``, else `steps`, the optimizer steps taken, one scheduler step
    each; a ScaledLR replays its own clock); `fresh_lrs` the optimizer's
    LRs as the fresh scheduler left them, put back before the replay (loading the optimizer's
    state set the checkpoint's), so that a scheduler computing each LR from the previous one
    replays the fresh run's LRs too."""
    for group, lr in zip(optimizer.param_groups, fresh_lrs, strict=True):
        group["lr"] = lr
    if hasattr(scheduler, "replan"):  # lr_scaling.ScaledLR: its clock, its scheduler's ticks
        scheduler.replan(saved)
    else:
        advance(scheduler, int(saved.get("last_epoch", steps)))
