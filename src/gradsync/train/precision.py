"""Precision: the autocast context for forwards and the GradScaler wiring (fp16 only).

With accumulation the scaler scales every micro-batch loss, while unscale, step and update run
once per window, so the scale never changes inside a window."""

from __future__ import annotations

from contextlib import nullcontext

import torch

from gradsync.config.schema import PrecisionConfig
from gradsync.core.dtypes import DTYPES


class Precision:
    def __init__(self, name: str, device_type: str, init_scale: float = 65536.0,
                 growth_interval: int = 2000, growth_factor: float = 2.0,
                 backoff_factor: float = 0.5):
        self.name = name
        self.device_type = device_type
        self.dtype = DTYPES[name]
        self.scaler = (
            torch.amp.GradScaler(device_type, init_scale=init_scale,
                                 growth_factor=growth_factor, backoff_factor=backoff_factor,
                                 growth_interval=growth_interval)
            if name == "fp16" else None
        )

    def autocast(self):
        if self.dtype is None:
            return nullcontext()
        return torch.autocast(device_type=self.device_type, dtype=self.dtype)

    def backward(self, loss: torch.Tensor) -> None:
        (self.scaler.scale(loss) if self.scaler else loss).backward()

    def unscale(self, optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
        """Unscale the window's gradients in place and return the scaler's inf/nan flags (one
        per device; none without a scaler). step() and update() act on these very tensors, so a
        policy that all-reduces them in place makes every rank take the same decision."""
        if self.scaler is None:
            return []
        self.scaler.unscale_(optimizer)
        return list(self.scaler._found_inf_per_device(optimizer).values())

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


def build_precision(cfg: PrecisionConfig, device_type: str) -> Precision:
    return Precision(cfg.name, device_type, cfg.init_scale, cfg.growth_interval,
                     cfg.growth_factor, cfg.backoff_factor)
