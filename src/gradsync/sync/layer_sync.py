"""Per-layer sync control: ``sync.groups``, an ordered list of rules over parameter names, first
match wins. Each rule is ``{params: <glob>|<glob>, comm_dtype: fp32|bf16|fp16, every: K,
name: <label>}``:

- ``comm_dtype``: the wire dtype of the group's gradient all-reduce (default: the policy's);
- ``every: K``: the group's gradients are never all-reduced: DDP leaves its parameters alone
  (``_set_params_and_buffers_to_ignore_for_model``) and every K windows they are averaged over
  ranks with the same mechanism as local SGD (``averaging.average_``, fp32), and once more when
  the run ends. Optimizer state stays per rank (checkpoints keep each rank's, train/state.py).

- ``reduce_scatter: boundary|every`` and ``replica_all_reduce: boundary|every``: on a sharded
  engine (engine=fsdp or hsdp), how the group's units accumulate between synchronising
  micro-batches (sync/comm.py ``ShardedSync``; default: the policy's); docs/sharded.md.

Parameters no rule matches (the group ``rest``) follow the policy. Inside one DDP bucket the
gradients of different wire dtypes go out in one all-reduce per dtype (``grouped_allreduce``);
when every synchronised parameter shares one wire dtype the policy's own single all-reduce runs,
through the shared-memory transport where it applies. Counted per group: the all-reduces that
carried some of the group's tensors and the bytes of the group's tensors in them.
"""

from __future__ import annotations

import difflib
from collections.abc import Iterable
from dataclasses import dataclass, replace
from fnmatch import fnmatchcase
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from gradsync.components import CheckContext, ConfigError, require
from gradsync.core.dtypes import DTYPES
from gradsync.sync.averaging import Averager, average_
from gradsync.sync.comm import (
    FLAVOURS,
    CommCounts,
    InnerHook,
    ShardedSync,
    Traffic,
    Wire,
    allreduce_in,
    check_flavours,
)

REST = "rest"  # the parameters no rule matches
# sync.groups as a policy receives it (a list from the config; the signature's default is ())
Rules = list[dict[str, Any]] | tuple[dict[str, Any], ...]
RULE_KEYS = ("params", "comm_dtype", "every", "name", "reduce_scatter", "replica_all_reduce")
SHOWN_NAMES = 24  # parameter names an error lists at most (closest first)


@dataclass(frozen=True)
class Rule:
    name: str
    params: str
    comm_dtype: str | None = None  # None: the policy's wire dtype
    every: int | None = None  # None: gradients all-reduced; K: parameters averaged every K windows
    reduce_scatter: str | None = None  # sharded engines; None: the policy's
    replica_all_reduce: str | None = None  # HSDP; None: the policy's

    def matches(self, param: str) -> bool:
        return any(fnmatchcase(param, p.strip()) for p in self.params.split("|"))

    def closeness(self, param: str) -> float:
        return max(difflib.SequenceMatcher(None, p.strip().replace("*", ""), param).ratio()
                   for p in self.params.split("|"))

    def describe(self, base: str) -> str:
        if self.every is not None:
            return f"averaged every {self.every} windows (fp32)"
        sharded = [f"{key}={value}" for key, value in (("reduce_scatter", self.reduce_scatter),
                   ("replica_all_reduce", self.replica_all_reduce)) if value is not None]
        return f"{self.comm_dtype or base} all-reduce" + "".join(f", {s}" for s in sharded)


def parse_rules(groups: Any) -> list[Rule]:
    """The rules of sync.groups, or a ConfigError naming the rule and the key."""
    require(isinstance(groups, (list, tuple)), "sync.groups",
            "a list of rules {params: <glob>, comm_dtype: ..., every: ...}", groups)
    rules: list[Rule] = []
    for i, g in enumerate(groups):
        key = f"sync.groups[{i}]"
        require(isinstance(g, dict), key, "a mapping {params: <glob>, comm_dtype, every, name}", g)
        unknown = sorted(set(g) - set(RULE_KEYS))
        if unknown:
            raise ConfigError(f"{key}.{unknown[0]}: unknown key; accepted keys: "
                              f"{', '.join(RULE_KEYS)}")
        params = g.get("params")
        require(isinstance(params, str) and all(p.strip() for p in params.split("|")),
                f"{key}.params", "a glob over parameter names, '|' between alternatives "
                "(e.g. '*.bias|*norm*')", params)
        dtype = g.get("comm_dtype")
        require(dtype is None or dtype in DTYPES, f"{key}.comm_dtype",
                f"one of {', '.join(DTYPES)}", dtype)
        every = g.get("every")
        require(every is None or (isinstance(every, int) and not isinstance(every, bool)
                                  and every >= 1), f"{key}.every",
                "an integer >= 1 (windows between averagings of the group's parameters)", every)
        if every is not None and dtype not in (None, "fp32"):
            raise ConfigError(f"{key}: every={every} averages the parameters themselves, in "
                              f"fp32 (a {dtype} wire would round the weights): drop comm_dtype "
                              "or set it to fp32")
        for flavour in ("reduce_scatter", "replica_all_reduce"):
            value = g.get(flavour)
            require(value is None or value in FLAVOURS, f"{key}.{flavour}",
                    f"one of {', '.join(FLAVOURS)} (sharded engines: docs/sharded.md)", value)
            if value is not None and every is not None:
                raise ConfigError(f"{key}: every={every} averages the parameters instead of "
                                  f"reducing their gradients: drop {flavour}")
        name = g.get("name", params)
        require(isinstance(name, str) and bool(name) and name != REST and "/" not in name,
                f"{key}.name", f"a label other than {REST!r}, without '/'", name)
        if any(r.name == name for r in rules):
            raise ConfigError(f"{key}.name={name!r} is not allowed: another rule has this "
                              "name (names label the counts)")
        rules.append(Rule(name, params, dtype, every, g.get("reduce_scatter"),
                          g.get("replica_all_reduce")))
    return rules


def assign(rules: list[Rule], names: Iterable[str]) -> dict[str, Rule | None]:
    """Each parameter's rule: the first that matches, None for the rest."""
    return {n: next((r for r in rules if r.matches(n)), None) for n in names}


def check_every_rule_matches(rules: list[Rule], names: list[str]) -> None:
    taken = assign(rules, names)
    for i, rule in enumerate(rules):
        if any(r is rule for r in taken.values()):
            continue
        shadowed = any(rule.matches(n) for n in names)
        closest = sorted(names, key=lambda n: -rule.closeness(n))
        shown = ", ".join(closest[:SHOWN_NAMES])
        more = (f" (and {len(names) - SHOWN_NAMES} more; +inspect=params lists them)"
                if len(names) > SHOWN_NAMES else "")
        why = ("matches only parameters an earlier rule takes (first match wins)" if shadowed
               else "matches no parameter of the model")
        raise ConfigError(f"sync.groups[{i}].params={rule.params!r} {why}; the model's "
                          f"parameters, closest first: {shown}{more}")


# A model's parameters as (name, shape, dtype): what the checks and +inspect=params look at
# (run/inspect.py).
ParamInfo = tuple[str, tuple[int, ...], torch.dtype]


def parameter_infos(model: nn.Module) -> list[ParamInfo]:
    """The model's named parameters as (name, shape, dtype)."""
    return [(n, tuple(p.shape), p.dtype) for n, p in model.named_parameters()]


def check_wire_precision(comm_dtype: str | None, precision: str, key: str) -> None:
    """The one rule between a wire dtype and the precision: an fp16 wire needs fp16's
    GradScaler (the policy's sync.comm_dtype and each sync.groups rule's)."""
    if comm_dtype == "fp16" and precision != "fp16":
        raise ConfigError(f"{key}='fp16' needs precision=fp16, not {precision!r}: only its "
                          "GradScaler catches an overflow of the fp16 all-reduce; use bf16 or "
                          "fp32")


def check_groups(a: dict[str, Any], ctx: CheckContext, base: str) -> None:
    """sync.groups of accumulate / amp_aware (base: the policy's wire dtype). With the model's
    parameters known (ctx.provided["parameters"], a callable), every rule must match one."""
    groups = a.get("groups") or []
    rules = parse_rules(groups)
    if not rules:
        return
    if a.get("compression", "none") != "none":
        raise ConfigError(f"sync.groups with sync.compression={a['compression']}: PowerSGD "
                          "compresses whole buckets, not a group's gradients: drop one of them")
    for i, rule in enumerate(rules):
        check_wire_precision(rule.comm_dtype, ctx.precision, f"sync.groups[{i}].comm_dtype")
    averaged = [r for r in rules if r.every is not None]
    if averaged and ctx.provided.get("clip_grad_norm", 0) > 0:
        raise ConfigError(f"sync.groups[{rules.index(averaged[0])}].every with "
                          "trainer.clip_grad_norm > 0: each rank's gradients of an averaged "
                          "group are its own, so the clipping factor would differ across ranks "
                          "and the all-reduced parameters drift apart; set "
                          "trainer.clip_grad_norm=0")
    parameters = ctx.provided.get("parameters")
    if parameters is None:
        return
    infos: list[ParamInfo] = parameters()
    names = [n for n, _, _ in infos]
    check_every_rule_matches(rules, names)
    taken = assign(rules, names)
    if all(r is not None and r.every is not None for r in taken.values()):
        raise ConfigError("sync.groups: every parameter is in a group with `every`, so nothing "
                          "is left for the gradient all-reduce: use sync=local_sgd")
    wires = {wire_of(r, DTYPES[base]) for r in taken.values() if r is None or r.every is None}
    if len(wires) > 1 and ctx.provided.get("allreduce") == "shared_memory":
        raise ConfigError("sync.groups put gradients of different wire dtypes in one backward; "
                          "engine.allreduce=shared_memory all-reduces whole buckets in one "
                          "dtype: use engine.allreduce=auto or process_group")


def wire_of(rule: Rule | None, base: torch.dtype | None) -> torch.dtype | None:
    return base if rule is None or rule.comm_dtype is None else DTYPES[rule.comm_dtype]


def sharded_sync(rules: list[Rule], names: Iterable[str], base: torch.dtype | None,
                 reduce_scatter: str, replica_all_reduce: str | None) -> dict[str, ShardedSync]:
    """Each parameter's ShardedSync on a sharded engine: its rule's wire dtype and flavours,
    or the policy's (base, reduce_scatter, replica_all_reduce; the latter None: as
    reduce_scatter). ConfigError for a replica all-reduce on every backward of gradients that
    are reduce-scattered only at the boundary: there would be nothing to all-reduce."""
    out = {}
    for name, rule in assign(rules, names).items():
        rs = (rule.reduce_scatter if rule else None) or reduce_scatter
        ar = (rule.replica_all_reduce if rule else None) or replica_all_reduce or rs
        check_flavours(rs, ar, f"sync.groups rule {rule.name!r}: " if rule else "",
                       "" if rule else "sync.", f" (parameter {name!r})")
        out[name] = ShardedSync(REST if rule is None else rule.name, wire_of(rule, base), rs, ar)
    return out


# --- at run time ------------------------------------------------------------------------------
@dataclass(eq=False)
class Averaged:
    rule: Rule
    params: list[nn.Parameter]


class LayerSync(Wire, Averager):
    """The groups of one run (accumulate's and amp_aware's sync.groups), in both roles: as the
    wire (the engine's), which wire dtype each DDP-synchronised gradient takes and which
    parameters DDP leaves alone (bind); as the averager (the loop's, when a group has `every`),
    the averaging of those every K windows. `base`, `reduce_scatter` and `replica_all_reduce`
    (None: as reduce_scatter): the policy's, for the parameters no rule overrides."""

    def __init__(self, groups: Rules, base: torch.dtype | None,
                 counts: CommCounts, reduce_scatter: str = "boundary",
                 replica_all_reduce: str | None = None, overflow_consensus: bool = False):
        self.rules = parse_rules(groups)
        self.base = base
        self.reduce_scatter, self.replica_all_reduce = reduce_scatter, replica_all_reduce
        self.overflow_consensus = overflow_consensus
        self.counts = counts  # the run's: the averagings are counted beside DDP's all-reduces
        self.synced: dict[int, tuple[str, torch.dtype | None]] = {}  # id(param) -> group, wire
        self.averaged: list[Averaged] = []
        self.windows = 0  # windows done at the last after_window
        self.finished = False

    @property
    def averages(self) -> bool:
        return any(r.every is not None for r in self.rules)

    def bind(self, model: nn.Module) -> list[str]:
        """Before DDP wraps the model: place every parameter; returns the names DDP must ignore
        (the averaged groups')."""
        named = dict(model.named_parameters())
        check_every_rule_matches(self.rules, list(named))
        taken = assign(self.rules, named)
        by_rule: dict[str, Averaged] = {}
        ignored = []
        for name, param in named.items():
            rule = taken[name]
            if rule is not None and rule.every is not None:
                by_rule.setdefault(rule.name, Averaged(rule, [])).params.append(param)
                ignored.append(name)
            else:
                self.synced[id(param)] = (REST if rule is None else rule.name,
                                          wire_of(rule, self.base))
        self.averaged = list(by_rule.values())
        return ignored

    # --- the gradient all-reduce ------------------------------------------------------------
    def spans(self, bucket: dist.GradBucket) -> list[tuple[str, torch.dtype | None, int, int]]:
        """(group, wire, start, stop) of each gradient in the bucket's flat buffer."""
        buf = bucket.buffer()
        out = []
        for param, grad in zip(bucket.parameters(), bucket.gradients(), strict=True):
            start = int(grad.storage_offset() - buf.storage_offset())
            group, wire = self.synced[id(param)]
            out.append((group, wire, start, start + int(grad.numel())))
        return out

    def traffic(self, bucket: dist.GradBucket) -> Traffic:
        """One all-reduce per wire dtype in the bucket; each group's bytes in its wire."""
        itemsize = bucket.buffer().element_size()
        wires: set[torch.dtype | None] = set()
        nbytes = 0
        groups: dict[str, tuple[int, int]] = {}
        for group, wire, start, stop in self.spans(bucket):
            size = (stop - start) * (wire.itemsize if wire is not None else itemsize)
            wires.add(wire)
            nbytes += size
            groups[group] = (1, groups.get(group, (1, 0))[1] + size)
        return Traffic(len(wires), nbytes, groups)

    def comm_hook(self) -> InnerHook:
        wires = {w for _, w in self.synced.values()}
        if len(wires) == 1:  # one wire for all: the policy's own all-reduce, shm included
            return replace(allreduce_in(wires.pop()), traffic=self.traffic)
        return InnerHook(grouped_allreduce, self, None,
                         sent=lambda _, bucket: self.traffic(bucket).nbytes, traffic=self.traffic)

    def sharded_sync(self, names: list[str]) -> dict[str, ShardedSync]:
        return sharded_sync(self.rules, names, self.base, self.reduce_scatter,
                            self.replica_all_reduce)

    # --- averaging the groups with `every` ----------------------------------------------------
    def _due(self, averaged: bool) -> list[Averaged]:
        """The groups whose schedule averaged (True) or did not average (False) after the last
        window."""
        return [a for a in self.averaged if (self.windows % (a.rule.every or 1) == 0) == averaged]

    def in_sync(self) -> bool:
        """Every averaged group is the same on every rank now (a resumed run's first answer
        comes after its first window)."""
        return self.finished or not self._due(False)

    def after_window(self, model: nn.Module, windows_done: int) -> None:
        self.windows, self.finished = windows_done, False
        self._average(self._due(True))

    def finish(self, model: nn.Module) -> None:
        """After the last window's after_window: the groups it did not average are averaged
        now, so the final evaluation and checkpoint see the consensus."""
        self._average(self._due(False))
        self.finished = True

    def _average(self, due: list[Averaged]) -> None:
        for a in due:
            mine = CommCounts()
            with torch.no_grad():
                average_([p.data for p in a.params], None, mine)
            self.counts.add(mine.allreduce_calls, mine.allreduce_bytes, a.rule.name)


def grouped_allreduce(layers: LayerSync, bucket: dist.GradBucket
                      ) -> torch.futures.Future[torch.Tensor]:
    """A DDP comm hook: the bucket's mean over ranks with each gradient in its group's wire
    dtype, one all-reduce per wire dtype (as DDP's hooks: cast, divide by the world size,
    all-reduce, copy back)."""
    buf = bucket.buffer()
    world = dist.get_world_size()
    by_wire: dict[torch.dtype | None, list[tuple[int, int]]] = {}
    for _, wire, start, stop in layers.spans(bucket):
        by_wire.setdefault(wire, []).append((start, stop))
    sent = []
    for wire, spans in by_wire.items():
        flat = torch.cat([buf[a:b] for a, b in spans]).to(wire or buf.dtype)
        flat.div_(world)
        work = dist.all_reduce(flat, async_op=True)
        assert work is not None
        sent.append((spans, flat, work.get_future()))

    def copy_back(_: Any) -> torch.Tensor:
        for spans, flat, reduced in sent:
            # A nccl work's future is done once the collective is queued: without this wait
            # the copies below would read `flat` before nccl reduced it. Waiting on the work's
            # own future makes this callback's stream wait for nccl's (no host sync); on gloo
            # it waits for an earlier work still running. (Not work.wait(): gloo runs these
            # callbacks before it marks the work finished.)
            reduced.wait()
            offset = 0
            for a, b in spans:
                buf[a:b].copy_(flat[offset:offset + b - a])
                offset += b - a
        return buf

    # Chained on the last work's own future, as torch's _allreduce_fut chains its copy: on nccl
    # that is a CUDA future, so copy_back runs on a side stream that waits for the collectives
    # and the returned future records its events; the backward's compute stream goes on.
    # (collect_all's future has no devices: copy_back ran at once on the compute stream, and
    # its waits queued the rest of the backward behind each all-reduce.)
    return sent[-1][2].then(copy_back)
