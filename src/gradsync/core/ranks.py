"""Which process is which: the one place that answers "am I rank 0" (the rank that writes the
run's outputs: Hydra's files, metrics, TensorBoard, summary.json, checkpoints)."""

from __future__ import annotations

import os

import torch.distributed as dist


def job_rank() -> int:
    """This process's global rank: the one an outside engine gave it (torchrun's RANK, a
    submitit task's), else the process group's (a spawned worker), else 0 (the launcher, also
    while Hydra sets a job up, before any process group exists)."""
    if "RANK" in os.environ:
        return int(os.environ["RANK"])
    if "SUBMITIT_EXECUTOR" in os.environ:
        import submitit

        return int(submitit.JobEnvironment().global_rank)
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank()
    return 0


def is_rank0() -> bool:
    """Whether this process writes the run's outputs."""
    return job_rank() == 0
