"""The complete training state, captured on every rank and restored exactly.

What a checkpoint holds: every stateful component (anything in ``components`` with a
``state_dict``: model, optimizer, LR scheduler, GradScaler, the sync policy, schedule and
noise meter once they keep state), the loop's ``Progress`` (steps, windows, epoch, position in
the epoch, counters), and per rank (``ranks[r]``) its RNG states and its own counters (comms,
overflow handling), plus the config and its hash. The sampler needs no state of its own: its
order is a function of (seed, epoch) and its position is ``Progress.epoch_micro``; the loss
normaliser's state lives inside one window. Everything is plain tensors, numbers, strings,
lists and dicts, so it loads with ``weights_only=True``.

The LR schedule's horizon (``lr_horizon``: the optimizer steps, or reference batches, it was
planned for) is saved too: a resume whose horizon differs (more epochs or steps) re-plans the
schedule from the checkpoint on (train/lr_schedulers.py ``replan``) instead of loading it.
"""

from __future__ import annotations

import logging
import random
from dataclasses import asdict, fields
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from gradsync.core.ranks import is_rank0
from gradsync.core.seeds import derive_seed, seed_rank
from gradsync.train import lr_schedulers
from gradsync.train.checkpoint import progress_of
from gradsync.train.loop import Parts, Progress
from gradsync.train.repro import config_hash

log = logging.getLogger("gradsync.train.state")  # a child of the ranks' log (run/worker.py)


def to_cpu(tree: Any) -> Any:
    """A copy of nested dicts/lists/tuples with every tensor moved to the CPU. From a GPU the
    copies are queued (into pinned memory) and waited for once, not once per tensor."""
    streams: dict[torch.device, Any] = {}

    def copy(tree: Any) -> Any:
        if isinstance(tree, torch.Tensor):
            if tree.device.type == "cuda":
                streams.setdefault(tree.device, torch.cuda.current_stream(tree.device))
                return tree.detach().to("cpu", non_blocking=True)
            return tree.detach().cpu()
        if isinstance(tree, dict):
            return {k: copy(v) for k, v in tree.items()}
        if isinstance(tree, (list, tuple)):
            return type(tree)(copy(v) for v in tree)
        return tree

    out = copy(tree)
    for stream in streams.values():
        stream.synchronize()  # the one wait: the copies are done before anyone reads them
    return out


def components(p: Parts, skip: tuple[str, ...] = ()) -> dict[str, Any]:
    """skip: components kept elsewhere (a sharded engine's model and optimizer)."""
    candidates = {"model": p.engine, "optimizer": p.optimizer,
                  "lr_scheduler": p.lr_scheduler, "grad_scaler": p.precision.scaler,
                  # the policy's state (a policy of one's own may keep some), else its averager's
                  "policy": p.policy if hasattr(p.policy, "state_dict") else p.policy.averager,
                  "schedule": p.schedule,
                  "noise_scale": p.noise}
    return {k: v for k, v in candidates.items() if hasattr(v, "state_dict") and k not in skip}


def rank_counters(p: Parts) -> dict[str, Any]:
    """Counters each rank keeps for itself (dataclasses of numbers), reported in summary.json."""
    out = {"comm": p.counts, "overflow": p.precision.overflow}
    averager = p.policy.averager
    return out if averager is None or averager.counters is None else (
        out | {"averaging": averager.counters})


# With a policy that has an averager (local SGD, DiLoCo, sync.groups with `every`), the replicas
# differ between averagings: each rank trains its own, wholly or in part, so these components
# are kept per rank (ranks[r]["own"]); the top-level "model" holds their mean.
OWN = ("model", "optimizer", "lr_scheduler", "grad_scaler")


def mean_model(own: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
    """The rank-averaged weights (float tensors; others as rank 0 holds them)."""
    models = [o["model"] for o in own]
    return {k: (torch.stack([m[k] for m in models]).mean(0).to(v.dtype)
                if v.is_floating_point() else v) for k, v in models[0].items()}


def averaged(p: Parts) -> bool:
    """Whether each rank trains a replica of its own between averagings (wholly or in part):
    the policy has an averager."""
    return p.policy.averager is not None


def rng_state(device: torch.device) -> dict[str, Any]:
    """The rank's RNG streams: its CUDA generator is its own device's only (another rank's GPU
    is not this rank's to touch, nor to put a context on)."""
    np_state = np.random.get_state(legacy=False)
    np_state["state"]["key"] = np_state["state"]["key"].tolist()
    return {"python": random.getstate(), "numpy": np_state, "torch": torch.get_rng_state(),
            "cuda": [torch.cuda.get_rng_state(device)] if device.type == "cuda" else []}


def set_rng_state(s: dict[str, Any], device: torch.device) -> None:
    random.setstate(s["python"])
    np_state = dict(s["numpy"], state=dict(s["numpy"]["state"]))
    np_state["state"]["key"] = np.array(np_state["state"]["key"], dtype=np.uint32)
    np.random.set_state(np_state)
    torch.set_rng_state(s["torch"])
    if s["cuda"] and device.type == "cuda":
        torch.cuda.set_rng_state(s["cuda"][0], device)


def capture(p: Parts, state: Progress, cfg: dict[str, Any], group: Any,
            skip: tuple[str, ...] = ()) -> dict[str, Any] | None:
    """Collective (every rank calls it): the state to save on rank 0, None elsewhere; without
    the components in `skip` (a sharded checkpoint keeps the model and optimizer itself)."""
    mine = {"rng": rng_state(p.device),
            "counters": {name: asdict(c) for name, c in rank_counters(p).items()}}
    own = averaged(p)
    if own:
        parts = components(p)
        mine["own"] = to_cpu({k: parts[k].state_dict() for k in OWN if k in parts})
    writer = is_rank0()  # gathers every rank's part and writes the file
    ranks: list[Any] | None = [None] * p.world_size if writer else None
    if p.world_size > 1:
        dist.gather_object(mine, ranks, dst=0, group=group)
    else:
        ranks = [mine]
    if not writer:
        return None
    assert ranks is not None
    # on the CPU: the checkpoint opens on a machine with other GPUs, or none
    out = {name: to_cpu(obj.state_dict()) for name, obj in components(p, skip).items()}
    if p.policy.averager is not None and not p.policy.averager.in_sync():
        out["model"] = mean_model([r["own"] for r in ranks])  # what a user would deploy
    out.update(step=state.step, progress=asdict(state), ranks=ranks, world_size=p.world_size,
               config=cfg, config_hash=config_hash(cfg), lr_horizon=p.total_steps,
               numerics=p.numerics)
    return out


def horizon_changed(p: Parts, ckpt: dict[str, Any]) -> bool:
    """Whether this run's LR horizon differs from the one the checkpoint's schedule was built
    for (a checkpoint that did not record it: whether the run's length settings differ)."""
    old = ckpt.get("lr_horizon")
    if old is not None:
        return int(old) != p.total_steps
    t = ckpt["config"]["trainer"]
    return (t["max_epochs"], t["max_steps"]) != (p.trainer.max_epochs, p.trainer.max_steps)


def restore(p: Parts, ckpt: dict[str, Any], rank: int,
            skip: tuple[str, ...] = ()) -> Progress:
    """Load a checkpoint into freshly built parts (but the components in `skip`); returns the
    Progress to continue from. A checkpoint of another world size (a sharded one: DCP
    reshards) has no part for this rank: its counters start from zero and its RNG streams are
    drawn afresh from (seed, optimizer step, rank). A run of another length re-plans the LR
    schedule (the module's docstring)."""
    replan = horizon_changed(p, ckpt)
    fresh_lrs = [g["lr"] for g in p.optimizer.param_groups]  # as the fresh scheduler set them
    for name, obj in components(p, skip).items():
        if not (replan and name == "lr_scheduler"):
            obj.load_state_dict(ckpt[name])
    known = {f.name for f in fields(Progress)}
    state = Progress(**{k: v for k, v in progress_of(ckpt).items() if k in known})
    if ckpt["world_size"] != p.world_size:
        if replan:
            _replan(p, ckpt, ckpt["lr_scheduler"], fresh_lrs, state)
        seed_rank(derive_seed(ckpt["config"]["seed"], state.step), rank)
        return state
    mine = ckpt["ranks"][rank]
    parts = components(p)
    for name, own in mine.get("own", {}).items():
        if not (replan and name == "lr_scheduler"):
            parts[name].load_state_dict(own)  # this rank's replica, not the consensus
    if replan:
        _replan(p, ckpt, mine.get("own", {}).get("lr_scheduler", ckpt["lr_scheduler"]),
                fresh_lrs, state)
    for name, counters in rank_counters(p).items():
        for key, value in mine["counters"][name].items():
            setattr(counters, key, value)
    set_rng_state(mine["rng"], p.device)  # last: nothing after it may draw
    return state


def _replan(p: Parts, ckpt: dict[str, Any], saved: dict[str, Any], fresh_lrs: list[float],
            state: Progress) -> None:
    """The LR schedule of this run's length, from the checkpoint's step on (after the optimizer
    was loaded: its LRs are the replayed schedule's, not the checkpoint's)."""
    lr_schedulers.replan(p.lr_scheduler, saved, p.optimizer, fresh_lrs, state.step)
    old = ckpt.get("lr_horizon")
    log.info("the run's length changed: the LR schedule is re-planned for its new horizon, %d "
             "(was %s), from optimizer step %d on: each step uses the LR a fresh run of this "
             "length uses there (now %.6g)", p.total_steps, "?" if old is None else old,
             state.step, p.optimizer.param_groups[0]["lr"])
