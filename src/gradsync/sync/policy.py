"""The sync policy contract: ``SyncPolicy``, whose one method is ``should_sync`` (torchtune's
recipe interface is the model).

For every micro-batch the loop asks ``should_sync(micro_index, window_size)``: True runs its
forward and backward synchronising (the engine all-reduces the gradients), False keeps the
gradients local (``no_sync()`` on torch's DDP). That is the whole contract of a policy. What a
policy may add comes in two optional roles, each handed directly to the part that calls it:

- ``wire`` (sync/comm.py ``Wire``), given to the engine: what the gradients cross the wire as
  (a wire dtype, PowerSGD factors, per-group rules, per-bucket decisions). None: the plain
  all-reduce (``PLAIN``).
- ``averager`` (sync/averaging.py ``Averager``), given to the loop: it keeps the replicas
  consistent by averaging parameters after windows (local SGD, DiLoCo, sync.groups with
  `every`). None: the gradient all-reduce keeps the replicas equal.

fp16's overflow handling is the precision's (train/precision.py), not the policy's.
``docs/components.md`` shows a policy of one's own.

A policy is an ordinary ``_target_`` component (conf/sync/). Write any class with
``should_sync``, or subclass ``SyncPolicy``: ``as_policy`` holds an object of a class of its own
in an ``Adopted`` (its should_sync, wire and averager; its class is left as it is).
"""

from __future__ import annotations

import inspect
from typing import Any

from gradsync.components import ConfigError, kind_of
from gradsync.sync.averaging import Averager
from gradsync.sync.comm import Wire

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


class SyncPolicy:
    """Decides, micro-batch by micro-batch, whether gradients synchronise."""

    name: str = ""  # summary.json's sync_policy (default: the class name)
    wire: Wire | None = None  # the engine's role (None: the plain all-reduce, comm.PLAIN)
    averager: Averager | None = None  # the loop's role (None: no averaging of parameters)

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if not getattr(cls, "name", ""):
            cls.name = cls.__name__

    def should_sync(self, micro_index: int, window_size: int) -> bool:
        """Asked before each micro-batch's forward: micro_index counts from 0 inside the current
        window of window_size micro-batches. The last micro-batch of a window must synchronise
        (the all-reduce of the accumulated gradients is what keeps the replicas equal), unless
        the policy's averager keeps the whole model consistent (``Averager.whole_model``)."""
        raise NotImplementedError(f"{type(self).__name__} has no should_sync")


# What gradsync reads of a policy besides should_sync, each optional (the contract page,
# docs/components.md, lists exactly these): its name, its two roles, and state_dict /
# load_state_dict, which checkpoints call on any component that has them.
OPTIONAL = ("name", "wire", "averager", "state_dict", "load_state_dict")
# The members of each role that gradsync calls (docs/components.md: one table per role).
WIRE = ("bind", "comm_hook", "sharded_sync", "sync_bucket", "after_step", "overflow_consensus")
AVERAGER = ("whole_model", "drift", "counters", "use_shared_memory", "start", "after_step",
            "after_window", "finish", "in_sync", "local_step", "state_dict", "load_state_dict")


# What gradsync once called on a policy itself and now calls on a role (or on the precision):
# a policy of one's own written to the earlier contract is refused in one line naming where
# the member went, never silently not called.
MOVED = {
    **{m: "the averager role (sync/averaging.py Averager)" for m in (
        "start", "after_window", "finish", "in_sync", "local_step", "drift", "counters",
        "whole_model", "use_shared_memory")},
    "replicas_in_sync": "the averager role, as its in_sync (sync/averaging.py Averager)",
    "syncs_parameters": "the averager role, as its whole_model (sync/averaging.py Averager)",
    "own_replicas": "the averager role, as its whole_model (sync/averaging.py Averager)",
    "replica_drift": "the averager role, as its drift (sync/averaging.py Averager)",
    "averaging": "the averager role, as its counters (sync/averaging.py Averager)",
    **{m: "the wire role (sync/comm.py Wire)" for m in (
        "bind", "comm_hook", "sharded_sync", "sync_bucket", "overflow_consensus")},
    "after_step": "the wire role or the averager role (sync/comm.py Wire, sync/averaging.py "
                  "Averager)",
    **{m: "the precision (train/precision.py; a wire asks for it with overflow_consensus = "
          "True)" for m in ("window_doomed", "agree_on_overflow", "overflow")},
}


def refuse_moved_members(owner: Any, target: str) -> None:
    """A member of the earlier contract on the policy's own class: one line naming the role it
    moved to (a member the policy holds as its own role, local SGD's averager being the policy
    itself, is that role's)."""
    kind = type(owner)
    own_roles = {role for role in ("wire", "averager") if getattr(owner, role, None) is owner}
    for member, where in MOVED.items():
        if hasattr(kind, member) and not hasattr(SyncPolicy, member) and \
                not any(role in where for role in own_roles):
            raise ConfigError(f"sync ({target}): {kind.__qualname__}.{member} is no longer "
                              f"called on a policy: it moved to {where}; give the policy that "
                              "role (docs/components.md)")


class Adopted(SyncPolicy):
    """A policy of a class of its own (no SyncPolicy subclass), held, not changed: its
    should_sync, its name, wire and averager if it has them (read from it), and its state_dict
    / load_state_dict if it has those."""

    def __init__(self, policy: Any):
        self.policy = policy
        self.name = getattr(policy, "name", "") or type(policy).__name__
        self.should_sync = policy.should_sync  # type: ignore[method-assign]
        for member in ("state_dict", "load_state_dict"):
            if callable(getattr(policy, member, None)):
                setattr(self, member, getattr(policy, member))

        # its roles, read once: the engine and the loop are given them when the run starts
        self.wire = getattr(policy, "wire", None)
        self.averager = getattr(policy, "averager", None)


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
    refuse_moved_members(obj.policy if isinstance(obj, Adopted) else obj, target)
    check_should_sync(obj, target)
    for role, base in (("wire", Wire), ("averager", Averager)):
        held = getattr(obj, role)
        if held is not None and not isinstance(held, base):
            raise ConfigError(f"sync ({target}): {role} is {kind_of(held)}, not a "
                              f"{base.__module__}.{base.__qualname__} (subclass it) or None")
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
