"""Which device a rank trains on, what it can compute, and how many CPU threads it gets.

CUDA is touched only by a rank, on its own device: nothing here creates a CUDA context.
Counting GPUs (NVML, or cudaGetDeviceCount) and reading a GPU's capability and name
(cudaGetDeviceProperties) need the driver, not a context; a context is made by the rank's
torch.cuda.set_device and first kernel, on its own device only.
"""

from __future__ import annotations

import os
import platform
import socket
from typing import Any

import torch
import torch.distributed as dist

# Native bf16 tensor-core math starts with Ampere (8.0); older GPUs emulate it, slowly.
BF16_MIN_CAPABILITY = (8, 0)
FP16_MIN_CAPABILITY = (5, 3)


class DeviceError(ValueError):
    """The GPUs this process sees cannot serve the ranks asked of it (a config error)."""


def usable_cpus() -> int:
    """The CPUs this process may run on (its affinity: taskset, cgroups' cpusets, SLURM's
    binding)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def cpu_threads(local_world: int, own_mask: bool = False) -> int:
    """A rank's threads: the CPUs this process may run on, shared by the `local_world` ranks
    on this node unless the mask is this rank's own (an srun task SLURM bound to its
    --cpus-per-task CPUs: slurm.task_has_own_cpus)."""
    usable = usable_cpus()
    return usable if own_mask else max(1, usable // max(1, local_world))


def visible_gpus() -> int:
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def cuda_index(visible: int, local_rank: int, local_world: int, same_view: bool) -> int:
    """The CUDA device index of local rank `local_rank` of `local_world` ranks on this node.

    same_view: every rank on the node sees the same GPUs (the workers gradsync spawns, and
    torchrun's ranks: torchrun narrows no rank's view), so they need one each: cuda:LOCAL_RANK,
    refused where fewer GPUs are visible than ranks (two ranks on cuda:0 fail in nccl's first
    collective, "Duplicate GPU detected"). A rank that may have a view of its own (an srun or
    submitit task: srun --gpus-per-task, or a scheduler's per-task CUDA_VISIBLE_DEVICES) takes
    cuda:LOCAL_RANK % visible: cuda:0 of one GPU of its own, one of two or more of its own, or
    its local rank's where every task sees the node's GPUs; tasks that still land on one GPU
    are refused once their process group is up (check_own_gpu)."""
    if visible > 0 and (local_world <= visible or not same_view):
        return local_rank % visible
    where = os.environ.get("CUDA_VISIBLE_DEVICES")
    seen = f"{visible} GPU{'s' if visible != 1 else ''} visible" + (
        f" (CUDA_VISIBLE_DEVICES={where})" if where is not None else "")
    raise DeviceError(f"{local_world} ranks on this node need one GPU each on nccl, but {seen}: "
                      "start at most that many ranks per node (trainer.devices, "
                      "--nproc-per-node, --ntasks-per-node), or use trainer.backend=gloo")


def check_own_gpu(gpu: str, index: int, group: Any = None) -> None:
    """Collective over `group` (a CPU one: nothing may run on nccl before this): DeviceError
    on every rank where two ranks were placed on one GPU (`gpu`: this rank's GPU's UUID, on
    cuda:`index`). Tasks with views of their own that share one GPU each pick cuda:0, and nccl
    would stop at its first collective with "Duplicate GPU detected"."""
    placed: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(placed, (gpu, socket.gethostname(), index), group=group)
    first: dict[str, int] = {}
    for rank, (uuid, host, cuda) in enumerate(placed):
        if uuid in first:
            other = first[uuid]
            raise DeviceError(
                f"ranks {other} and {rank} on {host} were both placed on one GPU ({uuid}: "
                f"cuda:{placed[other][2]} of rank {other}, cuda:{cuda} of rank {rank}): give "
                "each task a GPU of its own (srun --gpus-per-task=1), start at most as many "
                "ranks per node as it has GPUs (--ntasks-per-node, --nproc-per-node), or use "
                "trainer.backend=gloo")
        first[uuid] = rank


def check_capability(precision: str, index: int, capability: tuple[int, int], name: str) -> None:
    need = {"bf16": BF16_MIN_CAPABILITY, "fp16": FP16_MIN_CAPABILITY}.get(precision)
    if need is not None and tuple(capability) < need:
        have = ".".join(map(str, capability))
        raise DeviceError(
            f"precision.name={precision!r} is not native on cuda:{index} ({name}, compute "
            f"capability {have}; {precision} needs {need[0]}.{need[1]}): choose "
            f"{'fp16 or fp32' if precision == 'bf16' else 'fp32'}")


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return platform.processor() or platform.machine() or "cpu"


class WrongDevice(RuntimeError):
    """A tensor about to go to a collective of the default group is not on the model's device."""


def on_device(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    """`tensor`, checked to be on `device` (the model's) before it goes to a collective of the
    default group: nccl, like a group made as "cuda:gloo", serves CUDA tensors only, and a CPU
    tensor there fails only on a GPU ("No backend type associated with device type cpu"). The
    check runs everywhere, so a CPU run catches such a tensor too."""
    if tensor.device != device:
        raise WrongDevice(f"a tensor on {tensor.device} was handed to a collective of the "
                          f"default group, whose ranks train on {device}: nccl serves only "
                          "CUDA tensors; build it on the model's device")
    return tensor
