"""``gradsync-train ... +inspect=params``: the model's parameters (name, shape, bytes) and the
sync.groups rule each one falls under, from the config the same overrides compose; under a
sharded engine (trainer.engine=fsdp|hsdp) also its FSDP units and how each one reduces. Nothing
is trained and no run dir is made."""

from __future__ import annotations

from gradsync.config.schema import SHARDED_ENGINES, RunConfig
from gradsync.sync.layer_sync import meta_model, parameter_infos, parameter_table

INSPECT_PARAMS = "+inspect=params"


def parameters_table(cfg: RunConfig) -> str:
    sync = cfg.sync.args
    model = meta_model(cfg.model.node, cfg.data.node, cfg.seed)
    table = parameter_table(parameter_infos(model), sync.get("groups"),
                            sync.get("comm_dtype", "fp32"))
    if cfg.trainer.engine not in SHARDED_ENGINES:
        return table
    from gradsync.components import build
    from gradsync.engines.fsdp import unit_table
    from gradsync.sync.comm import CommCounts
    from gradsync.sync.policy import as_policy

    policy = as_policy(build(cfg.sync.node, {"uses_scaler": False, "world_size": 1,
                                             "counts": CommCounts()}), cfg.sync.target)
    hsdp = cfg.trainer.engine == "hsdp"
    return f"{table}\n\n{unit_table(model, cfg.trainer.fsdp_units, policy, hsdp)}"
