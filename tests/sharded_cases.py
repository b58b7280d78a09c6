"""Functions the sharded-engine tests (test_fsdp.py) run on every rank of the pool
(dist_pool.py): the worker's real run_training on the pool's gloo group with
engine=fsdp|hsdp, and what they read back (summary, consolidated model, TensorBoard)."""

from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed as dist
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

import dist_cases
from gradsync.train import checkpoint


def tb_scalars(run_dir: Path, prefixes: tuple[str, ...] = ("comm/", "mem/")) -> dict:
    acc = EventAccumulator(str(run_dir / "tb"))
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)]
            for tag in acc.Tags()["scalars"] if tag.startswith(prefixes)}


def run(cfg: dict, run_dir: str, tb: bool = False) -> dict:
    """run_training (resume resolved as the job does); rank 0 returns the summary, the
    consolidated model of checkpoints/last.pt, metrics.jsonl's rows and (tb) the comm/ and mem/
    scalars; every rank its summary."""
    summary, rows = dist_cases.run_training_with(lambda p: p, cfg, run_dir)
    out: dict = {"summary": summary}
    if dist.get_rank() == 0:
        out["rows"] = rows
        last = checkpoint.load(Path(run_dir) / "checkpoints" / "last.pt")
        out["params"] = last["model"]
        out["last_keys"] = sorted(last)
        if tb:
            out["tb"] = tb_scalars(Path(run_dir))
    return out


def initial_model(cfg: dict) -> dict[str, torch.Tensor]:
    """The model every run of `cfg` starts from, as the worker builds it (the run seed)."""
    from gradsync.components import build
    from gradsync.config.schema import RunConfig
    from gradsync.core.seeds import seed_everything

    run_cfg = RunConfig.from_plain(cfg)
    seed_everything(run_cfg.seed)
    data = build(run_cfg.data.node, {"seed": run_cfg.seed})
    model = build(run_cfg.model.node, data.sizes)
    return {k: v.detach() for k, v in model.state_dict().items()}


# --- a planted pickle: what someone who can write the run's checkpoint dir could do ---------------
class Payload:
    """Unpickled, it runs `touch <target>`."""

    def __init__(self, target: str):
        self.target = target

    def __reduce__(self):
        import os

        return (os.system, (f"touch {self.target}",))


def reseal(ckpt: Path) -> None:
    """Rewrite the sidecar's digests for what `ckpt` now holds (the attacker can write it too)."""
    import json

    side = ckpt.with_suffix(".json")
    meta = json.loads(side.read_text())
    meta["bytes"], meta["sha256"], meta["files"] = checkpoint.digest(ckpt)
    side.write_text(json.dumps(meta))


def plant(ckpt: Path, kind: str, target: str) -> None:
    """kind "metadata": the payload as DCP's .metadata; "value": the payload as the value of
    the optimizer's lr, appended to a shard file, with a legitimate index pointing at it."""
    import dataclasses
    import io
    import pickle

    if kind == "metadata":
        (ckpt / ".metadata").write_bytes(pickle.dumps(Payload(target)))
    else:
        meta = pickle.loads((ckpt / ".metadata").read_bytes())
        buf = io.BytesIO()
        torch.save(Payload(target), buf)
        shard = ckpt / "__0_0.distcp"
        offset = shard.stat().st_size
        with open(shard, "ab") as f:
            f.write(buf.getvalue())
        for index, info in meta.storage_data.items():
            if index.fqn == "optimizer.param_groups.0.lr":
                meta.storage_data[index] = dataclasses.replace(
                    info, relative_path=shard.name, offset=offset, length=len(buf.getvalue()))
        (ckpt / ".metadata").write_bytes(pickle.dumps(meta))
    reseal(ckpt)


def resume_planted(cfg: dict, run_dir: str, ckpt: str, kind: str, target: str) -> str:
    """Resume from `ckpt` (intact when the job checks it), with the payload planted by rank 0
    once the ranks have started, before any reads it; returns this rank's error."""
    def poison(p):
        if dist.get_rank() == 0:
            plant(Path(ckpt), kind, target)
        return p  # the others wait for rank 0 in the resume's broadcast

    cfg = cfg | {"resume": ckpt}
    job = dist_cases.job_config(cfg, Path(run_dir))  # the job's check, on every rank here
    dist.barrier()  # before rank 0 plants: no rank checks the payload as the job would
    try:
        dist_cases.run_training_with(poison, cfg, run_dir, job)
    except Exception as e:
        return f"{type(e).__name__}: {e}"
    return "resumed"


def run_recording_all_reduces(cfg: dict, run_dir: str) -> dict:
    """run(), with the size of the group of every torch.distributed.all_reduce (torch's FSDP2
    issues HSDP's all-reduce across replicas through it) and the fsdp engine's log lines."""
    import logging

    sizes: list[int] = []
    real = dist.all_reduce

    def recording(tensor, op=dist.ReduceOp.SUM, group=None, async_op=False):
        sizes.append(dist.get_world_size(group))
        return real(tensor, op=op, group=group, async_op=async_op)

    lines: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: lines.append(record.getMessage())  # type: ignore[method-assign]
    engine_log = logging.getLogger("gradsync.engines.fsdp")
    engine_log.addHandler(handler)
    level = engine_log.level
    engine_log.setLevel(logging.INFO)
    dist.all_reduce = recording
    try:
        out = run(cfg, run_dir)
    finally:
        dist.all_reduce = real
        engine_log.removeHandler(handler)
        engine_log.setLevel(level)
    return out | {"all_reduce_sizes": sizes, "log": lines}
