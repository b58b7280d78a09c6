"""scikit-learn's digits as 1x8x8 images (not flat vectors): a data contract example.

A data builder returns a gradsync.data.DataBundle: train and eval data sets, the per-sample loss
as a sum plus a count (here one unit per image), the sizes a model may ask for, and an optional
eval metric. @provides tells gradsync those sizes before any worker starts, so a model that asks
for a size this data lacks is refused up front."""

from __future__ import annotations

import numpy as np
import torch
from torch.utils.data import TensorDataset

from gradsync.data import (
    DataBundle,
    argmax_correct,
    cross_entropy_per_sample,
    digit_arrays,
    provides,
)


@provides("image_size", "num_classes")
def digit_images(test_fraction: float = 0.2, split_seed: int = 0) -> DataBundle:
    x, y = digit_arrays()
    images = torch.tensor(x / 16.0, dtype=torch.float32).view(-1, 1, 8, 8)
    labels = torch.tensor(y, dtype=torch.long)
    order = torch.from_numpy(np.random.default_rng(split_seed).permutation(len(y)))
    n_test = int(round(test_fraction * len(y)))
    test, train = order[:n_test], order[n_test:]
    return DataBundle(TensorDataset(images[train], labels[train]),
                      TensorDataset(images[test], labels[test]),
                      loss=cross_entropy_per_sample,
                      sizes={"image_size": 8, "num_classes": 10},
                      correct=argmax_correct)
