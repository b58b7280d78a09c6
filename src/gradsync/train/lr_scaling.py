"""Learning-rate scaling with the global batch (``lr_scaling``): the LR a step uses is the LR
scheduler's times a factor of the step's global batch, and the scheduler advances on a clock.

- ``linear``: factor S = global batch / reference batch (Goyal et al. 2017); ``sqrt``: sqrt(S).
  The global batch is the window's real samples over all ranks, so the factor changes whenever
  the schedule changes N (epochwise, global_batch against its reference, adaptive) and at an
  epoch's short last window.
- ``adascale`` (Johnson et al. 2020, "AdaScale SGD"): the gain r = (sigma^2 + |G|^2) /
  (sigma^2 / S + |G|^2), with sigma^2 = tr(Sigma) / b0 the variance of the gradient at the
  reference batch b0, from the same moving averages as the noise scale (train/noise_scale.py,
  this window included): 1 <= r <= S (S <= r <= 1 below the reference). The LR schedule then
  advances by r per step instead of 1 ("scale-invariant iterations": a step at gain r counts as
  r steps at the reference batch), its horizon counted in reference batches.

The clock the LR scheduler advances on: one tick per step for fixed schedules (the schedule as
without scaling); for schedule=adaptive, whose number of steps is not known in advance, S per
step (the samples seen, in reference batches: the horizon is the run's samples / reference
batch); for adascale, r per step. A scheduler of any kind is stepped once per whole tick
(LambdaLR, cosine, a user's), so it needs no notion of fractional steps.

With lr_scaling=none and a fixed schedule the worker builds no ScaledLR: the run is the same,
bit for bit, as before this existed.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

import torch

from gradsync.train.lr_schedulers import advance

if TYPE_CHECKING:
    from gradsync.config.schema import LRScalingConfig
    from gradsync.train.noise_scale import NoiseScale
    from gradsync.train.windows import Window


def adascale_gain(scale: float, b_simple: float, batch_units: float) -> float:
    """AdaScale's r for a global batch `scale` times the reference, B_simple and the window's
    units (samples or tokens: B_simple's unit): with phi = B_simple / batch_units,
    r = (phi S + 1) / (phi + 1). B_simple unknown (nan): 1; infinite: S."""
    if math.isnan(b_simple) or not batch_units > 0:
        return 1.0
    if math.isinf(b_simple):
        return scale if b_simple > 0 else 1.0
    phi = max(0.0, b_simple / batch_units)
    return (phi * scale + 1) / (phi + 1)


def clock(lr_scaling: str, schedule: str) -> str:
    """What the LR scheduler's ticks count: steps, samples (in reference batches) or gain."""
    if lr_scaling == "adascale":
        return "gain"
    return "samples" if schedule == "adaptive" else "steps"


def needed(lr_scaling: str, schedule: str) -> bool:
    """Whether the run needs a ScaledLR (else the LR scheduler steps once per step, as ever)."""
    return lr_scaling != "none" or clock(lr_scaling, schedule) != "steps"


def horizon(max_epochs: int, max_steps: int, dataset_size: int, reference: int,
            largest_batch: int) -> int:
    """The LR scheduler's total_steps on the samples and gain clocks: the run's samples in
    reference batches (max_steps: at most the samples its steps can hold, largest_batch each)."""
    total = math.ceil(max_epochs * dataset_size / reference)
    if max_steps >= 0:
        total = min(total, math.ceil(max_steps * largest_batch / reference))
    return max(total, 1)


class ScaledLR:
    """The LR scheduler as the loop sees it when the LR is scaled: ``before_step(window,
    noise)`` sets the LR the step uses (the scheduler's, times the factor); ``step()`` (after a
    step taken; optimizer_step calls it) puts the scheduler's LR back and advances the
    scheduler by the clock. A skipped fp16 step advances nothing. Its state (the scheduler's,
    the clock) is saved in checkpoints."""

    def __init__(self, scheduler: torch.optim.lr_scheduler.LRScheduler,
                 optimizer: torch.optim.Optimizer, mode: str, reference: int, tick: str):
        self.scheduler, self.optimizer = scheduler, optimizer
        self.mode, self.reference, self.tick = mode, reference, tick
        self.clock = 0.0  # reference steps elapsed on the clock
        self.ticks = 0  # the scheduler's steps taken: floor(clock)
        self.factor = 1.0  # of the newest step
        self.advance = 1.0
        self.base: list[float] | None = None  # the scheduler's LRs while a factor is applied

    def before_step(self, window: Window, noise: NoiseScale | None) -> float:
        """Set the LR of this window's step; returns the factor. adascale: collective (the
        noise scale's estimates with this window folded in)."""
        s = window.global_real / self.reference
        if self.mode == "linear":
            self.factor = s
        elif self.mode == "sqrt":
            self.factor = math.sqrt(s)
        elif self.mode == "adascale":
            assert noise is not None, "adascale measures the noise scale"
            b_simple = noise.current().get("noise_scale", math.nan)
            self.factor = adascale_gain(s, b_simple, noise.last_batch)
        else:
            self.factor = 1.0
        self.advance = {"gain": self.factor, "samples": s}.get(self.tick, 1.0)
        groups = self.optimizer.param_groups
        if self.base is None:
            self.base = [g["lr"] for g in groups]
        for g, lr in zip(groups, self.base, strict=True):
            g["lr"] = lr * self.factor
        return self.factor

    def step(self) -> None:
        if self.base is not None:
            for g, lr in zip(self.optimizer.param_groups, self.base, strict=True):
                g["lr"] = lr
            self.base = None
        self.clock += self.advance
        while self.ticks < math.floor(self.clock):
            self.scheduler.step()
            self.ticks += 1

    def state_dict(self) -> dict[str, Any]:
        return {"scheduler": self.scheduler.state_dict(), "clock": self.clock,
                "ticks": self.ticks, "base": self.base}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.scheduler.load_state_dict(state["scheduler"])
        self.clock, self.ticks, self.base = state["clock"], state["ticks"], state["base"]

    def replan(self, state: dict[str, Any]) -> None:
        """Continue from a checkpoint's clock on this run's horizon: the freshly built
        scheduler advanced by the checkpoint's ticks (train/lr_schedulers.py ``replan``)."""
        self.clock, self.ticks, self.base = state["clock"], state["ticks"], state["base"]
        advance(self.scheduler, self.ticks)


def reference_batch(cfg: LRScalingConfig, world_size: int, micro_batch_size: int,
                    first_window_size: int) -> int:
    """The global batch the optimizer's LR is set for (0: the first window's)."""
    return cfg.reference_batch or world_size * micro_batch_size * first_window_size
