"""``gradsync-train ... +inspect=params``: the model's parameters (name, shape, bytes) and the
sync.groups rule each one falls under, from the config the same overrides compose; under a
sharded engine (engine=fsdp|hsdp) also its FSDP units and how each one reduces. Nothing
is trained and no run dir is made."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from gradsync.config.schema import RunConfig
from gradsync.data.contract import build_data
from gradsync.engines import capabilities, settings_of
from gradsync.models import build_on_meta, model_call
from gradsync.sync.layer_sync import REST, ParamInfo, assign, parameter_infos, parse_rules

INSPECT_PARAMS = "+inspect=params"


def meta_model(model_node: dict[str, Any], data_node: dict[str, Any], seed: int) -> nn.Module:
    """Build the data (for the model's sizes: build_data) and the model on
    the meta device (no memory for the weights; on the CPU if the model cannot be built
    there)."""
    data = build_data(data_node, seed)
    return build_on_meta(model_call(model_node)[0], data.sizes)


def parameter_table(infos: list[ParamInfo], groups: Any, base: str) -> str:
    """The +inspect=params table: every parameter's name, shape, bytes and rule, then the
    groups' totals."""
    rules = parse_rules(groups or [])
    taken = assign(rules, [n for n, _, _ in infos])
    rows = [("parameter", "shape", "bytes", "rule")]
    totals: dict[str, list[int]] = {}
    for name, shape, dtype in infos:
        rule = taken[name]
        label = REST if rule is None else rule.name
        nbytes = int(torch.Size(shape).numel()) * dtype.itemsize
        what = rule.describe(base) if rule else f"policy ({base} all-reduce)"
        rows.append((name, str(list(shape)), str(nbytes), f"{label}: {what}"))
        total = totals.setdefault(label, [0, 0])
        total[0] += 1
        total[1] += nbytes
    widths = [max(len(r[i]) for r in rows) for i in range(3)]
    lines = [f"{r[0]:<{widths[0]}}  {r[1]:<{widths[1]}}  {r[2]:>{widths[2]}}  {r[3]}"
             for r in rows]
    lines.append("")
    for label, (count, nbytes) in totals.items():
        lines.append(f"{label}: {count} tensors, {nbytes} bytes")
    return "\n".join(lines)


def parameters_table(cfg: RunConfig) -> str:
    sync = cfg.sync.args
    model = meta_model(cfg.model.node, cfg.data.node, cfg.seed)
    table = parameter_table(parameter_infos(model), sync.get("groups"),
                            sync.get("comm_dtype", "fp32"))
    can = capabilities(cfg.engine.name)
    if not can.sharded:
        return table
    from gradsync.components import build
    from gradsync.engines.fsdp import unit_table
    from gradsync.sync.comm import PLAIN, CommCounts
    from gradsync.sync.policy import as_policy

    policy = as_policy(build(cfg.sync.node, {"uses_scaler": False, "world_size": 1,
                                             "counts": CommCounts()}), cfg.sync.target)
    wire = policy.wire or PLAIN
    units = settings_of(cfg.engine).fsdp_units  # type: ignore[attr-defined]
    return f"{table}\n\n{unit_table(model, units, wire, can.replicas)}"
