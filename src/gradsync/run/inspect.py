"""``gradsync-train ... +inspect=params``: the model's parameters (name, shape, bytes) and the
sync.groups rule each one falls under, from the config the same overrides compose; nothing is
trained and no run dir is made."""

from __future__ import annotations

from gradsync.config.schema import DATA_EXTRA, RunConfig
from gradsync.sync.layer_sync import model_parameters, parameter_table

INSPECT_PARAMS = "+inspect=params"


def parameters_table(cfg: RunConfig) -> str:
    sync = cfg.sync.args
    infos = model_parameters(cfg.model.node, cfg.data.node, cfg.seed, DATA_EXTRA)
    return parameter_table(infos, sync.get("groups"), sync.get("comm_dtype", "fp32"))
