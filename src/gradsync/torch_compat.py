"""What differs between the torch versions gradsync supports (pyproject.toml: torch>=2.11,<2.15;
tested: 2.11.0 and 2.14.1 with `make compat TORCH=<version>`, 2.13.0 from the lock). Every API
gradsync calls was read against 2.11's and 2.13's source, and checked in 2.14.1's (each below is
as in 2.13); this is the one place that asks which torch it runs on.

- DDP's per-forward buffer sync is ``forward_sync_buffers`` from 2.13 (``broadcast_buffers``,
  deprecated there, before: passing it to 2.13 warns, passing ``forward_sync_buffers`` to 2.11
  is a TypeError). ``broadcast_buffers=False`` also leaves the buffers out of DDP's initial
  broadcast, ``forward_sync_buffers=False`` does not; gradsync builds every rank's model from
  the same seed before DDP wraps it, so both start from the same buffers.
- The gradsync engine (engines/gradsync_ddp.py) calls torch's private
  ``dist._compute_bucket_assignment_by_size`` (DDP's own bucket partition) and
  ``dist._broadcast_coalesced``, and autograd's ``Variable._execution_engine.queue_callback``
  (the end of a backward, as DDP's reducer): the same signatures in 2.11 and 2.13, and DDP's
  bucket rules (one bucket before the first synchronising backward unless
  find_unused_parameters) are the same in both (tests/test_gradsync_ddp.py compares the
  partitions, run by ``make compat`` too).
- FSDP2 keeps a unit's parameter groups as a list ``_fsdp_param_groups`` from 2.13 (per-parameter
  meshes), one ``_fsdp_param_group`` (or None) before: the gradient memory count reads them
  (engines/fsdp.py). Every public FSDP2 and torch.distributed.checkpoint API the sharded engines
  call are the same in 2.11 and 2.13.
- The unused-parameter check of the sharded engines (engines/fsdp.py ``_refuse_unused``) wraps
  FSDP2's private ``FSDPParamGroup.post_backward`` and
  ``FSDPState._root_post_backward_final_callback``, and reads ``reduce_grads``,
  ``_training_state``, ``fsdp_params`` and each ``FSDPParam``'s ``_unsharded_param``,
  ``unsharded_accumulated_grad``, ``sharded_param`` and ``_param_fqn``: read against 2.13, and
  present in 2.14.1 (whose fast fsdp and unused-parameter tests pass).
  ``engine.find_unused_parameters`` there needs ``set_reduce_scatter_unused_params``
  (``fsdp_reduces_unused``; refused where it is missing).
"""

from __future__ import annotations

import inspect
from typing import Any

from torch.nn.parallel import DistributedDataParallel

_DDP_KEYWORDS = inspect.signature(DistributedDataParallel.__init__).parameters


def ddp_buffer_sync(sync: bool) -> dict[str, Any]:
    """DDP's keyword for syncing buffers from rank 0 before every forward, on this torch."""
    if "forward_sync_buffers" in _DDP_KEYWORDS:  # torch >= 2.13
        return {"forward_sync_buffers": sync}
    return {"broadcast_buffers": sync}


def fsdp_param_groups(unit: Any) -> list[Any]:
    """FSDP2's parameter groups of one fully_shard unit, on this torch."""
    state = unit._get_fsdp_state()
    groups = getattr(state, "_fsdp_param_groups", None)  # torch >= 2.13
    if groups is None:
        one = state._fsdp_param_group
        groups = [] if one is None else [one]
    return list(groups)


def fsdp_reduces_unused() -> bool:
    """Whether FSDP2 can reduce-scatter zeros for parameters without gradient
    (``set_reduce_scatter_unused_params``: engine.find_unused_parameters on a sharded engine)."""
    from torch.distributed.fsdp import FSDPModule

    return hasattr(FSDPModule, "set_reduce_scatter_unused_params")
