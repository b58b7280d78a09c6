"""Teacher-student regression from the seed (``data=synthetic``): held-out MSE."""

from __future__ import annotations

import math
from typing import Any

import torch
from torch.utils.data import TensorDataset

from gradsync.components import CheckContext, checks, require, require_fits
from gradsync.data.contract import DataBundle, mse_per_sample, provides


def _check_synthetic(a: dict[str, Any], ctx: CheckContext) -> None:
    for key in ("num_samples", "eval_samples", "in_dim", "out_dim"):
        require(a[key] >= 1, f"data.{key}", "an integer >= 1", a[key])
    require(0.0 <= a["noise"] < math.inf, "data.noise", "a finite number >= 0", a["noise"])
    n, d, k = a["num_samples"] + a["eval_samples"], a["in_dim"], a["out_dim"]
    require_fits(4 * n * (d + 2 * 64 + 3 * k),  # x, its hidden layer, y and its noise
                 f"data: num_samples={a['num_samples']} + eval_samples={a['eval_samples']} "
                 f"samples of in_dim={d}, out_dim={k}")


@checks(_check_synthetic)
@provides("in_dim", "out_dim")
def synthetic(seed: int, num_samples: int = 2048, eval_samples: int = 512, in_dim: int = 32,
              out_dim: int = 8, noise: float = 0.05) -> DataBundle:
    """Teacher-student regression: a fixed random tanh network plus noise, all from the seed."""
    g = torch.Generator().manual_seed(seed)
    n, d, k = num_samples + eval_samples, in_dim, out_dim
    x = torch.randn(n, d, generator=g)
    w1 = torch.randn(d, 64, generator=g) / d**0.5
    w2 = torch.randn(64, k, generator=g) / 8.0
    y = torch.tanh(x @ w1) @ w2 + noise * torch.randn(n, k, generator=g)
    split = num_samples
    return DataBundle(TensorDataset(x[:split], y[:split]), TensorDataset(x[split:], y[split:]),
                      mse_per_sample, {"in_dim": d, "out_dim": k})
