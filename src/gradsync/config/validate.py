"""The checks on the config itself, ending in the one typed ``RunConfig`` the workers use: no
unknown keys, each component a ``_target_``, each settings dataclass checking its own values
(config/schema.py) against the world size and device type the job runs on. A failed check
raises ``ConfigError`` with one line naming the key and what is allowed. Nothing is built here:
building the components as a worker builds them and holding them to their contracts is the run's
preflight (run/preflight.py), which starts with this check. No Hydra here.
"""

from __future__ import annotations

import os
from dataclasses import fields
from typing import Any

from gradsync.components import ConfigError, accepts, locate, require
from gradsync.config.renames import refuse_renamed_keys
from gradsync.config.schema import COMPONENTS, SCHEMA_GROUPS, TOP_KEYS, RunConfig

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

def runtime_arguments(group: str, data_node: dict[str, Any] | None = None) -> tuple[str, ...]:
    """The names the worker passes a group's component itself: for the model, the sizes the
    data declares with @provides (the built-in size names if it declares none)."""
    if group != "model" or not data_node:
        return RUNTIME.get(group, ())
    try:
        return tuple(getattr(locate(data_node["_target_"]), "sizes", DATA_SIZES))
    except (ConfigError, KeyError, TypeError):
        return DATA_SIZES


def first_line(text: str) -> str:
    return next((line.strip() for line in text.splitlines() if line.strip()), "")


def check_shape(plain: dict[str, Any]) -> None:
    """The config's keys: none renamed or unknown, each component a _target_, the micro-batch
    size."""
    refuse_renamed_keys(plain)
    check_known_keys(plain)
    for group in COMPONENTS:
        require(isinstance(plain[group], dict) and "_target_" in plain[group], group,
                "a _target_ (package.module.callable) and its keyword arguments", plain[group])
    loggers = plain.get("logger") or {}
    require(isinstance(loggers, dict) and all(
        isinstance(node, dict) and "_target_" in node for node in loggers.values()), "logger",
        "trackers by name, each a _target_ and its keyword arguments (conf/logger/)", loggers)
    micro = plain["schedule"].get("micro_batch_size")
    require(accepts(int, micro) and micro >= 1, "schedule.micro_batch_size", "an integer >= 1",
            micro)


def validate(plain: dict[str, Any], world_size: int, device_type: str) -> RunConfig:
    """The checks on a composed config (plain data) itself, for a job of world_size ranks on
    device_type ("cpu", "cuda"); the checked, typed config. The whole check before any worker
    starts is run/preflight.py's preflight, which calls this first."""
    check_shape(plain)
    cfg = RunConfig.from_plain(plain)
    cfg.trainer.check(device_type)
    cfg.compile.check()
    cfg.noise_scale.check()
    require(accepts(int, cfg.seed) and 0 <= cfg.seed < 2**63, "seed",
            "an integer in [0, 2**63)", cfg.seed)
    require(isinstance(cfg.resume, str) and (cfg.resume in ("none", "auto")
                                             or os.path.exists(cfg.resume)), "resume",
            "none, auto, or the path of a checkpoint file or run dir", cfg.resume)
    cfg.schedule.check(world_size)
    cfg.precision.check(device_type)
    cfg.lr_scaling.check()
    return cfg
