"""Models, built from plain config plus the data's input/output sizes."""

from __future__ import annotations

from typing import Any

from torch import nn

ACTIVATIONS = {"relu": nn.ReLU, "gelu": nn.GELU, "tanh": nn.Tanh}


class MLP(nn.Sequential):
    def __init__(self, in_dim: int, hidden_sizes: list[int], out_dim: int, activation: str,
                 dropout: float = 0.0):
        layers: list[nn.Module] = []
        for width in hidden_sizes:
            layers += [nn.Linear(in_dim, width), ACTIVATIONS[activation]()]
            if dropout:
                layers.append(nn.Dropout(dropout))  # draws from each rank's own stream
            in_dim = width
        layers.append(nn.Linear(in_dim, out_dim))
        super().__init__(*layers)


def build_model(cfg: dict[str, Any], in_dim: int, out_dim: int) -> nn.Module:
    if cfg["name"] == "mlp":
        return MLP(in_dim, list(cfg["hidden_sizes"]), out_dim, cfg["activation"],
                   cfg["dropout"])
    raise ValueError(f"unknown model {cfg['name']!r}")
