"""Buffers (BatchNorm's running statistics, say) made the same on every rank before each
evaluation and each checkpoint: the model that is evaluated is the model that is saved.

torch's DDP broadcasts rank 0's buffers at the start of every forward that follows a
synchronising one, and each rank then updates its own from its micro-batch, so after the last
forward the ranks' buffers differ; FSDP2 never syncs them. Checkpoints keep rank 0's (DDP
engines: rank 0 saves the model; FSDP: DCP saves a replicated tensor once, from rank 0). So the
choice here is **rank 0's, broadcast** (not the mean): what DDP's next forward would do anyway,
what every checkpoint holds, and on the DDP engines it changes no bit of training. A policy
whose averager trains the replicas apart (local SGD, DiLoCo: ``whole_model``) keeps each rank's
own, and buffers an averager keeps (``wire.bind``) are left to it.

``engine.sync_batchnorm=true`` (the DDP engines) goes further: every BatchNorm layer becomes
``torch.nn.SyncBatchNorm``, whose training forward normalises with the statistics of every
rank's micro-batch (an all-gather per layer and forward, no_sync micro-batches included), so
the running statistics are the same on every rank after every forward. torch computes them on
CUDA only (``batch_norm_stats`` has no CPU kernel): CPU ranks are refused before the start.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

BROADCAST_BYTES = 250 * 2**20  # DDP's broadcast_bucket_size: one broadcast per 250 MiB


def broadcast_from_rank0(tensors: list[torch.Tensor]) -> None:
    """Collective: rank 0's values into `tensors` on every rank, coalesced (as torch's DDP)."""
    if tensors and dist.get_world_size() > 1:
        with torch.no_grad():
            dist._broadcast_coalesced(dist.distributed_c10d._get_default_group(), tensors,
                                      BROADCAST_BYTES, 0)


def to_sync_batchnorm(model: nn.Module) -> nn.Module:
    """engine.sync_batchnorm: the model with every BatchNorm layer a SyncBatchNorm over the
    default group (the same parameters and buffers, moved over); the root itself if it is one."""
    return nn.SyncBatchNorm.convert_sync_batchnorm(model)


def synced_batchnorm(model: nn.Module) -> bool:
    """Whether the model holds a SyncBatchNorm (summary.json's engine entry)."""
    return any(isinstance(m, nn.SyncBatchNorm) for m in model.modules())
