"""Parameters that got no gradient in a synchronising backward: one line on every engine.

Without ``engine.find_unused_parameters`` every parameter that trains must get a gradient in
every synchronising backward (what accumulated in the window's no_sync micro-batches does not
count: the engines reduce what the synchronising backward hands them). Left alone, each engine
fails its own way: torch's DDP one forward later, with a message that names no parameter (and
the optimizer has already stepped on gradients some of whose buckets never went out); FSDP2
reduce-scatters only the gradients it has, so ranks that miss different parameters send
tensors of different sizes and gloo aborts the process (SIGABRT). Each engine therefore checks
at the end of the synchronising backward (FSDP: before each unit's reduce-scatter) and raises
``UnusedParameters``: one line naming the parameters and the option.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable

import torch
import torch.distributed as dist

OPTION = "engine.find_unused_parameters=true"


class UnusedParameters(RuntimeError):
    """A synchronising backward left parameters without a gradient (one line)."""


def unused_error(names: list[str], why: str) -> UnusedParameters:
    """The error for this rank's `names`; why: what the engine would do with them."""
    rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
    shown = ", ".join(names[:8]) + (" ..." if len(names) > 8 else "")
    return UnusedParameters(
        f"rank {rank}: {len(names)} parameter(s) got no gradient in this synchronising "
        f"backward: {shown}; the forward did not use them, so {why}. Set {OPTION}, or leave "
        "them out of the model (docs/debugging.md)")


class GradientWitness:
    """Which of `named` parameters got a gradient since ``start()`` (post-accumulate-grad
    hooks: they fire once a parameter's gradient of this backward is accumulated)."""

    def __init__(self, named: Iterable[tuple[str, torch.Tensor]]):
        pairs = [(n, p) for n, p in named if p.requires_grad]
        self.names = [n for n, _ in pairs]
        self.fired = bytearray(len(pairs))
        for i, (_, p) in enumerate(pairs):
            p.register_post_accumulate_grad_hook(functools.partial(self._fired, i))

    def _fired(self, index: int, param: torch.Tensor) -> None:
        self.fired[index] = 1

    def start(self) -> None:
        self.fired = bytearray(len(self.names))

    def missing(self) -> list[str]:
        return [n for n, f in zip(self.names, self.fired, strict=True) if not f]
