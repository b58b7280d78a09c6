"""Data-parallel engines: what wraps one rank's model and carries out a sync policy's
decisions. ``base.py`` is the interface the loop talks to; ``ENGINES`` maps each
``trainer.engine`` name to the function that builds it."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from gradsync.components import parameters
from gradsync.engines.base import Engine
from gradsync.engines.fsdp import build_fsdp, build_hsdp
from gradsync.engines.gradsync_ddp import build_gradsync_ddp
from gradsync.engines.torch_ddp import build_torch_ddp

ENGINES: dict[str, Callable[..., Engine]] = {"torch_ddp": build_torch_ddp,
                                             "gradsync": build_gradsync_ddp,
                                             "fsdp": build_fsdp, "hsdp": build_hsdp}


def build_engine(name: str, **kwargs: Any) -> Engine:
    """The engine `name`, given the keywords its builder names (as components get the run-time
    arguments they name): the worker offers every trainer setting an engine may need."""
    builder = ENGINES[name]
    accepted = parameters(builder)
    return builder(**{k: v for k, v in kwargs.items() if k in accepted})
