"""``gradsync-train ... +inspect=params``: the model's parameters (name, shape, bytes) and the
sync.groups rule each one falls under, from the config the same overrides compose; under a
sharded engine (engine=fsdp|hsdp) also its FSDP units and how each one reduces. Nothing
is trained and no run dir is made."""

from __future__ import annotations

from gradsync.config.schema import DATA_EXTRA, RunConfig
from gradsync.engines import capabilities
from gradsync.sync.layer_sync import meta_model, parameter_infos, parameter_table

INSPECT_PARAMS = "+inspect=params"


def parameters_table(cfg: RunConfig) -> str:
    sync = cfg.sync.args
    model = meta_model(cfg.model.node, cfg.data.node, cfg.seed, DATA_EXTRA)
    table = parameter_table(parameter_infos(model), sync.get("groups"),
                            sync.get("comm_dtype", "fp32"))
    can = capabilities(cfg.engine.name)
    if not can.sharded:
        return table
    from gradsync.components import build
    from gradsync.engines.fsdp import unit_table
    from gradsync.sync.comm import CommCounts
    from gradsync.sync.policy import as_policy

    policy = as_policy(build(cfg.sync.node, {"uses_scaler": False, "world_size": 1,
                                             "counts": CommCounts()}), cfg.sync.target)
    return f"{table}\n\n{unit_table(model, cfg.engine.fsdp_units, policy, can.replicas)}"
