"""Data-parallel engines: what wraps one rank's model and carries out a sync policy's
decisions. ``base.py`` is the interface the loop talks to. Each engine's module registers it
at its end (``ENGINES = {"<name>": Registered(Class, build, Settings)}``); ``ENGINES`` here
collects them, the default engine first: each ``engine=<name>``, its class (whose
``capabilities`` the checks read), the function that builds it and its settings' dataclass
(``engine.*``: their defaults and checks; Hydra's schema for the engine is made from it). A new
engine is two files: its module here and conf/engine/<name>.yaml."""

from __future__ import annotations

import importlib
import pkgutil
from dataclasses import asdict, fields
from typing import Any

from gradsync.components import ConfigError, parameters, require
from gradsync.config.schema import EngineConfig
from gradsync.engines.base import Capabilities, Engine, Registered, Settings
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


def settings_of(engine: EngineConfig) -> Settings:
    """The run's engine settings as the engine's own dataclass (its defaults for what the config
    leaves out): a key the engine has not is one line naming the engines that have it."""
    kind = ENGINES[engine.name].settings
    allowed = [f.name for f in fields(kind)]
    for key in engine.settings:
        if key not in allowed:
            having = [n for n, r in ENGINES.items() if key in {f.name for f in fields(r.settings)}]
            where = f"a setting of engine={' or '.join(having)}, " if having else ""
            raise ConfigError(f"engine.{key}: unknown key for engine={engine.name} ({where}"
                              f"not of this engine); allowed keys: {', '.join(allowed)}")
    settings: Settings = kind(**engine.settings)
    return settings


def schemas() -> dict[str, type]:
    """Each engine's settings' dataclass, with its `name` (Hydra's schema/engine/<name>)."""
    from dataclasses import field, make_dataclass

    return {name: make_dataclass(f"{r.settings.__name__}Schema",
                                 [("name", str, field(default=name))], bases=(r.settings,))
            for name, r in ENGINES.items()}


def build_engine(name: str, policy: SyncPolicy, settings: Settings | None = None,
                 **kwargs: Any) -> Engine:
    """The engine `name` with its `settings` (None: its settings' defaults, and those of them
    given as keywords), given the run-time keywords its builder names (as components get the
    run-time arguments they name): the worker offers everything an engine may need. Of the
    policy an engine gets its two roles, never the policy: `wire` (None: the plain all-reduce)
    and `averager`."""
    if settings is None:
        kind = ENGINES[name].settings
        settings = kind(**{f.name: kwargs.pop(f.name) for f in fields(kind) if f.name in kwargs})
    kwargs |= asdict(settings) | {"wire": policy.wire or PLAIN,  # type: ignore[arg-type]
                                  "averager": policy.averager}
    builder = ENGINES[name].build
    accepted = parameters(builder)
    return builder(**{k: v for k, v in kwargs.items() if k in accepted})


def engine(model: Any, policy: SyncPolicy, name: str = "torch_ddp", *,
           device: Any = None, **settings: Any) -> Engine:
    """The engine `name` around `model` for `policy`, in a process group already initialised
    (torchrun's): one's own loop's way to gradsync's engines (docs/own-loop.md). Its settings
    as keywords (e.g. ``bucket_cap_mb=50``, ``trace_sync=True``), checked as a run checks them;
    `device`: the model's (default: where its parameters are)."""
    import torch
    import torch.distributed as dist

    from gradsync.core.memory import MemoryMeter
    from gradsync.sync.comm import CommCounts

    require(name in ENGINES, "engine", f"one of {', '.join(ENGINES)}", name)
    device = device or next(model.parameters()).device
    checked = settings_of(EngineConfig(name, settings))
    checked.check(torch.device(device).type)
    up = dist.is_available() and dist.is_initialized()
    return build_engine(name, policy, checked, model=model, device=torch.device(device),
                        world_size=dist.get_world_size() if up else 1,
                        rank=dist.get_rank() if up else 0, counts=CommCounts(),
                        memory=MemoryMeter(torch.device(device)))
