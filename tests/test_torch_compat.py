"""The torch versions gradsync claims (pyproject.toml) and what differs between them
(torch_compat.py), checked on the torch this suite runs with: 2.13.0 from the lock, and any
other through `make compat TORCH=<version>`, which runs this file with the exactness and resume
tests."""

from __future__ import annotations

import re
import warnings

import pytest
import tomllib
import torch
from torch.nn.parallel import DistributedDataParallel

from conftest import REPO
from gradsync.torch_compat import ddp_buffer_sync


def version(text: str) -> tuple[int, ...]:
    return tuple(int(n) for n in re.findall(r"\d+", text)[:2])


def test_this_torch_is_in_the_range_pyproject_claims():
    deps = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["dependencies"]
    spec = next(d for d in deps if d.startswith("torch"))
    assert spec == "torch>=2.11,<2.15"
    assert (2, 11) <= version(torch.__version__) < (2, 15)


@pytest.mark.parametrize("sync", [True, False])
def test_ddp_gets_the_buffer_sync_keyword_this_torch_knows(single_process_group, sync):
    """forward_sync_buffers from 2.13, broadcast_buffers before (a TypeError on 2.11 and a
    deprecation warning on 2.13 otherwise); DDP answers broadcast_buffers on both."""
    model = torch.nn.BatchNorm1d(3)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # 2.13 warns for broadcast_buffers
        ddp = DistributedDataParallel(model, **ddp_buffer_sync(sync))
    assert ddp.broadcast_buffers is sync
    want = "forward_sync_buffers" if version(torch.__version__) >= (2, 13) else "broadcast_buffers"
    assert list(ddp_buffer_sync(sync)) == [want]
