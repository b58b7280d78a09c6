"""Functions the local SGD / DiLoCo tests run on every rank of the pool (dist_pool.py): the
worker's real run_training on the pool's gloo group, with this rank's parameters recorded after
every window (and after the final averaging), optionally with an inf loss injected on one rank."""

from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed as dist

import dist_cases
from gradsync.train import checkpoint, loop


def flat(model: torch.nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().flatten().clone() for p in model.parameters()])


def recorded_run(cfg: dict, run_dir: str, inf_rank: int = -1, inf_window: int = -1) -> dict:
    """run_training, recording after each window (after its averaging, if any) and after
    finish(): (windows_done, averaged?, this rank's flat parameters). inf_rank's loss is
    multiplied by inf during window inf_window (counted from 1, resumed runs included): an fp16
    overflow on that rank only."""
    snaps: list[tuple] = []
    scales: list[float] = []
    shm_used = []  # True per averaging that went through the shared-memory slots
    drifts: dict = {}  # windows done -> this rank's own drift, per averaging

    def recording(p):
        policy = p.policy  # the LocalSGD / DiLoCo policy object, its own averager
        after_window, finish = policy.after_window, policy.finish

        def through_slots(average, *args):
            """average(*args); if it averaged, whether this rank's slot was written."""
            slots = policy.slots
            before = None if slots is None else slots.slots[dist.get_rank(), :8].clone()
            policy.drift = None
            average(*args)
            if policy.drift is not None:
                drifts[policy.windows] = policy.drift
                shm_used.append(before is not None and not torch.equal(
                    before, slots.slots[dist.get_rank(), :8]))

        def after(model, windows_done):
            through_slots(after_window, model, windows_done)
            snaps.append((windows_done, policy.drift is not None, flat(model)))
            scales.append(p.precision.scale)

        def done(model):
            before = policy.counters.averagings
            through_slots(finish, model)
            snaps.append(("finish", policy.counters.averagings > before, flat(model)))

        policy.after_window, policy.finish = after, done
        if dist.get_rank() == inf_rank:
            loss = p.loss

            def poisoned(out, y):
                sums, counts = loss(out, y)
                if policy.windows + 1 == inf_window:
                    sums = sums * float("inf")
                return sums, counts

            p.loss = poisoned
        return p

    summary, rows = dist_cases.run_training_with(recording, cfg, run_dir)
    out: dict = {"summary": summary, "snaps": snaps, "scales": scales,
                 "averaged_through_shm": shm_used, "drifts": drifts}
    if dist.get_rank() == 0:
        out["rows"] = rows
        out["ckpt"] = checkpoint.load(Path(run_dir) / "checkpoints" / "last.pt")
    return out


def non_finite_on_one_rank(cfg: dict, run_dir: str, rank: int, step: int) -> dict:
    """run_training with `rank`'s first parameter set to inf after optimizer step `step` (its
    replica alone: between two averagings): the error each rank stops with, and when."""
    import time

    model: list[torch.nn.Module] = []
    fail_if_asked = loop.fail_if_asked  # where the loop's test aid runs: after the step

    def poisoned(tr, at, stepped, world_size):
        fail_if_asked(tr, at, stepped, world_size)
        if dist.get_rank() == rank and at == step:
            with torch.no_grad():
                next(model[0].parameters()).view(-1)[0] = float("inf")

    def poison(p):
        model.append(p.engine.module)
        return p

    start = time.monotonic()
    loop.fail_if_asked = poisoned
    try:
        dist_cases.run_training_with(poison, cfg, run_dir)
    except FloatingPointError as e:
        return {"error": str(e), "seconds": time.monotonic() - start}
    finally:
        loop.fail_if_asked = fail_if_asked
    return {"error": None, "seconds": time.monotonic() - start}


def direct_round_against_float64(through_slots: bool) -> dict:
    """Three rounds of averaging.average_replicas on a model whose replicas drift apart by
    rank-seeded noise, each checked against the float64 mean and drift of the gathered
    replicas; through this pool's own shared-memory slots or the process group."""
    from gradsync.sync.averaging import average_replicas
    from gradsync.sync.comm import CommCounts
    from gradsync.sync.shm_allreduce import SharedSlots, map_slots

    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.BatchNorm1d(5))
    model.get_parameter("1.weight").data.add_(0.5)
    slots = None
    if through_slots:
        mapped = map_slots(4096)
        assert mapped is not None
        slots = SharedSlots(mapped, rank, world, None)
    gen = torch.Generator().manual_seed(100 + rank)
    counts, out = CommCounts(), {"mean_err": [], "drift": [], "drift_ref": []}
    for _ in range(3):
        with torch.no_grad():
            for t in [*model.parameters(), model[1].running_mean]:
                t.add_(torch.randn(t.shape, generator=gen) * 0.01)
        theta = torch.cat([t.detach().flatten().double() for t in
                           [*model.parameters(), model[1].running_mean, model[1].running_var]])
        everyone = [torch.empty_like(theta) for _ in range(world)]
        dist.all_gather(everyone, theta)
        mean = torch.stack(everyone).mean(0)
        out["drift_ref"].append(float((theta - mean).norm() / mean.norm()))
        out["drift"].append(average_replicas(model, counts, slots))
        after = torch.cat([t.detach().flatten().double() for t in
                           [*model.parameters(), model[1].running_mean, model[1].running_var]])
        out["mean_err"].append(float((after - mean).abs().max()))
    out["params"] = flat(model)
    out["calls"], out["bytes"] = counts.allreduce_calls, counts.allreduce_bytes
    out["slot_written"] = slots is not None and bool(slots.slots[rank].any())
    return out
