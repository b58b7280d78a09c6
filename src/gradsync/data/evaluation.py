"""Held-out evaluation: every rank scores a disjoint shard of the eval set."""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from torch.utils.data import default_collate

from gradsync.data.contract import DataBundle


@torch.no_grad()
def evaluate(model: torch.nn.Module, data: DataBundle, rank: int, world_size: int,
             device: torch.device, batch_size: int = 512,
             call: Callable[[torch.nn.Module, torch.Tensor, torch.Tensor], torch.Tensor]
             | None = None) -> dict[str, float]:
    """Held-out metrics over the whole eval set, each rank scoring a disjoint shard: the loss
    per unit (sample or token), accuracy when the data has a ``correct`` metric, perplexity on
    token data. Every rank runs the same number of forwards (a sharded model's forward is
    collective): a rank whose shard ran out scores its first sample again and counts nothing.
    call(model, x, y): the logits as the loop gets them (models.ModelCall; None: model(x))."""
    was_training = model.training
    model.eval()
    ds = data.eval
    idx = range(rank, len(ds), world_size)  # type: ignore[arg-type]
    totals = torch.zeros(3, dtype=torch.float64, device=device)  # loss sum, correct, units
    largest = -(-len(ds) // world_size)  # type: ignore[arg-type]
    for start in range(0, largest, batch_size):
        part = idx[start:start + batch_size]
        x, y = (data.collate or default_collate)([ds[i] for i in part or idx[:1] or [0]])
        x, y = x.to(device), y.to(device)
        out = model(x) if call is None else call(model, x, y)
        if not part:
            continue
        sums, counts = data.loss(out, y)
        totals[0] += sums.double().sum()
        if data.correct is not None:
            totals[1] += data.correct(out, y)
        totals[2] += counts.sum()
    if world_size > 1:
        torch.distributed.all_reduce(totals)
    model.train(was_training)
    loss, correct, count = totals.tolist()
    metrics = {"loss": loss / count}
    if data.correct is not None:
        metrics["accuracy"] = correct / count
    if data.unit == "tokens":
        metrics["perplexity"] = math.exp(metrics["loss"])
    return metrics
