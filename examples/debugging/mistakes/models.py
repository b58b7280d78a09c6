"""A model with a parameter its forward never uses (docs/debugging.md)."""

from __future__ import annotations

import torch
from torch import nn


class UnusedHead(nn.Module):
    """An MLP with a second output head, built but left out of the forward (a head kept for
    later, a branch switched off): its parameters never get a gradient."""

    def __init__(self, in_dim: int, out_dim: int, hidden: int = 32):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(in_dim, hidden), nn.Tanh(),
                                  nn.Linear(hidden, out_dim))
        self.head = nn.Linear(hidden, out_dim)  # never called

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(x)
