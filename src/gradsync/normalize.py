"""Loss normalisation: what each micro-batch's summed loss is divided by before its backward,
and, when that divisor could not be known in advance, the one gradient rescale before the
optimizer step (``loss.normalize``).

- ``samples``: the window's real sample count over all ranks, divided by the world size (DDP's
  average over ranks completes the mean), known in advance from the window plan
  (schedules.plan_epoch): the samples the DistributedSampler repeats to even out the ranks are
  neither in the loss (the loop drops them) nor in the count. No communication at all.
- ``tokens``: the global count of loss (non-padding) tokens in the window, over every
  micro-batch and rank (the sampler's repeats hold none). Deferred: backward runs on the summed
  token loss over a constant (so magnitudes stay near a per-token mean), each rank counts its
  tokens, one scalar all-reduce of the count is launched before the window's last forward (it
  overlaps with the syncing backward), and the gradients are rescaled once by world_size x
  constant / global_count after the scaler's unscale and before clipping. No prefetch of the
  window.
- ``micro_batch_mean``: every micro-batch's own mean, divided by the number of micro-batches,
  then averaged over ranks: the accumulation bug Transformers fixed in autumn 2024. Wrong on
  variable-length data; it exists only to measure that error.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Protocol

import torch
import torch.distributed as dist

from gradsync.schedules import Window

CHOICES = ("auto", "tokens", "samples", "micro_batch_mean")


class Normalizer(Protocol):
    name: str

    def divisor(self, window: Window, index: int, y: torch.Tensor) -> float | torch.Tensor:
        """What micro-batch ``index`` of ``window`` (targets ``y``) divides its summed loss by."""
        ...

    def window_loss(self, total: torch.Tensor) -> torch.Tensor:
        """This rank's share of the window's loss (the mean over ranks is the window loss),
        from the sum of the divided micro-batch losses."""
        ...

    def before_step(self, params: Iterable[torch.nn.Parameter]) -> None:
        """Called once per window on unscaled, synchronised gradients, before clipping."""
        ...


class BySamples:
    name = "samples"

    def __init__(self, world_size: int):
        self.world_size = world_size

    def divisor(self, window: Window, index: int, y: torch.Tensor) -> float | torch.Tensor:
        # ranks hold different numbers of real samples in an epoch's last window: DDP's mean
        # over ranks of sum_r(loss_r) / (global_real / W) is the mean over the real samples
        return window.global_real / self.world_size

    def window_loss(self, total: torch.Tensor) -> torch.Tensor:
        return total

    def before_step(self, params: Iterable[torch.nn.Parameter]) -> None:
        pass


class ByTokens:
    name = "tokens"

    def __init__(self, count: Callable[[torch.Tensor], torch.Tensor], world_size: int,
                 device: torch.device, tokens_per_sample: float):
        self.count, self.world_size, self.tokens_per_sample = count, world_size, tokens_per_sample
        self.device = device
        self.tokens = torch.zeros((), dtype=torch.int64, device=device)
        self.constant = 1.0
        self.work: dist.Work | None = None
        self.factor: torch.Tensor | None = None

    def divisor(self, window: Window, index: int, y: torch.Tensor) -> float | torch.Tensor:
        if index == 0:
            self.tokens = torch.zeros((), dtype=torch.int64, device=self.device)
            self.work, self.factor = None, None
            # Any constant equal on every rank gives the same step (local_samples is: see
            # plan_epoch); the expected local token count keeps the backward's magnitudes
            # (and the fp16 scaler) near those of a per-token mean.
            self.constant = window.local_samples * self.tokens_per_sample
        self.tokens += self.count(y)
        if index == window.size - 1 and self.world_size > 1:
            self.work = dist.all_reduce(self.tokens, async_op=True)
        return self.constant

    def _factor(self) -> torch.Tensor:
        if self.factor is None:
            if self.work is not None:
                self.work.wait()
                self.work = None
            # DDP already divided by world_size: undo it and the constant, divide by the count.
            scale = self.world_size * self.constant
            self.factor = (scale / self.tokens.clamp_min(1).double()).float()
        return self.factor

    def window_loss(self, total: torch.Tensor) -> torch.Tensor:
        return total * self._factor()

    def before_step(self, params: Iterable[torch.nn.Parameter]) -> None:
        grads = [p.grad for p in params if p.grad is not None]
        if grads:
            torch._foreach_mul_(grads, self._factor())


class ByMicroBatchMean:
    name = "micro_batch_mean"

    def __init__(self, count: Callable[[torch.Tensor], torch.Tensor | int]):
        self.count = count

    def divisor(self, window: Window, index: int, y: torch.Tensor) -> float | torch.Tensor:
        return max(self.count(y), 1) * window.size  # no real sample: a loss of 0, not 0 / 0

    def window_loss(self, total: torch.Tensor) -> torch.Tensor:
        return total

    def before_step(self, params: Iterable[torch.nn.Parameter]) -> None:
        pass


def resolve(name: str, task: str) -> str:
    """``auto``: tokens on token data, samples otherwise."""
    if name == "auto":
        return "tokens" if task == "lm" else "samples"
    return name


def build_normalizer(name: str, task: str, count: Callable, world_size: int,
                     device: torch.device, tokens_per_sample: float) -> Normalizer:
    """``count(y)``: the loss units (tokens, or samples) in a micro-batch's targets."""
    name = resolve(name, task)
    if name == "samples":
        return BySamples(world_size)
    if name == "tokens":
        return ByTokens(count, world_size, device, tokens_per_sample)
    if name == "micro_batch_mean":
        return ByMicroBatchMean(count)
    raise ValueError(f"unknown loss.normalize {name!r}")
