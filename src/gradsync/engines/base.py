"""The engine interface: what the training loop asks of a data-parallel engine.

An engine wraps one rank's model and carries out the sync policy's decision for each
micro-batch. The loop never sees the wrapper class (torch's ``DistributedDataParallel``,
gradsync's own engine, FSDP2's ``fully_shard`` units): it calls the engine as the model,
runs each micro-batch's forward *and* backward inside ``engine.micro_batch(sync)``, steps the
optimizer on ``engine.parameters()``, lets the engine zero the gradients, and asks it for the
model to evaluate and to average, and for the model's state to save and restore.

One micro-batch, as the loop runs it (train/loop.py run_window)::

    sync = policy.should_sync(i, window.size)
    with engine.micro_batch(sync):          # torch_ddp: no_sync() when not sync
        out = engine(x)                     # the forward decides whether the backward syncs
        loss(out, y).backward()             # a syncing backward all-reduces (the comm hook)

An engine is built by a function its module registers (``ENGINES = {name: Registered(class,
build)}`` at the module's end; ``gradsync.engines`` collects them) under its name
(``engine=<name>``, conf/engine/<name>.yaml), beside its class, whose ``capabilities`` say what
it can carry out (the checks before any worker starts and the worker read those, never the
engine's name). It is built from the model, the policy's wire (sync/comm.py ``Wire``: its
``bind`` names the parameters the engine must leave alone, its ``comm_hook`` is the all-reduce
to run, ``sharded_sync`` a sharded engine's reductions, ``sync_bucket`` per-bucket decisions)
and averager (``whole_model``: buffers left to it; the shared-memory slots), the rank's
placement and the engine settings (``engine.*``); it counts what it puts on the wire in the
run's ``CommCounts``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any, NamedTuple, Protocol

import torch
from torch import nn

from gradsync.core.memory import MemoryMeter
from gradsync.engines.compiled import Compile
from gradsync.engines.trace import SyncTrace
from gradsync.sync.comm import CommCounts


@dataclass(frozen=True)
class Capabilities:
    """What an engine can carry out, declared on its class (``capabilities``): every check of
    another choice against the engine, and the worker's choices (checkpoint format), ask these."""

    # parameters sharded over the ranks (FSDP2): sharded checkpoints (torch.distributed.checkpoint),
    # sync.reduce_scatter, engine-specific checks (engines/fsdp.py check_config)
    sharded: bool = False
    # a replicate dimension across shard groups (engine.replicas): HSDP
    replicas: bool = False
    # carries out a policy's per-bucket decisions (sync_bucket): gradsync's own DDP
    per_bucket: bool = False
    # all-reduces inside gradsync's counting hook (sync/comm.py), where the noise scale's
    # gradient probe is taken
    gradient_probe: bool = False
    # engine.trace_sync's recorder (engines/trace.py) and engine.sync_batchnorm: the DDP engines
    trace_sync: bool = False
    sync_batchnorm: bool = False
    # engine.allreduce=shared_memory: CPU ranks of one host all-reduce through shared memory
    shared_memory: bool = False
    # the smallest engine.bucket_cap_mb with compile.enabled=true (torch's DDPOptimizer: its
    # first bucket, no larger than the others); 0: any
    compile_min_bucket_mb: float = 0.0


class Engine(Protocol):
    name: str  # engine=<name>
    capabilities: Capabilities  # on the class: what it can carry out (the checks read these)
    # The model itself (no wrapper): what is evaluated, what a policy averages and inspects
    # (local SGD's anchor, overflow consensus), whose parameter names checkpoints keep.
    module: nn.Module
    counts: CommCounts  # what crossed the wire: the engine's all-reduces and a policy's own
    transport: str  # how the gradients travel: process_group | shared_memory
    trace: SyncTrace | None  # engine.trace_sync's recorder (engines/trace.py), or None
    compiled: Compile | None  # compile.enabled: how, and its graphs and seconds (compiled.py)
    # the gradient bytes held (the engine records them on leaving micro_batch(), or once per
    # window in zero_grad() where they only accumulate) and the rank's peak memory (memory.py)
    memory: MemoryMeter

    def __call__(self, *inputs: Any, **kwargs: Any) -> Any:
        """The forward of one micro-batch (inside micro_batch()), with the model's own
        keyword arguments (models.ModelCall: the targets, where the model takes them)."""
        ...

    def micro_batch(self, sync: bool) -> AbstractContextManager[Any]:
        """The context one micro-batch's forward and backward run in: with sync False its
        gradients stay local and accumulate; with sync True the backward synchronises them
        (and whatever accumulated before) over the ranks."""
        ...

    def parameters(self) -> Iterator[nn.Parameter]:
        """What the optimizer steps, clipping measures and the loss normaliser rescales."""
        ...

    def align_buffers(self) -> None:
        """Collective, before each evaluation and each checkpoint: rank 0's buffers on every
        rank (engines/buffers.py), so the model evaluated is the model saved; an averager of
        the whole model keeps each rank's own."""
        ...

    def zero_grad(self, optimizer: torch.optim.Optimizer) -> None:
        """After each optimizer step: gradients zeroed (or set to None) as the engine needs."""
        ...

    def state_dict(self) -> dict[str, Any]:
        """The model's state, as checkpoints keep it (the module's parameter names)."""
        ...

    def load_state_dict(self, state: dict[str, Any]) -> None:
        ...

    def describe(self) -> dict[str, Any]:
        """What the engine all-reduces and how: summary.json's `engine` entry."""
        ...


class Settings(Protocol):
    """An engine's settings (``engine.*``): a dataclass its module owns, with defaults; Hydra's
    schema for ``engine=<name>`` is made from it (run/main.py), so conf/engine/<name>.yaml
    states only what differs."""

    def check(self, device_type: str) -> None:
        """Its values for ranks computing on device_type (cpu, cuda): one-line ConfigErrors,
        before any worker starts."""
        ...


class Registered(NamedTuple):
    """One engine as its module registers it: ``ENGINES = {"<name>": Registered(Class, build,
    Settings)}`` at the module's end, the name being ``engine=<name>`` (conf/engine/<name>.yaml).
    A new engine is its module and that YAML."""

    engine: type[Engine]  # the class: its capabilities
    # given its settings and the run-time keywords it names (gradsync.engines.build_engine)
    build: Callable[..., Engine]
    settings: type  # its settings' dataclass (Settings)
