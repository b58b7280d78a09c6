"""Loss normalisation: what each micro-batch's summed loss is divided by before its backward,
and, when that divisor could not be known in advance, the one gradient rescale before the
optimizer step (``loss.normalize``).

- ``samples``: the window's real sample count over all ranks, divided by the world size (DDP's
  average over ranks completes the mean), known in advance from the window plan
  (windows.cut_window): the samples the DistributedSampler repeats to even out the ranks are
  neither in the loss (the loop drops them) nor in the count. No communication at all. On
  token data each sequence's own mean token loss counts as its sample loss.
- ``tokens``: the global count of loss (non-padding) tokens in the window, over every
  micro-batch and rank (the sampler's repeats hold none). Deferred: backward runs on the summed
  token loss over a constant (so magnitudes stay near a per-token mean), each rank counts its
  tokens, one scalar all-reduce of the count is launched after the window's last forward (it
  overlaps with the syncing backward), and the gradients are rescaled once by world_size x
  constant / global_count after the scaler's unscale and before clipping. No prefetch.
- ``micro_batch_mean``: every micro-batch's own mean, divided by the number of micro-batches,
  then averaged over ranks: the accumulation bug Transformers fixed in autumn 2024. Wrong on
  variable-length data; it exists only to measure that error.

A rank's own step (``local``: local SGD or DiLoCo with H > 1, after the warm-up: no gradient is
all-reduced, and other local steps follow before the replicas are averaged) divides by this
rank's own count instead (its real samples in the window; its loss tokens), so each local step
applies the gradient of the rank's own mean loss, whatever its share of an uneven last window;
a rank holding no real sample in the window does not step at all (no momentum, no weight decay:
what a process without data would do). The logged loss stays the window's mean over every real
sample (or token) of every rank. With H = 1 (and for every step all ranks share) the divisor
stays the global one: the mean of the ranks' steps is then exactly the step of the global mean
(docs/local-sgd.md, docs/exactness.md).

Each normaliser receives a micro-batch's per-sample loss sums and unit counts (the data
contract, data.DataBundle.loss) and returns the scalar its backward runs on.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any, Protocol

import torch
import torch.distributed as dist

from gradsync.sync.policy import last_micro_batch
from gradsync.train.windows import Window


class Normalizer(Protocol):
    name: str

    def micro_loss(self, window: Window, index: int, sums: torch.Tensor,
                   counts: torch.Tensor) -> torch.Tensor:
        """The scalar micro-batch ``index`` of ``window`` runs its backward on, from its
        per-sample loss sums and unit counts."""
        ...

    def window_loss(self, total: torch.Tensor) -> torch.Tensor:
        """This rank's share of the window's loss (the mean over ranks is the window loss),
        from the sum of the micro-batch losses."""
        ...

    def before_step(self, params: Iterable[torch.nn.Parameter]) -> None:
        """Called once per window on unscaled, synchronised gradients, before clipping."""
        ...


def shared_steps() -> bool:
    """The default answer to "is this window's step this rank's own": no (every rank's step is
    part of one step of the global mean)."""
    return False


def no_step(params: Iterable[torch.nn.Parameter]) -> None:
    """A rank's own step on a window without a real sample of its own: gradients set to None,
    so the optimizer leaves these parameters (and their state) alone."""
    for q in params:
        q.grad = None


class BySamples:
    name = "samples"

    def __init__(self, world_size: int, per_unit: bool = False,
                 local: Callable[[], bool] = shared_steps):
        self.world_size = world_size
        self.per_unit = per_unit  # token data: a sequence's loss is its mean token loss
        self.local = local  # asked at each window's first micro-batch: this rank's own step?
        self.own = False
        self.real = 0  # this rank's real samples in the current window
        self.to_global = 1.0  # own steps: from this rank's divisor to the global one

    def micro_loss(self, window: Window, index: int, sums: torch.Tensor,
                   counts: torch.Tensor) -> torch.Tensor:
        if index == 0:
            self.own, self.real = self.local(), window.real
            shared = window.global_real / self.world_size
            self.to_global = max(window.real, 1) / shared if self.own else 1.0
        if self.per_unit:
            sums = sums / counts.clamp_min(1)
        return sums.sum() / self.divisor(window)

    def divisor(self, window: Window) -> float:
        """What each micro-batch's summed loss is divided by (the noise scale rescales by it):
        ranks hold different numbers of real samples in an epoch's last window, and DDP's mean
        over ranks of sum_r(loss_r) / (global_real / W) is the mean over the real samples; a
        rank's own step (local SGD after warm-up, H > 1) divides by its own real samples."""
        return max(window.real, 1) if self.own else window.global_real / self.world_size

    def window_loss(self, total: torch.Tensor) -> torch.Tensor:
        return total * self.to_global if self.own else total

    def before_step(self, params: Iterable[torch.nn.Parameter]) -> None:
        if self.own and self.real == 0:
            no_step(params)


class ByTokens:
    """uniform: every sequence holds exactly tokens_per_sample loss tokens (windows of packed
    text: DataBundle.uniform_length), so a window's token count is its real samples times that,
    known without counting: no all-reduce, and a full window's factor is exactly 1 (no
    rescale)."""

    name = "tokens"

    def __init__(self, world_size: int, device: torch.device, tokens_per_sample: float,
                 local: Callable[[], bool] = shared_steps, uniform: bool = False):
        self.world_size, self.tokens_per_sample = world_size, tokens_per_sample
        self.uniform = uniform
        self.device = device
        self.local = local  # asked at each window's first micro-batch: this rank's own step?
        self.own = False
        self.real = 0
        self.tokens = torch.zeros((), dtype=torch.int64, device=device)  # this rank's
        self.total = self.tokens  # over every rank (all-reduced)
        self.constant = 1.0
        self.work: dist.Work | None = None
        self.factor: torch.Tensor | None = None
        self.known = (1.0, 1.0)  # uniform: the factors to every rank's and this rank's count

    def micro_loss(self, window: Window, index: int, sums: torch.Tensor,
                   counts: torch.Tensor) -> torch.Tensor:
        if index == 0:
            self.tokens = torch.zeros((), dtype=torch.int64, device=self.device)
            self.work, self.factor = None, None
            self.own, self.real = self.local(), window.real
            # Any constant equal on every rank gives the same step (local_samples is: see
            # cut_window); the expected local token count keeps the backward's magnitudes
            # (and the fp16 scaler) near those of a per-token mean.
            self.constant = window.local_samples * self.tokens_per_sample
            if self.uniform:  # the counts are known: every rank's, this rank's own
                tokens = self.tokens_per_sample
                self.known = (self.world_size * self.constant
                              / max(window.global_real * tokens, 1.0),
                              self.constant / max(self.real * tokens, 1.0))
                self.factor = torch.tensor(self.known[0], device=self.device)
        if self.uniform:
            return sums.sum() / self.constant
        self.tokens += counts.sum()
        if last_micro_batch(index, window.size):
            self.total = self.tokens.clone() if self.own else self.tokens
            if self.world_size > 1:
                # launched before the last backward, which it overlaps
                self.work = dist.all_reduce(self.total, async_op=True)
        return sums.sum() / self.constant

    def divisor(self, window: Window) -> float:
        """What each micro-batch's summed loss of the current window is divided by."""
        return self.constant

    def _factor(self) -> torch.Tensor:
        """From the summed losses to the window's mean over every rank's tokens."""
        if self.factor is None:
            if self.work is not None:
                self.work.wait()
                self.work = None
            # DDP already divided by world_size: undo it and the constant, divide by the count.
            scale = self.world_size * self.constant
            self.factor = (scale / self.total.clamp_min(1).double()).float()
        return self.factor

    def window_loss(self, total: torch.Tensor) -> torch.Tensor:
        return total * self._factor()

    def before_step(self, params: Iterable[torch.nn.Parameter]) -> None:
        if self.own and self.real == 0:
            no_step(params)
            return
        grads = [p.grad for p in params if p.grad is not None]
        if not grads:
            return
        if self.uniform:  # x 1.0 (a full window of packed text) would change no bit
            factor = self.known[1] if self.own else self.known[0]
            if factor != 1.0:
                torch._foreach_mul_(grads, torch.tensor(factor, device=self.device))
            return
        if self.own:  # no all-reduce made these: this rank's own mean over its own tokens
            torch._foreach_mul_(grads, (self.constant / self.tokens.clamp_min(1).double())
                                .float())
        else:
            torch._foreach_mul_(grads, self._factor())


class ByMicroBatchMean:
    name = "micro_batch_mean"

    def micro_loss(self, window: Window, index: int, sums: torch.Tensor,
                   counts: torch.Tensor) -> torch.Tensor:
        # a micro-batch of repeats only: a loss of 0, not 0 / 0
        return sums.sum() / (counts.sum().clamp_min(1) * window.size)

    def window_loss(self, total: torch.Tensor) -> torch.Tensor:
        return total

    def before_step(self, params: Iterable[torch.nn.Parameter]) -> None:
        pass


def resolve(name: str, unit: str) -> str:
    """``auto``: the data's own unit (tokens on token data, samples otherwise)."""
    return unit if name == "auto" else name


def build_normalizer(name: str, unit: str, world_size: int, device: torch.device,
                     tokens_per_sample: float, local: Callable[[], bool] = shared_steps,
                     uniform: bool = False) -> Normalizer:
    """unit: what the data's loss counts (samples or tokens); local: asked once per window,
    whether its step is this rank's own (the policy's averager's Averager.local_step);
    uniform: every sequence holds exactly tokens_per_sample loss tokens (ByTokens)."""
    name = resolve(name, unit)
    if name == "samples":
        return BySamples(world_size, per_unit=unit == "tokens", local=local)
    if name == "tokens":
        return ByTokens(world_size, device, tokens_per_sample, local, uniform)
    if name == "micro_batch_mean":
        return ByMicroBatchMean()
    raise ValueError(f"unknown loss.normalize {name!r}")


def normalizer(policy: Any = None, unit: str = "samples", tokens_per_sample: float = 1.0,
               uniform: bool = False, by: str = "auto",
               device: torch.device | None = None) -> Normalizer:
    """What each micro-batch's loss is divided by, in a process group already initialised
    (torchrun's), for one's own loop (docs/own-loop.md): `by` (auto: the data's `unit`,
    samples or tokens) over every rank, a rank's own count on the local steps of `policy`'s
    averager (local SGD). uniform: every sequence holds exactly tokens_per_sample loss tokens
    (the data's ``uniform_length``: windows of packed text), so a window's token count is known
    without the all-reduce that counts it (the same bits either way)."""
    averager = getattr(policy, "averager", None)
    up = dist.is_available() and dist.is_initialized()
    return build_normalizer(by, unit, dist.get_world_size() if up else 1,
                            device or torch.device("cpu"), tokens_per_sample,
                            averager.local_step if averager is not None else shared_steps,
                            uniform)
