"""scikit-learn's bundled 8x8 digits (``data=digits``, the default): no download, held-out
accuracy."""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.utils.data import TensorDataset

from gradsync.components import CheckContext, checks, require
from gradsync.data.contract import DataBundle, argmax_correct, cross_entropy_per_sample, provides


def _check_digits(a: dict[str, Any], ctx: CheckContext) -> None:
    require(0.0 < a["test_fraction"] < 1.0, "data.test_fraction", "a number in (0, 1)",
            a["test_fraction"])
    require(a["split_seed"] >= 0, "data.split_seed", "an integer >= 0 (NumPy's seeds)",
            a["split_seed"])


@checks(_check_digits)
@provides("in_dim", "out_dim")
def digits(test_fraction: float = 0.2, split_seed: int = 0) -> DataBundle:
    """scikit-learn's bundled digits; the held-out split depends on split_seed, not the run
    seed, so runs with different seeds are scored on the same images."""
    x, y = digit_arrays()
    order = np.random.default_rng(split_seed).permutation(len(y))
    n_test = int(round(test_fraction * len(y)))
    xt = torch.tensor(x / 16.0, dtype=torch.float32)
    yt = torch.tensor(y, dtype=torch.long)
    test, train = torch.from_numpy(order[:n_test]), torch.from_numpy(order[n_test:])
    return DataBundle(TensorDataset(xt[train], yt[train]), TensorDataset(xt[test], yt[test]),
                      cross_entropy_per_sample, {"in_dim": 64, "out_dim": 10},
                      correct=argmax_correct)


def digit_arrays() -> tuple[np.ndarray, np.ndarray]:
    """scikit-learn's 1797 8x8 digit images (pixels 0..16, flattened to 64) and labels, read
    from the file it bundles as its load_digits does, without importing scikit-learn (a second
    or more at every worker's start)."""
    table = _digit_table()
    return table[:, :-1].copy(), table[:, -1].astype(int)


@functools.cache
def _digit_table() -> np.ndarray:
    """The file read once per process (never modified: each build copies its arrays)."""
    import gzip
    import importlib.util

    spec = importlib.util.find_spec("sklearn")
    if spec is None or not spec.submodule_search_locations:
        raise ModuleNotFoundError("data=digits needs scikit-learn, which ships the images")
    path = Path(next(iter(spec.submodule_search_locations))) / "datasets" / "data" / \
        "digits.csv.gz"
    with gzip.open(path) as f:
        return np.loadtxt(f, delimiter=",")
