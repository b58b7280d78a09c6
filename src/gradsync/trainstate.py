"""The complete training state, captured on every rank and restored exactly.

What a checkpoint holds: every stateful component (anything in ``components`` with a
``state_dict``: model, optimizer, LR scheduler, GradScaler, and the sync policy and schedule as
soon as they keep state), the loop's ``Progress`` (steps, windows, epoch, position in the epoch,
counters), and per rank (``ranks[r]``) its RNG states and its own counters (communication,
overflow handling), plus the config and its hash. The sampler needs no state of its own: its
order is a function of (seed, epoch) and its position is ``Progress.epoch_step``; the loss
normaliser's state lives inside one window. Everything is plain tensors, numbers, strings,
lists and dicts, so it loads with ``weights_only=True``.
"""

from __future__ import annotations

import random
from dataclasses import asdict, fields
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from gradsync.loop import Parts, Progress
from gradsync.repro import config_hash


def components(p: Parts) -> dict[str, Any]:
    candidates = {"model": p.ddp.module, "optimizer": p.optimizer,
                  "lr_scheduler": p.lr_scheduler, "grad_scaler": p.precision.scaler,
                  "policy": p.policy.impl, "schedule": p.schedule}
    return {k: v for k, v in candidates.items() if hasattr(v, "state_dict")}


def rank_counters(p: Parts) -> dict[str, Any]:
    """Counters each rank keeps for itself (dataclasses of numbers), reported in summary.json."""
    return {"comm": p.counts, "overflow": p.policy.overflow}


def rng_state() -> dict[str, Any]:
    np_state = np.random.get_state(legacy=False)
    np_state["state"]["key"] = np_state["state"]["key"].tolist()
    return {"python": random.getstate(), "numpy": np_state, "torch": torch.get_rng_state(),
            "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else []}


def set_rng_state(s: dict[str, Any]) -> None:
    random.setstate(s["python"])
    np_state = dict(s["numpy"], state=dict(s["numpy"]["state"]))
    np_state["state"]["key"] = np.array(np_state["state"]["key"], dtype=np.uint32)
    np.random.set_state(np_state)
    torch.set_rng_state(s["torch"])
    if s["cuda"]:
        torch.cuda.set_rng_state_all(s["cuda"])


def capture(p: Parts, state: Progress, cfg: dict[str, Any], group: Any) -> dict[str, Any] | None:
    """Collective (every rank calls it): the state to save on rank 0, None elsewhere."""
    mine = {"rng": rng_state(),
            "counters": {name: asdict(c) for name, c in rank_counters(p).items()}}
    rank = dist.get_rank()
    ranks: list[Any] | None = [None] * p.s.world_size if rank == 0 else None
    if p.s.world_size > 1:
        dist.gather_object(mine, ranks, dst=0, group=group)
    else:
        ranks = [mine]
    if rank != 0:
        return None
    out = {name: obj.state_dict() for name, obj in components(p).items()}
    out.update(step=state.step, progress=asdict(state), ranks=ranks, world_size=p.s.world_size,
               config=cfg, config_hash=config_hash(cfg))
    return out


def restore(p: Parts, ckpt: dict[str, Any], rank: int) -> Progress:
    """Load a checkpoint into freshly built parts; returns the Progress to continue from."""
    for name, obj in components(p).items():
        obj.load_state_dict(ckpt[name])
    known = {f.name for f in fields(Progress)}
    state = Progress(**{k: v for k, v in ckpt["progress"].items() if k in known})
    mine = ckpt["ranks"][rank]
    for name, counters in rank_counters(p).items():
        for key, value in mine["counters"][name].items():
            setattr(counters, key, value)
    set_rng_state(mine["rng"])  # last: nothing after it may draw
    return state
