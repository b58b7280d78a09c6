"""Data-parallel engines: what wraps one rank's model and carries out a sync policy's
decisions. ``base.py`` is the interface the loop talks to; ``ENGINES`` is the one list of
engines: each ``engine=<name>``, its class (whose ``capabilities`` the checks read) and the
function that builds it. A new engine is its module and one line here."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

from gradsync.components import parameters, require
from gradsync.engines.base import Capabilities, Engine
from gradsync.engines.fsdp import FSDPEngine, HSDPEngine, build_fsdp, build_hsdp
from gradsync.engines.gradsync_ddp import GradsyncDDP, build_gradsync_ddp
from gradsync.engines.torch_ddp import TorchDDP, build_torch_ddp
from gradsync.sync.comm import PLAIN
from gradsync.sync.policy import SyncPolicy


class Registered(NamedTuple):
    engine: type[Engine]  # the class: its capabilities
    build: Callable[..., Engine]


ENGINES: dict[str, Registered] = {
    "torch_ddp": Registered(TorchDDP, build_torch_ddp),
    "gradsync": Registered(GradsyncDDP, build_gradsync_ddp),
    "fsdp": Registered(FSDPEngine, build_fsdp),
    "hsdp": Registered(HSDPEngine, build_hsdp),
}


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
