"""Configs composed by Hydra exactly as the command line composes them, for runs on the pool
that are compared with runs through the command line."""

from __future__ import annotations

from hydra import compose, initialize_config_dir

from gradsync.config import register_configs, to_plain, validate
from gradsync.train import CONF_DIR

register_configs()


def plain_cfg(overrides: list[str]) -> dict:
    with initialize_config_dir(config_dir=CONF_DIR, version_base="1.3"):
        cfg = to_plain(compose("config", overrides=overrides))
    validate(cfg, cuda_available=False)
    return cfg


def losses(rows: list[dict]) -> list[tuple]:
    """What must match bitwise in metrics.jsonl: everything a row holds except its timing."""
    return [(r["step"], r["epoch"], r["samples"], r["lr"], r["loss"]) for r in rows]
