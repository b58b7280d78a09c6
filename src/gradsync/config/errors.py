"""Errors as one line: a Hydra or OmegaConf exception (raised while composing the command line's
config) turned into one line naming the key and what is allowed, read from the exceptions' own
fields (Hydra's MissingConfigException: the file and its group's options; OmegaConf's errors:
full_key, object_type, msg), never from their text."""

from __future__ import annotations

import dataclasses
import importlib.util
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

from hydra.errors import MissingConfigException
from omegaconf.errors import ConfigAttributeError, ConfigKeyError, OmegaConfBaseException

from gradsync.components import (
    ConfigError,
    is_node,
    locate,
    parameters,
    renamed_option,
    takes_any_keyword,
)
from gradsync.config import validate
from gradsync.config.hydra import compose_command_line, node_of
from gradsync.config.renames import renamed
from gradsync.config.validate import RUNTIME, runtime_arguments

E = TypeVar("E", bound=BaseException)

# Options an extra provides (pyproject.toml): the option a user names, the module that provides
# it, its package, the extra. conf/hydra/launcher/slurm*.yaml extend submitit's own options.
EXTRA_OPTIONS = {
    "hydra/launcher/joblib": ("joblib", "hydra_plugins.hydra_joblib_launcher",
                              "hydra-joblib-launcher", "joblib"),
    "hydra/launcher/submitit_slurm": ("slurm", "hydra_plugins.hydra_submitit_launcher",
                                      "hydra-submitit-launcher", "slurm"),
    "hydra/launcher/submitit_local": ("slurm_local", "hydra_plugins.hydra_submitit_launcher",
                                      "hydra-submitit-launcher", "slurm"),
}


def first_line(text: str) -> str:
    """The first non-blank line of text, stripped; "unknown error" if it has none."""
    return validate.first_line(text) or "unknown error"


def in_chain(exc: BaseException, kind: type[E]) -> E | None:
    """exc or the first exception of its chain of causes that is a kind (Hydra raises its own,
    from OmegaConf's: as the cause, or, composing an experiment preset, as the context)."""
    seen: BaseException | None = exc
    while seen is not None:
        if isinstance(seen, kind):
            return seen
        seen = seen.__cause__ or seen.__context__
    return None


def one_line(exc: BaseException, argv: Sequence[str] = (),
             app: Callable[..., Any] | None = None) -> str:
    """Hydra/OmegaConf errors as one line naming the key and what is allowed. argv and app: the
    command line and the entry point's Hydra app that failed to compose it (to name the
    component it chose)."""
    missing = in_chain(exc, MissingConfigException)
    where = getattr(missing, "missing_cfg_file", None) or ""
    if missing is not None and "/" in where:
        group, _, option = where.rpartition("/")
        extra = EXTRA_OPTIONS.get(f"{group}/{option}")
        if extra is not None and importlib.util.find_spec(extra[1]) is None:
            return (f"{group}={extra[0]} needs {extra[2]}: pip install "
                    f"'gradsync[{extra[3]}]'")
        return (f"{group}={option}: no such option; choose one of: "
                f"{', '.join(missing.options or [])}")
    oc = in_chain(exc, OmegaConfBaseException)
    key = getattr(oc, "full_key", None)
    if oc is not None and key:
        if isinstance(oc, (ConfigKeyError, ConfigAttributeError)):
            if renamed(key):
                return renamed(key) or key
            kind = getattr(oc, "object_type", None)
            if kind is dict and key.split(".")[0] in RUNTIME:
                return unknown_component_key(key, argv, app)
            keys = sorted(f.name for f in dataclasses.fields(kind)) \
                if isinstance(kind, type) and dataclasses.is_dataclass(kind) else []
            return f"{key}: unknown key; allowed keys: {', '.join(keys)}"
        return f"{key}: {first_line(str(oc))}"
    cause = exc.__cause__
    text = f"{exc}\n{cause}" if cause else str(exc)
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    return " ".join(lines[:2]) if lines else type(exc).__name__


def node_of_target(node: dict[str, Any]) -> Any:
    """A nested node's target, or None where it does not resolve."""
    try:
        return locate(node["_target_"])
    except (ConfigError, KeyError, TypeError):
        return None


def unknown_component_key(key: str, argv: Sequence[str], app: Callable[..., Any] | None) -> str:
    """A key a component's composed node lacks (``model.chanels=8``), named against the
    component Hydra actually composed: the command line composed again without that override
    (through --config-dir, search paths and experiment presets), its node's ``_target_`` and
    the keyword arguments that target takes."""
    group, _, name = key.partition(".")
    cfg = compose_command_line(list(argv), app, key) if app is not None else None
    node = node_of(cfg, group)
    try:
        target = locate(node["_target_"]) if node else None
    except (ConfigError, KeyError, TypeError):
        target = None
    if node is None or target is None:
        return f"{key}: unknown key for the chosen {group}"
    message = renamed_option(target, group, name)
    if message:
        return message
    runtime = runtime_arguments(group, node_of(cfg, "data"))
    accepted = sorted(n for n in parameters(target) if n not in runtime)
    keys = (f"; accepted keys: {', '.join(accepted)}" if accepted else ", which takes no keys")
    if "." not in name and name in runtime:
        return f"{key}: set by gradsync at run time, not in the config{keys}"
    override = next((a for a in argv if a.split("=", 1)[0].lstrip("+~") == key), key)
    if "." not in name and (name in accepted or takes_any_keyword(target)):
        return (f"{key}: not in the config of {node['_target_']}, which takes it: add it with "
                f"+{override.lstrip('+~')}")
    head, _, inner = name.partition(".")
    sub = node.get(head)
    if isinstance(sub, dict) and is_node(sub) and "." not in inner:  # a nested component
        nested = node_of_target(sub)
        if nested is not None and inner not in parameters(nested) \
                and not takes_any_keyword(nested):
            return (f"{key}: unknown key for {sub['_target_']}; accepted keys: "
                    f"{', '.join(sorted(n for n in parameters(nested) if n not in runtime))}")
    if head in accepted:  # a key inside a mapping argument (model.config.x)
        return (f"{key}: not in {group}.{head} of the config: add it with "
                f"+{override.lstrip('+~')}")
    return f"{key}: unknown key for {node['_target_']}{keys}"
