"""Where a job's ranks run, derived once: the entry point computes the job's ``Placement`` from
``trainer.backend``, ``trainer.devices`` and what an outside launcher set (torchrun's env://
variables; a plain srun task and a submitit task export the same ones first), and hands it to
the config checks, the resume check, run_info.json, the launcher and every rank
(``for_rank``), which takes its device from it.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, replace

import torch
import torch.distributed as dist

from gradsync.components import ConfigError
from gradsync.config.schema import BACKENDS
from gradsync.core.devices import DeviceError, check_capability, cuda_index, visible_gpus

LAUNCHED_BY_GRADSYNC = "gradsync"  # this process starts the ranks itself (spawn or fork)


@dataclass(frozen=True)
class Placement:
    backend: str  # gloo | nccl (auto resolved)
    world_size: int
    # who started the ranks: gradsync (this job's launcher, one process per rank), torchrun (or
    # any env:// launcher), srun (a plain srun task) or submitit; all but gradsync make this
    # process one of the ranks
    launched_by: str = LAUNCHED_BY_GRADSYNC
    rank: int = 0  # this process's rank (the launcher of spawned ranks: 0, the writer)
    local_rank: int = 0
    local_world_size: int = 1

    @property
    def spawns(self) -> bool:
        """This process starts the ranks (and is none of them)."""
        return self.launched_by == LAUNCHED_BY_GRADSYNC

    @property
    def device_type(self) -> str:
        return "cuda" if self.backend == "nccl" else "cpu"

    def for_rank(self, rank: int) -> Placement:
        """A rank this launcher starts: every rank is on this node and sees its GPUs."""
        return replace(self, rank=rank, local_rank=rank, local_world_size=self.world_size)

    @property
    def same_gpu_view(self) -> bool:
        """Every rank on this node sees the same GPUs: the workers gradsync spawns and
        torchrun's ranks do; an srun or submitit task may have GPUs of its own."""
        return self.launched_by in (LAUNCHED_BY_GRADSYNC, "torchrun")

    def device(self) -> torch.device:
        """This rank's device (asked in the rank, before anything touches CUDA): its GPU on
        nccl (devices.cuda_index), else the CPU."""
        if self.backend != "nccl":
            return torch.device("cpu")
        return torch.device("cuda", cuda_index(visible_gpus(), self.local_rank,
                                               self.local_world_size, self.same_gpu_view))


def check_cuda(placement: Placement, precision: str) -> list[int]:
    """The CUDA devices of this process's ranks (all the ranks it starts, or itself), refused
    (ConfigError) where too few are visible or where the precision is not native on them. No
    CUDA context is created: the launcher (or an env:// rank before set_device) must not hold
    one on GPU 0."""
    visible = visible_gpus()
    try:
        if visible == 0:
            raise DeviceError("trainer.backend=nccl needs a GPU, and none is visible "
                              f"(CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES')})")
        ranks = ([placement.for_rank(r) for r in range(placement.world_size)]
                 if placement.spawns else [placement])
        indices = [r.device().index for r in ranks]
        for index in indices:
            check_capability(precision, index, torch.cuda.get_device_capability(index),
                             torch.cuda.get_device_name(index))
    except DeviceError as e:
        raise ConfigError(str(e)) from None
    return indices


def pick_backend(requested: str, cuda_available: bool | None = None) -> str:
    """trainer.backend resolved: auto is nccl where CUDA is, else gloo. ConfigError for a name
    torch does not know here, or nccl without CUDA."""
    if requested not in BACKENDS:
        raise ConfigError(f"trainer.backend={requested!r} is not allowed: one of "
                          f"{', '.join(BACKENDS)}")
    cuda = torch.cuda.is_available() if cuda_available is None else cuda_available
    if requested == "auto":
        return "nccl" if cuda else "gloo"
    if requested == "nccl" and not cuda:
        raise ConfigError("trainer.backend='nccl' needs CUDA, which this machine lacks: "
                          "use auto or gloo")
    return requested


def env_launched() -> bool:
    """torchrun's (or any env:// launcher's) variables are set: this process is one rank."""
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def launched_by() -> str:
    if not env_launched():
        return LAUNCHED_BY_GRADSYNC
    if "SUBMITIT_EXECUTOR" in os.environ:
        return "submitit"
    if os.environ.get("GRADSYNC_SRUN_TASK") == "1":  # set by slurm.adopt_srun_ranks
        return "srun"
    return "torchrun"


def place_job(backend: str, devices: int, cuda_available: bool | None = None) -> Placement:
    """The job's placement: its ranks are this launcher's trainer.devices workers, or (under
    an env:// launcher) this process is rank RANK of WORLD_SIZE, LOCAL_RANK of
    LOCAL_WORLD_SIZE on its node."""
    resolved = pick_backend(backend, cuda_available)
    by = launched_by()
    if by == LAUNCHED_BY_GRADSYNC:
        return Placement(resolved, devices, by)
    env = os.environ
    rank, world = int(env["RANK"]), int(env["WORLD_SIZE"])
    return Placement(resolved, world, by, rank, int(env.get("LOCAL_RANK", rank)),
                     int(env.get("LOCAL_WORLD_SIZE", world)))


def of_process_group() -> Placement:
    """The placement of a process already in an initialised default group (a test's pool of
    ranks, a benchmark): one rank of an env://-style job."""
    rank, world = dist.get_rank(), dist.get_world_size()
    return Placement(dist.get_backend(), world, "torchrun", rank, rank, world)
