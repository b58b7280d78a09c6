"""Errors as one line: a Hydra or OmegaConf exception (raised while composing the command line's
config) turned into one line naming the key and what is allowed."""

from __future__ import annotations

import re
import sys
from pathlib import Path

from gradsync.config.hydra import CONF_DIR, schema_keys
from gradsync.config.validate import RUNTIME, accepted_keys


def first_line(text: str) -> str:
    lines = [line.strip() for line in text.strip().splitlines() if line.strip()]
    return " ".join(lines[:1]) or "unknown error"


def one_line(exc: BaseException) -> str:
    """Hydra/OmegaConf errors as one line naming the key and what is allowed."""
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
        group = full_key.group(1).split(".")[0]
        if obj and obj.group(1) == "dict" and group in RUNTIME:
            node = _chosen_option(group)
            return (f"{full_key.group(1)}: unknown key for {node.get('_target_')}; accepted "
                    f"keys: {accepted_keys(group, node)}")
        keys = sorted(schema_keys(obj.group(1))) if obj else []
        return f"{full_key.group(1)}: unknown key; allowed keys: {', '.join(keys)}"
    if full_key:
        return f"{full_key.group(1)}: {str(cause or exc).strip().splitlines()[0]}"
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    return " ".join(lines[:2]) if lines else type(exc).__name__


def _chosen_option(group: str) -> dict:
    """The YAML of a component group's option chosen on the command line (else the default):
    for an error message about one of its keys."""
    import yaml

    option = next((a.partition("=")[2] for a in sys.argv[1:] if a.startswith(f"{group}=")),
                  None)
    if option is None:
        defaults = yaml.safe_load((Path(CONF_DIR) / "config.yaml").read_text())["defaults"]
        option = next((d[group] for d in defaults if isinstance(d, dict) and group in d), "")
    path = Path(CONF_DIR) / group / f"{option}.yaml"
    try:
        return yaml.safe_load(path.read_text()) or {}
    except (OSError, ValueError):
        return {}


