"""Data-parallel engines: what wraps one rank's model and carries out a sync policy's
decisions. ``base.py`` is the interface the loop talks to. Each engine's module registers it
at its end (``ENGINES = {"<name>": Registered(Class, build)}``); ``ENGINES`` here collects
them, the default engine first: each ``engine=<name>``, its class (whose ``capabilities`` the
checks read) and the function that builds it. A new engine is two files: its module here and
conf/engine/<name>.yaml (plus its row in docs/configuration.md, which tests/test_docs.py asks
for)."""

from __future__ import annotations

import importlib
import pkgutil
from typing import Any

from gradsync.components import parameters, require
from gradsync.config.schema import EngineConfig
from gradsync.engines.base import Capabilities, Engine, Registered
from gradsync.sync.comm import PLAIN
from gradsync.sync.policy import SyncPolicy


def _collect() -> dict[str, Registered]:
    """Every module's ENGINES, in module order, the schema's default engine first."""
    found: dict[str, Registered] = {}
    for module in pkgutil.iter_modules(__path__):
        if module.name != "__main__":
            for name, registered in getattr(importlib.import_module(f"{__name__}.{module.name}"),
                                            "ENGINES", {}).items():
                assert name not in found, f"engine {name!r} is registered twice"
                found[name] = registered
    default = EngineConfig().name
    return {default: found.pop(default)} | found


ENGINES: dict[str, Registered] = _collect()


def capabilities(name: str) -> Capabilities:
    """What engine `name` can carry out; a name no engine has: a one-line ConfigError."""
    require(name in ENGINES, "engine.name", f"one of {', '.join(ENGINES)}", name)
    caps: Capabilities = ENGINES[name].engine.capabilities
    return caps


def able(capability: str) -> list[str]:
    """The engines that have `capability` (a Capabilities field), for messages."""
    return [name for name, r in ENGINES.items() if getattr(r.engine.capabilities, capability)]


def build_engine(name: str, policy: SyncPolicy, **kwargs: Any) -> Engine:
    """The engine `name`, given the keywords its builder names (as components get the run-time
    arguments they name): the worker offers every trainer setting an engine may need. Of the
    policy an engine gets its two roles, never the policy: `wire` (None: the plain all-reduce)
    and `averager`."""
    kwargs |= {"wire": policy.wire or PLAIN, "averager": policy.averager}
    builder = ENGINES[name].build
    accepted = parameters(builder)
    return builder(**{k: v for k, v in kwargs.items() if k in accepted})
