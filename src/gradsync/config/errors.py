"""Errors as one line: a Hydra or OmegaConf exception (raised while composing the command line's
config) turned into one line naming the key and what is allowed."""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from typing import Any

from gradsync.components import ConfigError, locate, parameters, takes_any_keyword
from gradsync.config import validate
from gradsync.config.hydra import compose_command_line, node_of, schema_keys
from gradsync.config.validate import RUNTIME, runtime_arguments


def first_line(text: str) -> str:
    """The first non-blank line of text, stripped; "unknown error" if it has none."""
    return validate.first_line(text) or "unknown error"


def one_line(exc: BaseException, argv: Sequence[str] = (),
             app: Callable[..., Any] | None = None) -> str:
    """Hydra/OmegaConf errors as one line naming the key and what is allowed. argv and app: the
    command line and the entry point's Hydra app that failed to compose it (to name the
    component it chose)."""
    cause = exc.__cause__
    text = f"{exc}\n{cause}" if cause else str(exc)
    missing = re.search(r"Could not find '([^']+)/([^']+)'", text)
    if missing:
        group, option = missing.groups()
        options = re.findall(r"^\t(\S+)$", text, flags=re.M)
        return f"{group}={option}: no such option; choose one of: {', '.join(options)}"
    full_key = re.search(r"full_key: (\S+)", text)
    if full_key and re.search(r"Key '[^']+' (is )?not in", text):
        obj = re.search(r"object_type=(\w+)", text)
        key = full_key.group(1)
        group = key.split(".")[0]
        if obj and obj.group(1) == "dict" and group in RUNTIME:
            return unknown_component_key(key, argv, app)
        keys = sorted(schema_keys(obj.group(1))) if obj else []
        return f"{key}: unknown key; allowed keys: {', '.join(keys)}"
    if full_key:
        return f"{full_key.group(1)}: {str(cause or exc).strip().splitlines()[0]}"
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    return " ".join(lines[:2]) if lines else type(exc).__name__


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
    if name in getattr(target, "renamed", {}):  # an option renamed (sync/policy.py RENAMED)
        new = target.renamed[name]
        return f"{key} was renamed {group}.{new}: set {group}.{new}"
    runtime = runtime_arguments(group, node_of(cfg, "data"))
    accepted = sorted(n for n in parameters(target) if n not in runtime)
    keys = (f"; accepted keys: {', '.join(accepted)}" if accepted else ", which takes no keys")
    if "." not in name and name in runtime:
        return f"{key}: set by gradsync at run time, not in the config{keys}"
    override = next((a for a in argv if a.split("=", 1)[0].lstrip("+~") == key), key)
    if "." not in name and (name in accepted or takes_any_keyword(target)):
        return (f"{key}: not in the config of {node['_target_']}, which takes it: add it with "
                f"+{override.lstrip('+~')}")
    if name.split(".")[0] in accepted:  # a key inside a mapping argument (model.config.x)
        return (f"{key}: not in {group}.{name.split('.')[0]} of the config: add it with "
                f"+{override.lstrip('+~')}")
    return f"{key}: unknown key for {node['_target_']}{keys}"
