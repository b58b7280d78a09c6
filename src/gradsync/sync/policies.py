"""The built-in sync policies: ``always`` (every backward all-reduces) and the window policies
``accumulate`` and ``amp_aware`` (only a window's last micro-batch synchronises), which are one
class, ``WindowSync``, built with different options: the wire (the bucket's own dtype, a low
precision, PowerSGD factors, or per-layer rules) and fp16 overflow consensus. Local SGD and DiLoCo
are in local_sgd.py. The contract they implement is sync/policy.py's ``SyncPolicy``.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.utils import get_total_norm

from gradsync.components import CheckContext, ConfigError, checks, require
from gradsync.core.dtypes import DTYPES
from gradsync.sync.comm import FLAVOURS, CommCounts, InnerHook, ShardedSync, allreduce_in
from gradsync.sync.layer_sync import LayerSync, Rules, check_groups, sharded_sync
from gradsync.sync.policy import OverflowCounts, SyncPolicy, last_micro_batch, renamed_keys
from gradsync.sync.powersgd import PowerSGD, build_powersgd, powersgd_hook, sent_bytes


class Compression:
    """What a policy's all-reduce sends: the bucket (in its dtype or a wire dtype), PowerSGD
    factors, or each parameter group's gradients in its own wire dtype (sync.groups, whose
    groups with `every` are averaged instead: layer_sync.py). One place answers which dtype goes
    on the wire and what the policy syncs itself."""

    def __init__(self, wire_dtype: torch.dtype | None = None, powersgd: PowerSGD | None = None,
                 groups: Rules = (), counts: CommCounts | None = None):
        self.wire_dtype, self.powersgd = wire_dtype, powersgd
        counts = counts if counts is not None else CommCounts()
        self.layers = LayerSync(groups, wire_dtype, counts) if groups else None
        self.own_replicas = self.layers is not None and self.layers.averages

    def bind(self, model: nn.Module) -> list[str]:
        return self.layers.bind(model) if self.layers else []

    def after_window(self, model: nn.Module, windows_done: int) -> None:
        if self.layers:
            self.layers.after_window(windows_done)

    def finish(self, model: nn.Module) -> None:
        if self.layers:
            self.layers.finish()

    def replicas_in_sync(self) -> bool:
        return self.layers.in_sync if self.layers else True

    def comm_hook(self) -> InnerHook:
        if self.layers is not None:
            return self.layers.comm_hook()
        if self.powersgd is None:
            return allreduce_in(self.wire_dtype)
        return InnerHook(powersgd_hook, self.powersgd, None, sent_bytes, sequential=True)

    def after_step(self, stepped: bool) -> None:
        if self.powersgd is not None and not stepped:
            self.powersgd.forget()  # its memory of the skipped window holds inf/nan

    def sharded_sync(self, names: list[str], reduce_scatter: str,
                     replica_all_reduce: str | None) -> dict[str, ShardedSync]:
        if self.powersgd is not None:
            raise ConfigError("sync.compression=powersgd compresses DDP's buckets: sharded "
                              "engines (fsdp, hsdp) reduce-scatter, use sync.compression=none")
        rules = self.layers.rules if self.layers else []
        return sharded_sync(rules, names, self.wire_dtype, reduce_scatter, replica_all_reduce)


class OverflowConsensus:
    """fp16 with a GradScaler: after every no_sync backward each rank checks its accumulated
    gradients for inf/nan and one MAX all-reduce of that flag tells every rank whether any rank
    has one. Such a window cannot step (the scaler would skip it), so the rest of its compute
    and its full-gradient all-reduce are skipped. At the window's end the scaler's own inf/nan
    flags are MAX all-reduced too, so every rank skips (and backs off the scale) or steps alike,
    aborted windows included, where only some ranks hold the overflow locally."""

    def __init__(self) -> None:
        self.overflow = OverflowCounts()

    def window_doomed(self, model: nn.Module, micro_index: int, window_size: int) -> bool:
        if last_micro_batch(micro_index, window_size):
            return False  # the last backward synced: agree_on_overflow settles that window
        grads = [p.grad for p in model.parameters() if p.grad is not None]
        flag = (~torch.isfinite(get_total_norm(grads, norm_type=float("inf")))).float()
        self._max_over_ranks(flag)
        if not flag.item():
            return False
        self.overflow.aborted_windows += 1
        self.overflow.allreduce_skipped += 1  # the window's last, synchronising backward
        return True

    def agree_on_overflow(self, found_inf: list[torch.Tensor]) -> None:
        for flag in found_inf:
            self._max_over_ranks(flag)

    def _max_over_ranks(self, flag: torch.Tensor) -> None:
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        self.overflow.flag_allreduces += 1


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
    if a["reduce_scatter"] == "boundary" and a["replica_all_reduce"] == "every":
        raise ConfigError("sync.replica_all_reduce=every with sync.reduce_scatter=boundary: the "
                          "all-reduce across replicas follows a reduce-scatter, so it cannot run "
                          "more often; set sync.reduce_scatter=every")


def _check_accumulate(a: dict[str, Any], ctx: CheckContext) -> None:
    _check_compression(a, ctx)
    _check_sharded(a)
    check_groups(a, ctx, "fp32")


def _check_amp_aware(a: dict[str, Any], ctx: CheckContext) -> None:
    require(a["comm_dtype"] in DTYPES, "sync.comm_dtype", f"one of {', '.join(DTYPES)}",
            a["comm_dtype"])
    if a["comm_dtype"] == "fp16" and ctx.precision != "fp16":
        raise ConfigError(f"sync.comm_dtype='fp16' needs precision=fp16, not "
                          f"{ctx.precision!r}: only its GradScaler catches an overflow of the "
                          "fp16 all-reduce; use bf16 or fp32")
    _check_compression(a, ctx)
    if a["compression"] == "powersgd" and a["comm_dtype"] != "fp32":
        raise ConfigError("sync.compression=powersgd sends its own fp32 factors: set "
                          f"sync.comm_dtype=fp32 (not {a['comm_dtype']!r})")
    _check_sharded(a)
    check_groups(a, ctx, a["comm_dtype"])


class WindowSync(SyncPolicy):
    """Only the last micro-batch of each window (a short last window included) synchronises,
    over `wire` (Compression: the bucket in its own dtype or a low precision, PowerSGD factors,
    per-layer rules). With fp16's GradScaler, `consensus` (overflow consensus) ends a window
    doomed by an overflow on any rank early; groups averaged instead of all-reduced need the
    scaler's flags agreed at the window's end (`agreement`) even without it."""

    def __init__(self, wire: Compression, consensus: bool, uses_scaler: bool,
                 reduce_scatter: str = "boundary", replica_all_reduce: str = AS_REDUCE_SCATTER):
        self.wire = wire
        # on a sharded engine: how units accumulate between synchronising micro-batches
        self.reduce_scatter, self.replica_all_reduce = reduce_scatter, replica_all_reduce
        self.own_replicas = wire.own_replicas
        self.consensus = OverflowConsensus() if consensus and uses_scaler else None
        # groups averaged instead of all-reduced hold each rank's own gradients: the scaler's
        # inf/nan flags must be made the same on every rank (MAX all-reduce) or one rank would
        # skip a step the others take
        self.agreement = self.consensus or (OverflowConsensus() if uses_scaler
                                            and wire.own_replicas else None)
        if self.agreement is not None:
            self.overflow = self.agreement.overflow

    def should_sync(self, micro_index: int, window_size: int) -> bool:
        return last_micro_batch(micro_index, window_size)

    def window_doomed(self, model: nn.Module, micro_index: int, window_size: int) -> bool:
        return self.consensus is not None and self.consensus.window_doomed(model, micro_index,
                                                                           window_size)

    def agree_on_overflow(self, found_inf: list[torch.Tensor]) -> None:
        if self.agreement is not None:
            self.agreement.agree_on_overflow(found_inf)

    # --- the wire's part ----------------------------------------------------------------------
    def bind(self, model: nn.Module) -> list[str]:
        return self.wire.bind(model)

    def comm_hook(self) -> InnerHook:
        return self.wire.comm_hook()

    def sharded_sync(self, names: list[str]) -> dict[str, ShardedSync]:
        replicas = (None if self.replica_all_reduce == AS_REDUCE_SCATTER
                    else self.replica_all_reduce)
        return self.wire.sharded_sync(names, self.reduce_scatter, replicas)

    def after_step(self, stepped: bool) -> None:
        self.wire.after_step(stepped)

    def after_window(self, model: nn.Module, windows_done: int) -> None:
        self.wire.after_window(model, windows_done)

    def finish(self, model: nn.Module) -> None:
        self.wire.finish(model)

    def replicas_in_sync(self) -> bool:
        return self.wire.replicas_in_sync()


def _wire(compression: str, powersgd_rank: int, powersgd_start_backwards: int,
          wire_dtype: torch.dtype | None, groups: Rules, counts: CommCounts | None) -> Compression:
    powersgd = (build_powersgd(powersgd_rank, powersgd_start_backwards) if compression == "powersgd"
                else None)
    return Compression(wire_dtype, powersgd, groups, counts)


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
                 uses_scaler: bool = False, counts: CommCounts | None = None):
        super().__init__(_wire(compression, powersgd_rank, powersgd_start_backwards, None, groups,
                               counts), False, uses_scaler, reduce_scatter, replica_all_reduce)


@checks(_check_amp_aware)
class AmpAwareSync(WindowSync):
    """sync=amp_aware: accumulate's window boundaries, the gradients all-reduced in bf16 (or
    fp16) and, when the fp16 GradScaler runs, overflow consensus (OverflowConsensus)."""

    name = "amp_aware"
    renamed = renamed_keys("sync.powersgd_start_step")

    def __init__(self, comm_dtype: str = "bf16", overflow_consensus: bool = True,
                 compression: str = "none", powersgd_rank: int = 4,
                 powersgd_start_backwards: int = 10, groups: Rules = (),
                 reduce_scatter: str = "boundary", replica_all_reduce: str = AS_REDUCE_SCATTER,
                 uses_scaler: bool = False, counts: CommCounts | None = None):
        super().__init__(_wire(compression, powersgd_rank, powersgd_start_backwards,
                               DTYPES[comm_dtype], groups, counts),
                         overflow_consensus, uses_scaler, reduce_scatter, replica_all_reduce)
