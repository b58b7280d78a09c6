"""The checks a composed config passes before any worker starts, ending in the one typed
``RunConfig`` the workers use: each settings dataclass checks its own values (config/schema.py),
each component is held against its callable's signature and its own ``@checks``
(components.py), then what the parts must agree on. A failed check raises ``ConfigError`` with
one line naming the key and what is allowed. No Hydra here.
"""

from __future__ import annotations

import functools
import math
import os
from dataclasses import fields, replace
from typing import Any

from gradsync.components import (
    CheckContext,
    ConfigError,
    build,
    check,
    locate,
    parameters,
    require,
)
from gradsync.config.schema import (
    COMPONENTS,
    DATA_EXTRA,
    SCHEMA_GROUPS,
    TOP_KEYS,
    RunConfig,
)
from gradsync.run.placement import Placement, place_job
from gradsync.sync.layer_sync import model_parameters
from gradsync.train import noise_scale

__all__ = ["ConfigError", "RunConfig", "validate"]


def check_known_keys(cfg: dict[str, Any]) -> None:
    """Keys added with `+key=value` bypass the schema's struct mode: refuse them here, against
    the chosen option's own schema (never a sibling option's keys)."""
    for key in cfg:
        if key not in TOP_KEYS:
            raise ConfigError(f"{key}: unknown key; allowed keys: {', '.join(sorted(TOP_KEYS))}")
    for group, options in SCHEMA_GROUPS.items():
        node = cfg[group]
        name = node.get("name")
        if group == "schedule":
            require(name in options, "schedule.name", f"one of {', '.join(options)}", name)
        schema = options.get(name) or next(iter(options.values()))
        allowed = {f.name for f in fields(schema)}
        for key in node:
            if key not in allowed:
                raise ConfigError(f"{group}.{key}: unknown key; allowed keys: "
                                  f"{', '.join(sorted(allowed))}")


# What the worker passes each component itself (runtime arguments, never in the config).
DATA_SIZES = ("in_dim", "out_dim", "vocab_size", "max_len")
RUNTIME = {"model": DATA_SIZES, "data": ("seed",), "sync": ("uses_scaler", "world_size", "counts"),
           "optimizer": ("params",), "lr_scheduler": ("optimizer", "total_steps")}
EXTRA = {"data": DATA_EXTRA}  # keys of a node that the loop reads, not the target


def accepted_keys(group: str, node: dict[str, Any]) -> str:
    """A component group's accepted keys, for messages."""
    try:
        names = parameters(locate(node["_target_"]))
    except (ConfigError, KeyError, TypeError):
        return ""
    return ", ".join(sorted(n for n in names if n not in RUNTIME.get(group, ())))


def check_components(plain: dict[str, Any], cfg: RunConfig, world: int) -> None:
    """Every component against its callable's signature and own checks; then what components
    must agree on: the sizes the model needs and the data provides, the loss's unit; the sync
    policy meets the policy contract."""
    data_node, model_node = plain["data"], plain["model"]
    ctx = CheckContext("", world, cfg.precision.name, provided={
        "allreduce": cfg.trainer.allreduce,
        "clip_grad_norm": cfg.trainer.clip_grad_norm,
        # the model's (name, shape, dtype) of every parameter, built on the meta device when a
        # check asks (sync.groups); after the data and model checks passed
        "parameters": functools.cache(lambda: model_parameters(model_node, data_node, cfg.seed,
                                                               DATA_EXTRA))})
    data = check("data", data_node, RUNTIME["data"], replace(ctx, group="data"), DATA_EXTRA)
    provides = tuple(getattr(data, "sizes", DATA_SIZES))
    unit = getattr(data, "unit", "samples")
    # the model gets the data's sizes that it names: those are not config keys
    for name, p in parameters(locate(model_node["_target_"], "model._target_")).items():
        if name in DATA_SIZES and p.default is p.empty and name not in provides:
            raise ConfigError(f"model: {model_node['_target_']} needs {name}, which "
                              f"data ({data_node['_target_']}) does not provide (it "
                              f"provides {', '.join(provides)})")
    check("model", model_node, provides, replace(ctx, group="model"))
    for group in ("sync", "optimizer", "lr_scheduler"):
        check(group, plain[group], RUNTIME[group], replace(ctx, group=group))
    cfg.loss.check(unit, cfg.data.target)
    check_optimizer(plain["optimizer"])
    check_policy(cfg, world)


def check_policy(cfg: RunConfig, world: int) -> Any:
    """The sync component builds a policy (sync/policy.py's contract: should_sync(micro_index,
    window_size)); built here as a worker builds it, without a model, and returned."""
    from gradsync.sync.comm import CommCounts
    from gradsync.sync.policy import as_policy

    runtime = {"uses_scaler": cfg.precision.name == "fp16", "world_size": world,
               "counts": CommCounts()}
    return as_policy(build(cfg.sync.node, runtime), cfg.sync.target)


def check_optimizer(node: dict[str, Any]) -> None:
    """The optimizer's own argument checks (torch raises on lr=nan, betas out of range...), run
    on one dummy parameter."""
    import torch

    for key, value in node.items():
        values = value if isinstance(value, (list, tuple)) else [value]
        numbers = [v for v in values if isinstance(v, (int, float)) and not isinstance(v, bool)]
        require(all(map(math.isfinite, numbers)), f"optimizer.{key}", "finite numbers", value)
    try:
        build(node)([torch.nn.Parameter(torch.zeros(1))])
    except Exception as e:
        raise ConfigError(f"optimizer ({node['_target_']}) refuses its arguments: "
                          f"{type(e).__name__}: {e}") from None


def validate(plain: dict[str, Any], placement: Placement | None = None) -> RunConfig:
    """Every check a composed config (plain data) must pass before any worker starts; the
    checked, typed config. placement: where the job's ranks run (the entry point's; default:
    the placement the config's trainer.backend and trainer.devices give here)."""
    check_known_keys(plain)
    for group in COMPONENTS:
        require(isinstance(plain[group], dict) and "_target_" in plain[group], group,
                "a _target_ (package.module.callable) and its keyword arguments", plain[group])
    data = plain["data"]
    require(isinstance(data.get("micro_batch_size"), int)
            and not isinstance(data["micro_batch_size"], bool) and data["micro_batch_size"] >= 1,
            "data.micro_batch_size", "an integer >= 1", data.get("micro_batch_size"))
    if placement is None:
        placement = place_job(plain["trainer"]["backend"], plain["trainer"]["devices"])
    cfg = RunConfig.from_plain(plain)
    cfg.trainer.check(placement.device_type)
    require(isinstance(cfg.seed, int) and 0 <= cfg.seed < 2**63, "seed",
            "an integer in [0, 2**63)", cfg.seed)
    require(cfg.resume in ("none", "auto") or os.path.exists(cfg.resume), "resume",
            "none, auto, or the path of a checkpoint file or run dir", cfg.resume)
    check_components(plain, cfg, placement.world_size)
    cfg.schedule.check(placement.world_size, cfg.micro_batch_size)
    cfg.precision.check(placement.device_type)
    cfg.lr_scaling.check()
    noise_scale.check(cfg, placement.world_size)
    return cfg
