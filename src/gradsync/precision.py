"""Precision: the autocast context for forwards and the GradScaler wiring (fp16 only).

With accumulation the scaler scales every micro-batch loss, while unscale, step and update run
once per window, so the scale never changes inside a window."""

from __future__ import annotations

from contextlib import nullcontext

import torch

DTYPES = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}


class Precision:
    def __init__(self, name: str, device_type: str, init_scale: float = 65536.0,
                 growth_interval: int = 2000):
        self.name = name
        self.device_type = device_type
        self.dtype = DTYPES[name]
        self.scaler = (
            torch.amp.GradScaler(device_type, init_scale=init_scale,
                                 growth_interval=growth_interval)
            if name == "fp16" else None
        )

    def autocast(self):
        if self.dtype is None:
            return nullcontext()
        return torch.autocast(device_type=self.device_type, dtype=self.dtype)

    def backward(self, loss: torch.Tensor) -> None:
        (self.scaler.scale(loss) if self.scaler else loss).backward()

    def unscale(self, optimizer: torch.optim.Optimizer) -> None:
        if self.scaler:
            self.scaler.unscale_(optimizer)

    def step(self, optimizer: torch.optim.Optimizer) -> bool:
        """Step and update the scale; False when the scaler skipped the step (inf/nan)."""
        if self.scaler is None:
            optimizer.step()
            return True
        before = self.scaler.get_scale()
        self.scaler.step(optimizer)
        self.scaler.update()
        return self.scaler.get_scale() >= before

    @property
    def scale(self) -> float:
        return self.scaler.get_scale() if self.scaler else 1.0
