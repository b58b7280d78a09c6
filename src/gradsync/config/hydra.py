"""Hydra's side of the config: the schemas of the groups with a fixed shape in its ConfigStore
(``schema/<group>/<option>``; their YAML files extend them and state only what differs, so a
wrong type or an unknown key fails at composition), where the YAML files are, composition, and
the overrides gradsync rewrites before Hydra reads them. Only this package and the entry point
(run/main.py) import Hydra or OmegaConf.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING, DictConfig, OmegaConf

from gradsync.config.schema import SCHEMA_GROUPS, LossConfig, TrainerConfig


@dataclass
class Config:
    model: Any = MISSING
    optimizer: Any = MISSING
    schedule: Any = MISSING
    sync: Any = MISSING
    precision: Any = MISSING
    data: Any = MISSING
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    lr_scheduler: Any = MISSING
    loss: LossConfig = field(default_factory=LossConfig)
    lr_scaling: Any = MISSING
    seed: int = 0
    resume: str = "none"  # none | auto | a checkpoint file or run dir


SCHEMAS_BY_NAME: dict[str, type] = {
    cls.__name__: cls for options in SCHEMA_GROUPS.values() for cls in options.values()
} | {"Config": Config}


def register_configs() -> None:
    cs = ConfigStore.instance()
    cs.store(name="schema_config", node=Config)
    for group, options in SCHEMA_GROUPS.items():
        for option, cls in options.items():
            cs.store(group=f"schema/{group}", name=option, node=cls)


def to_plain(cfg: DictConfig) -> dict[str, Any]:
    """Resolve interpolations and drop OmegaConf types: plain, picklable data."""
    plain = OmegaConf.to_container(cfg, resolve=True, throw_on_missing=True)
    assert isinstance(plain, dict)
    return plain  # type: ignore[return-value]


def schema_keys(type_name: str) -> list[str]:
    cls = SCHEMAS_BY_NAME.get(type_name)
    return [f.name for f in fields(cls)] if cls else []


def conf_dir() -> str:
    """The configs: the repo's top-level conf/ when running from a source checkout (an editable
    install: people read and edit them there), else the copy shipped inside the package."""
    repo_conf = Path(__file__).resolve().parents[3] / "conf"
    if (repo_conf / "config.yaml").is_file():
        return str(repo_conf)
    return str(Path(__file__).resolve().parents[1] / "conf")


CONF_DIR = conf_dir()

# Mappings an override replaces whole (Hydra merges `key={...}` into the existing mapping, and
# refuses a new key of it in struct mode): `key={0:2,3:8}` becomes `key=null ++key={0:2,3:8}`.
REPLACED_MAPPINGS = ("schedule.accum_steps_by_epoch",)


def replace_mappings(overrides: list[str]) -> list[str]:
    out = []
    for arg in overrides:
        key, _, value = arg.partition("=")
        if key in REPLACED_MAPPINGS and value.startswith("{") and value.endswith("}") \
                and "},{" not in value.replace(" ", ""):
            out += [f"{key}=null", f"++{key}={value}"]
        else:
            out.append(arg)
    return out


def compose(overrides: list[str], config_dir: str | None = None) -> DictConfig:
    """The config the command line composes from these overrides, outside a Hydra job (the
    resolvers the config uses must be registered: run/main.py register_resolvers)."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir

    register_configs()
    with initialize_config_dir(config_dir=config_dir or CONF_DIR, version_base="1.3"):
        return hydra_compose("config", overrides=replace_mappings(overrides))
