"""The sync policy contract: ``SyncPolicy``, a base class whose every member but
``should_sync`` has a no-op default (torchtune's recipe interface is the model).

For every micro-batch the loop asks ``should_sync(micro_index, window_size)``: True runs its
forward and backward synchronising (the engine all-reduces the gradients), False keeps the
gradients local (``no_sync()`` on torch's DDP). The other members let a policy choose the
all-reduce, take part in fp16's overflow handling, or keep the replicas consistent itself by
averaging parameters (local SGD). Each is called at one point of the loop, named in its
docstring; ``docs/components.md`` shows a policy of one's own.

A policy is an ordinary ``_target_`` component (conf/sync/). Write any class with
``should_sync``, or subclass ``SyncPolicy``: ``as_policy`` holds an object of a class of its own
in an ``Adopted`` (its own members first, the defaults for the rest; its class is left as it
is), so the loop and the engines can ask every policy every question.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from gradsync.components import ConfigError, kind_of
from gradsync.sync.comm import COMPRESS_HOOKS, InnerHook, ShardedSync, allreduce_in

if TYPE_CHECKING:
    from gradsync.sync.shm_allreduce import SharedSlots


# Options of sync.* renamed to say their unit (issue 29): the old name answers with a one-line
# error naming the new one. Read by the config checks through each target's `renamed`
# (components.check, config/errors.py): {old: new}, as sync.<key>.
RENAMED = {
    "sync.warmup_steps": "sync.warmup_windows",  # local SGD / DiLoCo: counts windows
    "sync.powersgd_start_step": "sync.powersgd_start_backwards",  # counts syncing backwards
}


def renamed_keys(*old: str) -> dict[str, str]:
    """A target's `renamed`: its keys' old bare names to their new ones."""
    return {o.split(".", 1)[1]: RENAMED[o].split(".", 1)[1] for o in old}


def last_micro_batch(micro_index: int, window_size: int) -> bool:
    """The boundary of accumulation: a window's last micro-batch (a short last window
    included), the one that synchronises. The one place this rule is written (the policies,
    the loop's check, the token count)."""
    return micro_index == window_size - 1


@dataclass
class OverflowCounts:
    aborted_windows: int = 0  # windows whose remaining compute was skipped: doomed by an overflow
    allreduce_skipped: int = 0  # full-gradient all-reduces (syncing backwards) those skipped
    flag_allreduces: int = 0  # one-element all-reduces: overflow consensus, found_inf agreement


class SyncPolicy:
    """Decides, micro-batch by micro-batch, whether gradients synchronise."""

    name: str = ""  # summary.json's sync_policy (default: the class name)
    # True: the policy keeps the replicas consistent itself (averaging parameters); a window may
    # then end without synchronising, and each rank keeps its own model and optimizer state
    # between averagings (checkpoints keep every rank's)
    syncs_parameters: bool = False
    # True: some parameters (and their optimizer state) differ across ranks between averagings
    # (sync.groups with `every`): checkpoints keep every rank's (implied by syncs_parameters)
    own_replicas: bool = False
    # set by after_window / finish when they averaged: this rank's drift just before,
    # ||theta_r - theta_mean|| / ||theta_mean||
    replica_drift: float | None = None
    averaging: Any = None  # counters of a policy that averages the models (summary, checkpoints)

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if not getattr(cls, "name", ""):
            cls.name = cls.__name__

    @property
    def overflow(self) -> OverflowCounts:
        """Counters of the overflow handling (fp16), per rank: in summary.json and checkpoints."""
        return self.__dict__.setdefault("_overflow", OverflowCounts())

    @overflow.setter
    def overflow(self, counts: OverflowCounts) -> None:
        self.__dict__["_overflow"] = counts

    # --- the one question every policy answers -------------------------------------------------
    def should_sync(self, micro_index: int, window_size: int) -> bool:
        """Asked before each micro-batch's forward: micro_index counts from 0 inside the current
        window of window_size micro-batches. The last micro-batch of a window must synchronise
        (the all-reduce of the accumulated gradients is what keeps the replicas equal), unless
        the policy syncs parameters itself (``syncs_parameters``)."""
        raise NotImplementedError(f"{type(self).__name__} has no should_sync")

    # --- when the engine is built ------------------------------------------------------------
    def bind(self, model: nn.Module) -> list[str]:
        """Before the engine wraps the model: the names of parameters the engine must leave
        alone (neither broadcast nor all-reduce them): the policy keeps them consistent."""
        return []

    def comm_hook(self) -> InnerHook:
        """The all-reduce the engine runs on a synchronising backward (counted around it)."""
        return allreduce_in(None)

    def sharded_sync(self, names: list[str]) -> dict[str, ShardedSync]:
        """For a sharded engine (engine=fsdp or hsdp), instead of comm_hook: how each
        named parameter's gradients are reduced. By default in the dtype of comm_hook()'s
        all-reduce, reduce-scattered (and all-reduced across HSDP replicas) on the synchronising
        micro-batches only. ConfigError if comm_hook() is an all-reduce of the policy's own,
        which a sharded engine cannot run."""
        inner = self.comm_hook()
        if inner.hook is not allreduce_in(None).hook and inner.hook not in COMPRESS_HOOKS.values():
            raise ConfigError(f"sync policy {self.name!r} all-reduces through a comm hook of its "
                              "own, which sharded engines (fsdp, hsdp) cannot run: use "
                              "engine=torch_ddp")
        return {n: ShardedSync(wire=inner.wire_dtype) for n in names}

    def use_shared_memory(self, slots: SharedSlots) -> None:
        """The run's CPU ranks all-reduce through shared memory (sync/shm_allreduce.py): a
        policy that averages by itself may do so through the same slots."""

    # --- inside a window ---------------------------------------------------------------------
    def sync_bucket(self, params: list[str]) -> bool:
        """engine=gradsync only: asked once per gradient bucket in each synchronising
        backward (params: the names of the parameters the bucket holds). False keeps that
        bucket's gradients local: they accumulate into the next synchronising backward, as
        no_sync() keeps a whole backward's. Must answer alike on every rank. A bucket kept
        local in a window's last micro-batch leaves its parameters different across ranks: the
        policy then keeps them consistent itself (own_replicas, replicas_in_sync)."""
        return True

    def window_doomed(self, model: nn.Module, micro_index: int, window_size: int) -> bool:
        """Asked after each micro-batch's backward: True (on every rank alike) when the window
        can no longer step, so its remaining micro-batches are not computed."""
        return False

    # --- at the window's end -----------------------------------------------------------------
    def agree_on_overflow(self, found_inf: list[torch.Tensor]) -> None:
        """After unscaling: may make the scaler's inf/nan flags (changed in place) identical on
        every rank. Nothing by default: after a full all-reduce every rank holds the same
        gradients, so the scaler finds the same inf/nan everywhere."""

    def after_step(self, stepped: bool) -> None:
        """After the optimizer step of a window (stepped: False when fp16 skipped it)."""

    def start(self, model: nn.Module, windows_done: int) -> None:
        """On every rank before the first window of a fresh or resumed run (after restore)."""

    def after_window(self, model: nn.Module, windows_done: int) -> None:
        """On every rank after each window's optimizer step (taken or skipped); windows_done
        counts the windows completed so far, the same on every rank."""

    def finish(self, model: nn.Module) -> None:
        """At the end of training, before the final evaluation and checkpoint."""

    def replicas_in_sync(self) -> bool:
        """Whether every rank holds the same parameters now (trainer.check_replicas asks)."""
        return not self.syncs_parameters

    def local_step(self) -> bool:
        """Asked at each window's first micro-batch (by the loss normaliser): True when the
        window's optimizer step is this rank's own (no gradient all-reduce) and more local steps
        follow before the replicas are averaged (local SGD with H > 1 after its warm-up): the
        loss is then divided by this rank's own count, and a rank without a real sample in the
        window does not step (train/normalize.py). False by default: every rank's step is part
        of one step of the global mean."""
        return False


def decides_per_bucket(policy: SyncPolicy) -> bool:
    """The policy answers sync_bucket itself: only engine=gradsync can carry that out."""
    return _own(policy.sync_bucket, SyncPolicy.sync_bucket)


# What a policy of a class of its own may define besides should_sync: whatever of these it has
# is called, the base class's default otherwise (the contract page, docs/components.md).
OPTIONAL = ("bind", "comm_hook", "sharded_sync", "use_shared_memory", "sync_bucket",
            "window_doomed", "agree_on_overflow", "after_step", "start", "after_window", "finish",
            "replicas_in_sync", "local_step", "state_dict", "load_state_dict")


class Adopted(SyncPolicy):
    """A policy of a class of its own (no SyncPolicy subclass), held, not changed: its
    should_sync and whichever OPTIONAL members it defines, SyncPolicy's defaults for the rest.
    Attributes it sets itself (syncs_parameters, own_replicas, replica_drift, averaging) are
    read from it."""

    def __init__(self, policy: Any):
        self.policy = policy
        self.name = getattr(policy, "name", "") or type(policy).__name__
        self.should_sync = policy.should_sync  # type: ignore[method-assign]
        for member in OPTIONAL:
            if callable(getattr(policy, member, None)):
                setattr(self, member, getattr(policy, member))

    @property
    def syncs_parameters(self) -> bool:  # type: ignore[override]
        return bool(getattr(self.policy, "syncs_parameters", False))

    @property
    def own_replicas(self) -> bool:  # type: ignore[override]
        return bool(getattr(self.policy, "own_replicas", False))

    @property
    def replica_drift(self) -> float | None:  # type: ignore[override]
        return getattr(self.policy, "replica_drift", None)

    @property
    def averaging(self) -> Any:  # type: ignore[override]
        return getattr(self.policy, "averaging", None)


def as_policy(obj: Any, target: str = "sync") -> SyncPolicy:
    """A built sync component as a SyncPolicy: an instance of a subclass as it is, an object of
    a class of its own held by an ``Adopted`` (its class and its object are left as they are).
    ConfigError when it cannot be a policy: no ``should_sync(micro_index, window_size)``."""
    if not isinstance(obj, SyncPolicy):
        if not callable(getattr(obj, "should_sync", None)):
            raise ConfigError(f"sync ({target}): returned {kind_of(obj)}, which is no sync policy: "
                              "a sync policy has a method should_sync(micro_index, window_size) "
                              "-> bool (or subclass gradsync.sync.policy.SyncPolicy)")
        obj = Adopted(obj)
    check_should_sync(obj, target)
    return obj


def _own(method: Any, default: Any) -> bool:
    """A policy's member is its own (not SyncPolicy's default), for a subclass's method and for
    one an Adopted holds alike."""
    return getattr(method, "__func__", method) is not default


def check_should_sync(policy: SyncPolicy, target: str) -> None:
    """should_sync is implemented and callable as should_sync(micro_index, window_size)."""
    if not _own(policy.should_sync, SyncPolicy.should_sync):
        raise ConfigError(f"sync ({target}): {type(policy).__qualname__} has no should_sync("
                          "micro_index, window_size) -> bool, the one method a policy needs")
    owner = type(policy.policy if isinstance(policy, Adopted) else policy).__qualname__
    try:
        inspect.signature(policy.should_sync).bind(0, 1)
    except TypeError:
        raise ConfigError(f"sync ({target}): {owner}.should_sync"
                          f"{inspect.signature(policy.should_sync)} cannot be called as "
                          "should_sync(micro_index, window_size)") from None
    except ValueError:  # no signature to read (a builtin): let it be called
        pass
