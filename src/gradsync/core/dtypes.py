"""A precision's name as the config spells it (``fp32``, ``bf16``, ``fp16``: precision.name,
sync.comm_dtype, a layer rule's comm_dtype) and the torch dtype it stands for; whether autocast
really computes in it on a device type."""

from __future__ import annotations

import warnings

import torch

DTYPES = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}


def autocast_runs(name: str, device_type: str) -> bool:
    """Whether autocast really computes in this precision on this device type. torch only warns
    and falls back to fp32 where it cannot (a dtype the device lacks, CUDA absent), so run one
    tiny op and look at its dtype."""
    dtype = DTYPES[name]
    if dtype is None:
        return True
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            ones = torch.ones(2, 2, device=device_type)
            with torch.autocast(device_type=device_type, dtype=dtype):
                out = torch.nn.functional.linear(ones, ones)
    except (RuntimeError, AssertionError):  # no such device; a GPU without bf16
        return False
    return out.dtype == dtype
