"""Precision: the autocast context for forwards, the GradScaler wiring (fp16 only) and fp16's
overflow handling across ranks.

With accumulation the scaler scales every micro-batch loss, while unscale, step and update run
once per window, so the scale never changes inside a window. With a scaler, two agreements
over ranks may run (``OverflowConsensus``): overflow consensus (the policy's wire asks for it:
amp_aware's ``sync.overflow_consensus``) ends a window doomed by an overflow on any rank early;
and the scaler's inf/nan flags are made the same on every rank after unscaling, for consensus
and whenever the policy's averager keeps parameter groups of its own (their gradients are each
rank's own, so the flags could differ)."""

from __future__ import annotations

from contextlib import nullcontext
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.utils import get_total_norm

from gradsync.config.schema import PrecisionConfig
from gradsync.core.dtypes import DTYPES
from gradsync.sync.policy import last_micro_batch

if TYPE_CHECKING:
    from gradsync.sync.policy import SyncPolicy


@dataclass
class OverflowCounts:
    """Per rank, in summary.json and checkpoints (their "overflow" counters)."""

    aborted_windows: int = 0  # windows whose remaining compute was skipped: doomed by an overflow
    allreduce_skipped: int = 0  # full-gradient all-reduces (syncing backwards) those skipped
    flag_allreduces: int = 0  # one-element all-reduces: overflow consensus, found_inf agreement


class OverflowConsensus:
    """fp16 with a GradScaler: after every no_sync backward each rank checks its accumulated
    gradients for inf/nan and one MAX all-reduce of that flag tells every rank whether any rank
    has one (``window_doomed``; only when `doomed_windows`). Such a window cannot step (the
    scaler would skip it), so the rest of its compute and its full-gradient all-reduce are
    skipped. At the window's end the scaler's own inf/nan flags are MAX all-reduced too
    (``agree``), so every rank skips (and backs off the scale) or steps alike, aborted windows
    included, where only some ranks hold the overflow locally."""

    def __init__(self, overflow: OverflowCounts, doomed_windows: bool):
        self.overflow, self.doomed_windows = overflow, doomed_windows

    def window_doomed(self, model: nn.Module, micro_index: int, window_size: int) -> bool:
        if not self.doomed_windows or last_micro_batch(micro_index, window_size):
            return False  # the last backward synced: agree() settles that window
        grads = [p.grad for p in model.parameters() if p.grad is not None]
        flag = (~torch.isfinite(get_total_norm(grads, norm_type=float("inf")))).float()
        self._max_over_ranks(flag)
        if not flag.item():
            return False
        self.overflow.aborted_windows += 1
        self.overflow.allreduce_skipped += 1  # the window's last, synchronising backward
        return True

    def agree(self, found_inf: list[torch.Tensor]) -> None:
        for flag in found_inf:
            self._max_over_ranks(flag)

    def _max_over_ranks(self, flag: torch.Tensor) -> None:
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        self.overflow.flag_allreduces += 1


def never_doomed(model: nn.Module, micro_index: int, window_size: int) -> bool:
    """A window without overflow consensus always runs to its end."""
    return False


class Precision:
    def __init__(self, name: str, device_type: str, init_scale: float = 65536.0,
                 growth_interval: int = 2000, growth_factor: float = 2.0,
                 backoff_factor: float = 0.5, consensus: bool = False,
                 agreement: bool = False):
        """consensus: overflow consensus (doomed windows end early, the flags agreed);
        agreement: the scaler's flags agreed after unscaling (implied by consensus). Both only
        with a scaler (fp16)."""
        self.name = name
        self.device_type = device_type
        self.dtype = DTYPES[name]
        self.scaler = (
            torch.amp.GradScaler(device_type, init_scale=init_scale,
                                 growth_factor=growth_factor, backoff_factor=backoff_factor,
                                 growth_interval=growth_interval)
            if name == "fp16" else None
        )
        self.overflow = OverflowCounts()
        self.consensus = (OverflowConsensus(self.overflow, consensus)
                          if self.scaler is not None and (consensus or agreement) else None)
        # asked after each micro-batch's backward (train/loop.py run_window): True (on every
        # rank alike) when the window can no longer step, so its remaining micro-batches are
        # not computed
        self.window_doomed = (self.consensus.window_doomed
                              if self.consensus is not None and consensus else never_doomed)

    def autocast(self):
        if self.dtype is None:
            return nullcontext()
        return torch.autocast(device_type=self.device_type, dtype=self.dtype)

    def backward(self, loss: torch.Tensor) -> None:
        (self.scaler.scale(loss) if self.scaler else loss).backward()

    def unscale(self, optimizer: torch.optim.Optimizer) -> None:
        """Unscale the window's gradients in place; with an agreement, the scaler's inf/nan
        flags (one per device) MAX all-reduced in place: step() and update() act on these very
        tensors, so every rank takes the same decision. Without one, every rank already holds
        the same gradients after a full all-reduce, so the scaler finds the same inf/nan."""
        if self.scaler is None:
            return
        self.scaler.unscale_(optimizer)
        if self.consensus is not None:
            self.consensus.agree(list(self.scaler._found_inf_per_device(optimizer).values()))

    def step(self, optimizer: torch.optim.Optimizer) -> bool:
        """Step and update the scale once per window, after unscale(); False when the step was
        skipped because the gradients held inf/nan (the scale then backs off)."""
        if self.scaler is None:
            optimizer.step()
            return True
        found_inf = self.scaler._found_inf_per_device(optimizer).values()
        skipped = any(bool(flag.item()) for flag in found_inf)
        self.scaler.step(optimizer)
        self.scaler.update()
        return not skipped

    def scale_tensor(self) -> torch.Tensor | None:
        """The scale this window's backwards used, as a tensor on the device (no host sync; a
        copy, since update() changes the scaler's own in place); None without a scaler."""
        scale = self.scaler._get_scale_async() if self.scaler else None
        return None if scale is None else scale.detach().clone()

    @property
    def scale(self) -> float:
        """The current loss scale (1.0 without a scaler: the loss is not scaled)."""
        return self.scaler.get_scale() if self.scaler else 1.0


def overflow_handling(policy: SyncPolicy | None) -> dict[str, bool]:
    """A Precision's consensus and agreement for the run's policy: consensus when the policy's
    wire asks for it, the flags' agreement when its averager keeps parameter groups of its own
    (not the whole model: local SGD's ranks each skip their own steps)."""
    wire, averager = (policy.wire, policy.averager) if policy is not None else (None, None)
    return {"consensus": wire is not None and wire.overflow_consensus,
            "agreement": averager is not None and not averager.whole_model}


def build_precision(cfg: PrecisionConfig, device_type: str,
                    policy: SyncPolicy | None = None) -> Precision:
    """The run's precision; with the run's policy, its overflow handling."""
    return Precision(cfg.name, device_type, cfg.init_scale, cfg.growth_interval,
                     cfg.growth_factor, cfg.backoff_factor, **overflow_handling(policy))
