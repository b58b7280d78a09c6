"""The built-in sync policies: ``always`` (every backward all-reduces) and the window policies
``accumulate`` and ``amp_aware`` (only a window's last micro-batch synchronises), which are one
class, ``WindowSync``, built with different options: its wire (the bucket's own dtype, a low
precision, PowerSGD factors, or per-layer rules) and fp16 overflow consensus (a field of the
wire, carried out by the precision). Local SGD and DiLoCo are in local_sgd.py. The contract
they implement is sync/policy.py's ``SyncPolicy``.
"""

from __future__ import annotations

from typing import Any

import torch

from gradsync.components import CheckContext, ConfigError, checks, require
from gradsync.core.dtypes import DTYPES
from gradsync.sync.comm import (
    FLAVOURS,
    CommCounts,
    InnerHook,
    ShardedSync,
    Wire,
    allreduce_in,
    check_flavours,
)
from gradsync.sync.layer_sync import (
    LayerSync,
    Rules,
    check_groups,
    check_wire_precision,
    sharded_sync,
)
from gradsync.sync.policy import SyncPolicy, last_micro_batch, renamed_keys
from gradsync.sync.powersgd import PowerSGD, build_powersgd, powersgd_hook, sent_bytes


class Compression(Wire):
    """The window policies' wire (the engine's role): the bucket in its own dtype or a wire
    dtype, or PowerSGD factors; on a sharded engine, how units accumulate between synchronising
    micro-batches (reduce_scatter, replica_all_reduce). Per-layer rules are layer_sync.py's
    LayerSync, a wire of its own. One place answers which dtype goes on the wire."""

    def __init__(self, wire_dtype: torch.dtype | None = None, powersgd: PowerSGD | None = None,
                 reduce_scatter: str = "boundary", replica_all_reduce: str | None = None,
                 overflow_consensus: bool = False):
        self.wire_dtype, self.powersgd = wire_dtype, powersgd
        self.reduce_scatter, self.replica_all_reduce = reduce_scatter, replica_all_reduce
        self.overflow_consensus = overflow_consensus

    def comm_hook(self) -> InnerHook:
        if self.powersgd is None:
            return allreduce_in(self.wire_dtype)
        return InnerHook(powersgd_hook, self.powersgd, None, sent_bytes, sequential=True)

    def after_step(self, stepped: bool) -> None:
        if self.powersgd is not None and not stepped:
            self.powersgd.forget()  # its memory of the skipped window holds inf/nan

    def sharded_sync(self, names: list[str]) -> dict[str, ShardedSync]:
        if self.powersgd is not None:
            raise ConfigError("sync.compression=powersgd compresses DDP's buckets: sharded "
                              "engines (fsdp, hsdp) reduce-scatter, use sync.compression=none")
        return sharded_sync([], names, self.wire_dtype, self.reduce_scatter,
                            self.replica_all_reduce)


class AlwaysSync(SyncPolicy):
    """Every backward all-reduces; the baseline that accumulation saves against."""

    name = "always"

    def should_sync(self, micro_index: int, window_size: int) -> bool:
        return True


def _check_compression(a: dict[str, Any], ctx: CheckContext) -> None:
    require(a["compression"] in ("none", "powersgd"), "sync.compression", "none or powersgd",
            a["compression"])
    require(a["powersgd_rank"] >= 1, "sync.powersgd_rank", "an integer >= 1",
            a["powersgd_rank"])
    require(a["powersgd_start_backwards"] >= 2, "sync.powersgd_start_backwards",
            "an integer >= 2 (torch's PowerSGD with error feedback)", a["powersgd_start_backwards"])
    if a["compression"] == "powersgd" and ctx.provided.get("allreduce") == "shared_memory":
        raise ConfigError("sync.compression=powersgd all-reduces through the process group: "
                          "use engine.allreduce=auto or process_group")


AS_REDUCE_SCATTER = "same"  # sync.replica_all_reduce's default: the flavour of reduce_scatter


def _check_sharded(a: dict[str, Any]) -> None:
    """The flavours of a sharded engine's accumulation (docs/sharded.md); which engine runs
    them is checked with the engine's other settings (engines/fsdp.py check_config)."""
    require(a["reduce_scatter"] in FLAVOURS, "sync.reduce_scatter", f"one of {', '.join(FLAVOURS)}",
            a["reduce_scatter"])
    require(a["replica_all_reduce"] in (AS_REDUCE_SCATTER, *FLAVOURS),
            "sync.replica_all_reduce", f"{AS_REDUCE_SCATTER} (as sync.reduce_scatter) or one of "
            f"{', '.join(FLAVOURS)}", a["replica_all_reduce"])
    check_flavours(a["reduce_scatter"], a["replica_all_reduce"])


def _check_accumulate(a: dict[str, Any], ctx: CheckContext) -> None:
    _check_compression(a, ctx)
    _check_sharded(a)
    check_groups(a, ctx, "fp32")


def _check_amp_aware(a: dict[str, Any], ctx: CheckContext) -> None:
    require(a["comm_dtype"] in DTYPES, "sync.comm_dtype", f"one of {', '.join(DTYPES)}",
            a["comm_dtype"])
    check_wire_precision(a["comm_dtype"], ctx.precision, "sync.comm_dtype")
    _check_compression(a, ctx)
    if a["compression"] == "powersgd" and a["comm_dtype"] != "fp32":
        raise ConfigError("sync.compression=powersgd sends its own fp32 factors: set "
                          f"sync.comm_dtype=fp32 (not {a['comm_dtype']!r})")
    _check_sharded(a)
    check_groups(a, ctx, a["comm_dtype"])


class WindowSync(SyncPolicy):
    """Only the last micro-batch of each window (a short last window included) synchronises,
    over `wire` (Compression: the bucket in its own dtype or a low precision, PowerSGD factors;
    LayerSync: per-layer rules, whose groups with `every` make it the averager too)."""

    def __init__(self, wire: Compression | LayerSync):
        self.wire = wire
        self.averager = wire if isinstance(wire, LayerSync) and wire.averages else None

    def should_sync(self, micro_index: int, window_size: int) -> bool:
        return last_micro_batch(micro_index, window_size)


def _wire(compression: str, powersgd_rank: int, powersgd_start_backwards: int,
          wire_dtype: torch.dtype | None, groups: Rules, counts: CommCounts | None,
          reduce_scatter: str, replica_all_reduce: str,
          overflow_consensus: bool = False) -> Compression | LayerSync:
    replicas = None if replica_all_reduce == AS_REDUCE_SCATTER else replica_all_reduce
    if groups:
        return LayerSync(groups, wire_dtype, counts if counts is not None else CommCounts(),
                         reduce_scatter, replicas, overflow_consensus)
    powersgd = (build_powersgd(powersgd_rank, powersgd_start_backwards) if compression == "powersgd"
                else None)
    return Compression(wire_dtype, powersgd, reduce_scatter, replicas, overflow_consensus)


# The components (`_target_`s of conf/sync/accumulate.yaml and amp_aware.yaml): each is the one
# window policy, WindowSync, with the options (and checks) of its own; nothing else.
@checks(_check_accumulate)
class AccumulateSync(WindowSync):
    """sync=accumulate: only the last micro-batch of each window all-reduces, in the gradients'
    own dtype; with compression=powersgd rank-r factors of the gradients instead (approximate);
    with groups, per-layer rules (layer_sync.py). On a sharded engine, reduce_scatter and
    replica_all_reduce choose how units accumulate in between (sync/comm.py ShardedSync)."""

    name = "accumulate"
    renamed = renamed_keys("sync.powersgd_start_step")

    def __init__(self, compression: str = "none", powersgd_rank: int = 4,
                 powersgd_start_backwards: int = 10, groups: Rules = (),
                 reduce_scatter: str = "boundary", replica_all_reduce: str = AS_REDUCE_SCATTER,
                 counts: CommCounts | None = None):
        super().__init__(_wire(compression, powersgd_rank, powersgd_start_backwards, None, groups,
                               counts, reduce_scatter, replica_all_reduce))


@checks(_check_amp_aware)
class AmpAwareSync(WindowSync):
    """sync=amp_aware: accumulate's window boundaries, the gradients all-reduced in bf16 (or
    fp16) and, when the fp16 GradScaler runs, overflow consensus (the wire's
    overflow_consensus, which train/precision.py's OverflowConsensus carries out)."""

    name = "amp_aware"
    renamed = renamed_keys("sync.powersgd_start_step")

    def __init__(self, comm_dtype: str = "bf16", overflow_consensus: bool = True,
                 compression: str = "none", powersgd_rank: int = 4,
                 powersgd_start_backwards: int = 10, groups: Rules = (),
                 reduce_scatter: str = "boundary", replica_all_reduce: str = AS_REDUCE_SCATTER,
                 counts: CommCounts | None = None):
        super().__init__(_wire(compression, powersgd_rank, powersgd_start_backwards,
                               DTYPES[comm_dtype], groups, counts, reduce_scatter,
                               replica_all_reduce, overflow_consensus))
