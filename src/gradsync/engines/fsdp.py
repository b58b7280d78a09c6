"""engine=fsdp and engine=hsdp: FSDP2, torch's ``fully_shard``.

Every rank holds a shard of each parameter (dim 0, padded to a multiple of the shard group). The
model is cut into *units*, each one ``fully_shard`` call (``engine.fsdp_units``: a glob over
module names; ``auto``: the model's own choice, each transformer block, each hidden layer of
the MLP; the root is always the last unit and keeps what no other unit took). A unit's
parameters are all-gathered before its forward (and again before its backward), and its
gradients reduce-scattered after its backward: one collective per unit. ``hsdp`` shards inside
groups of ``world / engine.replicas`` ranks and replicates across ``engine.replicas`` such
groups (a 2-D mesh): after the reduce-scatter, the shards are all-reduced across replicas.
``hsdp`` with one replica (``engine.replicas=1``, or 0 on one host) is built as ``fsdp``, on a
1-D mesh, and says so in the log: on the mesh (1, W) torch's FSDP2 all-reduces every
synchronised gradient over the 1-rank replicate group with ``ReduceOp.AVG``
(``_get_gradient_divide_factors`` special-cases only a data-parallel size of 1), a wasted
collective that NCCL before 2.29.7 gets wrong (it drops tail elements: NVIDIA/nccl#1950).

The sync policy's decision for a micro-batch becomes each unit's
``set_requires_gradient_sync`` / ``set_requires_all_reduce``, per unit in the flavour its
parameters' rule asks for (sync.reduce_scatter, sync.replica_all_reduce, sync.groups; sync/comm.py
``ShardedSync``): ``boundary`` keeps the gradients unsharded (the whole gradient, on every rank)
until the synchronising micro-batch, ``every`` reduce-scatters after every backward and keeps
only the shard. The policy's wire dtype is the unit's ``MixedPrecisionPolicy.reduce_dtype``;
precision=bf16 computes with bf16 parameters (``param_dtype``), the optimizer steps the fp32
shards.

Counted exactly, per group: every reduce-scatter and all-gather FSDP issues (its collectives
wrapped: ``set_custom_reduce_scatter`` / ``set_custom_all_gather``, bytes of the whole padded
tensor) and every all-reduce across replicas (``set_all_reduce_hook``); a collective over a
group of one rank moves nothing and is not counted. The gradient bytes each rank holds after
every backward are counted from FSDP's own tensors (core/memory.py).
"""

from __future__ import annotations

import logging
import socket
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from fnmatch import fnmatchcase
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from gradsync.components import RESERVED, ConfigError, locate, parameters, require
from gradsync.config.schema import check_types
from gradsync.core.memory import MemoryMeter, local, storage_bytes
from gradsync.engines.base import Capabilities, Registered
from gradsync.engines.buffers import broadcast_from_rank0
from gradsync.engines.compiled import Compile
from gradsync.engines.trace import SyncTrace
from gradsync.engines.unused import unused_error
from gradsync.sync.averaging import whole_model
from gradsync.sync.comm import PLAIN, CommCounts, ShardedSync, Wire
from gradsync.sync.policy import SyncPolicy
from gradsync.torch_compat import fsdp_param_groups, fsdp_reduces_unused

log = logging.getLogger("gradsync.engines.fsdp")  # a child of the ranks' log (run/worker.py)
AUTO_UNITS = "auto"
# the attribute a model names its default units with (globs over module names); none: the
# root is the only unit
UNITS_ATTRIBUTE = "fsdp_units"
SHARDED_FLAVOURS = ("reduce_scatter", "replica_all_reduce")  # a policy's sharded settings


# --- which modules become units ---------------------------------------------------------------
def unit_globs(model: nn.Module, rule: str) -> list[str]:
    """engine.fsdp_units as globs ('|' between alternatives); auto: the model's own."""
    if rule == AUTO_UNITS:
        return list(getattr(model, UNITS_ATTRIBUTE, ()))
    return [g.strip() for g in rule.split("|") if g.strip()]


def unit_names(model: nn.Module, rule: str) -> list[str]:
    """The modules that become units, innermost first, the root ('') last. For each glob, the
    outermost modules whose name it matches ('blocks.*' takes blocks.0, not blocks.0.mlp);
    ConfigError for a glob that matches no module, naming the closest."""
    names = [n for n, _ in model.named_modules() if n]
    chosen: set[str] = set()
    for glob in unit_globs(model, rule):
        hits = [n for n in names if fnmatchcase(n, glob)]
        if not hits:
            raise ConfigError(f"engine.fsdp_units={rule!r}: {glob!r} matches no module of the "
                              f"model; its modules: {', '.join(names[:24])}"
                              f"{' ...' if len(names) > 24 else ''}")
        chosen |= {n for n in hits if not any(n.startswith(f"{h}.") for h in hits)}
    return sorted(chosen, key=lambda n: (-n.count("."), names.index(n))) + [""]


def unit_parameters(model: nn.Module, units: list[str]) -> dict[str, list[str]]:
    """Each unit's own parameters (names): those of its module that no inner unit took, as
    fully_shard assigns them."""
    taken: set[str] = set()
    out: dict[str, list[str]] = {}
    for unit in units:
        prefix = f"{unit}." if unit else ""
        module = model.get_submodule(unit)
        own = [prefix + n for n, _ in module.named_parameters()]
        out[unit] = [n for n in own if n not in taken]
        taken |= set(own)
    return out


@dataclass(frozen=True)
class UnitPlan:
    name: str  # module name ('' for the root)
    params: list[str]
    sync: ShardedSync  # what its parameters' rule asks for (all alike)
    nbytes: int


def plan_units(model: nn.Module, rule: str, wire: Wire) -> list[UnitPlan]:
    """The units, their parameters and how each reduces its gradients; ConfigError where one
    unit's parameters fall under rules that ask for different reductions (one unit is one
    reduce-scatter)."""
    units = unit_names(model, rule)
    owned = unit_parameters(model, units)
    params = dict(model.named_parameters())
    plan = wire.sharded_sync(list(params))
    out = []
    for unit in units:
        names = owned[unit]
        kinds = {plan[n] for n in names}
        if len(kinds) > 1:
            groups = sorted({k.group for k in kinds})
            raise ConfigError(f"sync.groups: FSDP unit {unit or '<root>'!r} holds parameters of "
                              f"groups {', '.join(map(repr, groups))} that reduce differently; "
                              "a unit's gradients go out in one reduce-scatter: make the rules "
                              "follow the units (engine.fsdp_units; +inspect=params shows "
                              "them)")
        nbytes = sum(params[n].numel() * params[n].element_size() for n in names)
        out.append(UnitPlan(unit, names, kinds.pop() if kinds else ShardedSync(), nbytes))
    return out


def unit_table(model: nn.Module, rule: str, wire: Wire, hsdp: bool) -> str:
    """+inspect=params under a sharded engine: each unit, its parameters and reduction (wire:
    the policy's)."""
    lines = ["FSDP units (engine.fsdp_units), innermost first:"]
    for u in plan_units(model, rule, wire):
        dtype = _dtype_name(u.sync.wire) or "the gradients' dtype"
        replicas = f", replica_all_reduce={u.sync.replica_all_reduce}" if hsdp else ""
        lines.append(f"  {u.name or '<root>'}: {len(u.params)} tensors, {u.nbytes} bytes, group "
                     f"{u.sync.group}, reduce_scatter={u.sync.reduce_scatter}{replicas}, "
                     f"reduced in {dtype}")
    return "\n".join(lines)


# --- settings and checks before any worker starts ---------------------------------------------
@dataclass
class FSDPSettings:
    """engine=fsdp's settings (docs/sharded.md)."""

    # the modules that become FSDP units, globs over module names ('|' between them; auto: the
    # model's own choice)
    fsdp_units: str = AUTO_UNITS
    # parameters may get no gradient in a backward (FSDP2 reduce-scatters them anyway)
    find_unused_parameters: bool = False

    def check(self, device_type: str) -> None:
        check_types(self, "engine")
        require(self.fsdp_units.strip() != "", "engine.fsdp_units",
                f"{AUTO_UNITS} or globs over module names ('|' between them)", self.fsdp_units)
        if self.find_unused_parameters and not fsdp_reduces_unused():
            raise ConfigError("engine.find_unused_parameters with a sharded engine: this "
                              "torch's FSDP2 has no set_reduce_scatter_unused_params (torch >= "
                              "2.13); use engine=torch_ddp or gradsync")


@dataclass
class HSDPSettings(FSDPSettings):
    """engine=hsdp's settings: fsdp's and the replicate dimension (docs/sharded.md)."""

    replicas: int = 0  # replicas of the model, each sharded over its ranks; 0: one per host

    def check(self, device_type: str) -> None:
        super().check(device_type)
        require(self.replicas >= 0, "engine.replicas",
                "0 (one replica per node) or a divisor of the world size", self.replicas)


def check_config(name: str, engine: Any, can: Capabilities, check_replicas: int,
                 sync: dict[str, Any], precision: str, world_size: int,
                 policy: Callable[[], SyncPolicy], model: Callable[[], nn.Module]) -> None:
    """What a sharded engine cannot run, and a sharded engine's sync flavours on another
    engine, as one-line ConfigErrors. name, engine: the run's engine and its settings; can: its
    capabilities; sync: the sync node; policy/model: build the run's policy and (meta) model
    when asked."""
    sync_args = {k: v for k, v in sync.items() if k not in RESERVED}
    rules = sync_args.get("groups") or []
    # a sharded flavour differs from the policy's own default (its signature: the one source)
    params = parameters(locate(sync["_target_"]))
    defaults = {k: params[k].default for k in SHARDED_FLAVOURS if k in params}
    flavours = [f"sync.{k}={sync_args[k]}" for k, default in defaults.items()
                if sync_args.get(k, default) != default]
    flavours += [f"sync.groups[{i}].{k}" for i, r in enumerate(rules) if isinstance(r, dict)
                 for k in SHARDED_FLAVOURS if r.get(k) is not None]
    if not can.sharded:
        if flavours:
            raise ConfigError(f"{flavours[0]} is for sharded engines: set engine=fsdp or "
                              f"hsdp (engine={name} all-reduces whole gradients)")
        return
    where = f"engine={name}"
    if precision == "fp16":
        raise ConfigError(f"precision=fp16 with {where}: the GradScaler would see only each "
                          "rank's shard of the gradients; use bf16 (FSDP's MixedPrecisionPolicy)")
    if check_replicas:
        raise ConfigError(f"trainer.check_replicas with {where}: ranks hold different shards by "
                          "design; set trainer.check_replicas=0")
    if not can.replicas:
        ar = [f for f in flavours if "replica_all_reduce" in f]
        if ar:
            raise ConfigError(f"{ar[0]} is for engine=hsdp (the all-reduce across "
                              "replicas); engine=fsdp has one shard group")
    else:
        require(engine.replicas == 0 or world_size % engine.replicas == 0,
                "engine.replicas", f"0 (one replica per node) or a divisor of the world size "
                f"{world_size}", engine.replicas)
    for i, r in enumerate(rules):
        if isinstance(r, dict) and r.get("every") is not None:
            raise ConfigError(f"sync.groups[{i}].every with {where}: a group averaged every K "
                              "windows keeps each rank's own replica, which a sharded model has "
                              "not; use engine=torch_ddp")
    built = policy()
    if whole_model(built.averager):
        raise ConfigError(f"sync policy {built.name!r} averages whole models (local SGD, "
                          f"DiLoCo), which {where} does not hold on any rank; use "
                          "engine=torch_ddp")
    plan_units(model(), engine.fsdp_units, built.wire or PLAIN)


# --- the engine ---------------------------------------------------------------------------------
def _collectives() -> tuple[type, type]:
    """FSDP's default reduce-scatter and all-gather, counted (torch >= 2.11 lets a unit swap
    them: set_custom_reduce_scatter / set_custom_all_gather)."""
    from torch.distributed.fsdp._fully_shard._fsdp_collectives import (
        DefaultAllGather,
        DefaultReduceScatter,
    )

    class CountedReduceScatter(DefaultReduceScatter):  # type: ignore[misc]
        def __init__(self, counts: CommCounts, group: str):
            self.counts, self.group = counts, group

        def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor,
                     group: dist.ProcessGroup, op: Any, async_op: bool = False) -> Any:
            self.counts.add_collective("reduce_scatter", self.group,
                                       input_tensor.numel() * input_tensor.element_size())
            return super().__call__(output_tensor, input_tensor, group, op, async_op)

    class CountedAllGather(DefaultAllGather):  # type: ignore[misc]
        def __init__(self, counts: CommCounts, group: str):
            self.counts, self.group = counts, group

        def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor,
                     group: dist.ProcessGroup, async_op: bool = False) -> Any:
            self.counts.add_collective("all_gather", self.group,
                                       output_tensor.numel() * output_tensor.element_size())
            return super().__call__(output_tensor, input_tensor, group, async_op)

    return CountedReduceScatter, CountedAllGather


@dataclass
class Unit:
    plan: UnitPlan
    module: Any  # the FSDPModule
    reduce_dtype: torch.dtype | None  # its MixedPrecisionPolicy's (None: the gradients')


class FSDPEngine:
    """The engine around a model already cut into fully_shard units (engine=fsdp)."""

    transport = "process_group"
    capabilities = Capabilities(sharded=True)

    def __init__(self, name: str, model: nn.Module, units: list[Unit], mesh: dict[str, int],
                 counts: CommCounts, memory: MemoryMeter, param_dtype: torch.dtype | None,
                 find_unused: bool = False):
        self.name = name
        self.module = model
        self.units = units
        self.mesh = mesh  # {"replicate": r, "shard": s}
        self.counts = counts
        self.memory = memory
        self.trace: SyncTrace | None = None  # engine.trace_sync: the DDP engines only
        self.compiled: Compile | None = None  # compile.enabled (_build: each unit's forward)
        self.param_dtype = param_dtype
        self.find_unused = find_unused  # zeros reduce-scattered for parameters without gradient

    def __call__(self, *inputs: Any, **kwargs: Any) -> Any:
        return self.module(*inputs, **kwargs)

    @contextmanager
    def micro_batch(self, sync: bool) -> Iterator[None]:
        hsdp = self.name == "hsdp"
        for u in self.units:
            u.module.set_requires_gradient_sync(sync or u.plan.sync.reduce_scatter == "every",
                                                recurse=False)
            if hsdp:  # after the line above, which sets both
                u.module.set_requires_all_reduce(
                    sync or u.plan.sync.replica_all_reduce == "every", recurse=False)
        yield
        if sync:
            self.counts.sync_backwards += 1
        self.memory.record(*self.gradient_bytes())

    def gradient_bytes(self) -> tuple[int, int]:
        """(unsharded, sharded) bytes of the gradients this rank holds now, from FSDP's own
        tensors: a unit's unsharded gradients (accumulating between synchronising micro-batches,
        in the reduce dtype once FSDP upcast them), its sharded gradients (views into one flat
        buffer per unit) and, on HSDP, the reduce-scattered shards waiting for the all-reduce
        across replicas."""
        unsharded: list[torch.Tensor | None] = []
        sharded: list[torch.Tensor | None] = []
        for u in self.units:
            for group in fsdp_param_groups(u.module):
                sharded.append(getattr(group, "_partial_reduce_output", None))
                for fp in group.fsdp_params:
                    whole = getattr(fp, "_unsharded_param", None)
                    unsharded += [None if whole is None else whole.grad,
                                  fp.unsharded_accumulated_grad]
                    sharded.append(local(fp.sharded_param.grad))
        return storage_bytes(unsharded), storage_bytes(sharded)

    def parameters(self) -> Iterator[nn.Parameter]:
        return self.module.parameters()

    def align_buffers(self) -> None:
        """FSDP2 shards parameters only: the buffers are whole on every rank and never synced
        (each rank's BatchNorm statistics follow its own batches); rank 0's, as DCP saves."""
        broadcast_from_rank0(list(self.module.buffers()))

    def zero_grad(self, optimizer: torch.optim.Optimizer) -> None:
        optimizer.zero_grad(set_to_none=True)

    def state_dict(self) -> dict[str, Any]:
        """The model's sharded state (DTensors, the module's parameter names): what
        torch.distributed.checkpoint saves, each rank its shards."""
        from torch.distributed.checkpoint.state_dict import get_model_state_dict

        return get_model_state_dict(self.module)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        from torch.distributed.checkpoint.state_dict import set_model_state_dict

        set_model_state_dict(self.module, state)

    def full_state_dict(self) -> dict[str, Any]:
        """Collective: the whole model's state on rank 0's CPU (empty elsewhere), the names and
        shapes of the unsharded model (checkpoints/last.pt)."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        return get_model_state_dict(self.module, options=StateDictOptions(
            full_state_dict=True, cpu_offload=True))

    def describe(self) -> dict[str, Any]:
        return {"name": self.name, "transport": self.transport, "mesh": self.mesh,
                "param_dtype": _dtype_name(self.param_dtype),
                "find_unused_parameters": self.find_unused,
                "units": [{"name": u.plan.name or "<root>", "tensors": len(u.plan.params),
                           "bytes": u.plan.nbytes, "group": u.plan.sync.group,
                           "reduce_scatter": u.plan.sync.reduce_scatter,
                           "replica_all_reduce": u.plan.sync.replica_all_reduce,
                           "reduce_dtype": _dtype_name(u.reduce_dtype)} for u in self.units]}


class HSDPEngine(FSDPEngine):
    """engine=hsdp: FSDPEngine on a 2-D mesh, shards all-reduced across replicas."""

    capabilities = Capabilities(sharded=True, replicas=True)


def _dtype_name(dtype: torch.dtype | None) -> str | None:
    """None: the parameters' own (fp32)."""
    return None if dtype is None else str(dtype).removeprefix("torch.")


def _count_all_reduce(counts: CommCounts, group: str) -> Callable[[torch.Tensor], None]:
    """HSDP's all-reduce hook: called with the all-reduced shard after each all-reduce across
    replicas (FSDP skips it while replica_all_reduce waits for the boundary)."""
    def hook(reduced: torch.Tensor) -> None:
        counts.add_collective("all_reduce", group, reduced.numel() * reduced.element_size())

    return hook


UNUSED_WHY = ("FSDP would leave them out of the unit's reduce-scatter (no earlier micro-batch "
              "of the window used them either), whose size then differs from a rank that used "
              "them (gloo aborts)")


def _without_gradient(group: Any) -> list[str]:
    """The trainable parameters of an FSDP parameter group that hold no gradient (none from
    this backward, none accumulated in the window's earlier no_sync micro-batches)."""
    out = []
    for fp in group.fsdp_params:
        whole = getattr(fp, "_unsharded_param", None)
        if (fp.sharded_param.requires_grad and (whole is None or whole.grad is None)
                and fp.unsharded_accumulated_grad is None):
            out.append(fp._param_fqn or "?")
    return out


def _refuse_unused(units: list[Any]) -> None:
    """Without find_unused_parameters: the parameters a synchronising backward gave no gradient
    raise UnusedParameters before any reduce-scatter could miss them. FSDP2 reduce-scatters only
    the gradients a unit holds; ranks that miss different parameters then send tensors of
    different sizes, and gloo aborts the process (SIGABRT: "Received data size doesn't match
    expected size"). FSDP reduces what accumulated since the last synchronisation, so a gradient
    of an earlier no_sync micro-batch of the window counts (DDP needs one in the synchronising
    backward). Two places: each parameter group's post_backward (run by autograd once the unit's
    gradients are in), and, before FSDP's final callback runs the post_backward of every unit
    autograd did not reach (units whose inputs need no gradient, the root, a unit whose forward
    a rank skipped), all those units at once: one of them must not reduce-scatter before
    another's missing gradient is seen. Not seen in time: a unit skipped on one rank whose
    peers reduce-scatter it from autograd, before the callback (the collectives then pair up
    wrongly)."""
    from torch.distributed.fsdp._fully_shard._fsdp_common import TrainingState

    groups = [g for u in units for g in fsdp_param_groups(u)]

    def pending(g: Any) -> bool:  # to be reduced, not yet in this backward
        return bool(g.reduce_grads) and g._training_state != TrainingState.POST_BACKWARD

    for group in groups:
        def checked(*args: Any, group: Any = group, post_backward: Any = group.post_backward
                    ) -> Any:
            missing = _without_gradient(group) if pending(group) else []
            if missing:
                raise unused_error(missing, UNUSED_WHY)
            return post_backward(*args)

        group.post_backward = checked
    for unit in units:  # any unit's state may queue the callback (its _pre_backward)
        state = unit._get_fsdp_state()

        def final(final: Any = state._root_post_backward_final_callback) -> None:
            missing = [n for g in groups if pending(g) for n in _without_gradient(g)]
            if missing:
                raise unused_error(missing, UNUSED_WHY)
            final()

        state._root_post_backward_final_callback = final


def _hosts() -> int:
    """The number of hosts the ranks run on (engine.replicas=0: one replica per host)."""
    names: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(names, socket.gethostname())
    return len(set(names))


def _build(name: str, model: nn.Module, wire: Wire, device: torch.device,
           world_size: int, counts: CommCounts, memory: MemoryMeter | None, precision: str,
           fsdp_units: str, replicas: int, find_unused: bool = False,
           compile: Compile | None = None) -> FSDPEngine:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    memory = memory if memory is not None else MemoryMeter(device)
    # torch 2.13 warns once per process when a unit's forward returns a view (a Linear on a
    # 3-D input does); the loop never modifies a forward's output in place
    warnings.filterwarnings("ignore", message="FSDP2-wrapped module .* returned a view tensor")
    if wire.bind(model):
        raise ConfigError("a sync policy that averages parameter groups itself cannot run on "
                          f"engine={name}")
    plan = plan_units(model, fsdp_units, wire)
    replicate = 1
    if name == "hsdp":
        replicate = replicas or _hosts()
        if world_size % replicate:
            raise ConfigError(f"engine=hsdp: {replicate} replicas do not divide the "
                              f"{world_size} ranks evenly; set engine.replicas")
        if replicate == 1:  # see the module's docstring
            log.info("engine=hsdp with one replica of %d ranks: built as fsdp, on a 1-D "
                     "mesh (no all-reduce over a 1-rank replicate group)", world_size)
    if replicate > 1:
        mesh = init_device_mesh(device.type, (replicate, world_size // replicate),
                                mesh_dim_names=("replicate", "shard"))
    else:
        mesh = init_device_mesh(device.type, (world_size,), mesh_dim_names=("shard",))
    param_dtype = torch.bfloat16 if precision == "bf16" else None
    reduce_scatter, all_gather = _collectives()
    units = []
    if compile:  # each unit below the root: its forward, between FSDP's hooks (compiled.py)
        for u in plan:
            if u.name:
                compile.compile_forward(model.get_submodule(u.name))
    for u in plan:  # innermost first: fully_shard is applied bottom-up
        # with bf16 parameters, reduce in fp32 unless the policy's wire is lower
        reduce_dtype = u.sync.wire or (torch.float32 if param_dtype else None)
        module = fully_shard(model.get_submodule(u.name), mesh=mesh, mp_policy=MixedPrecisionPolicy(
            param_dtype=param_dtype, reduce_dtype=reduce_dtype))
        module.set_custom_reduce_scatter(reduce_scatter(counts, u.sync.group))
        module.set_custom_all_gather(all_gather(counts, u.sync.group))
        if name == "hsdp" and replicate > 1:
            module.set_all_reduce_hook(_count_all_reduce(counts, u.sync.group))
        if find_unused:  # zeros for a parameter without gradient: every rank sends every one
            module.set_reduce_scatter_unused_params(True, recurse=False)
        units.append(Unit(u, module, reduce_dtype))
    if not find_unused:
        _refuse_unused([u.module for u in units])
    cls = HSDPEngine if name == "hsdp" else FSDPEngine
    engine = cls(name, model, units, {"replicate": replicate, "shard": world_size // replicate},
                 counts, memory, param_dtype, find_unused)
    engine.compiled = compile
    return engine


def build_fsdp(model: nn.Module, wire: Wire, device: torch.device, world_size: int,
               counts: CommCounts, memory: MemoryMeter | None = None, precision: str = "fp32",
               fsdp_units: str = AUTO_UNITS, find_unused_parameters: bool = False,
               compile: Compile | None = None) -> FSDPEngine:
    """FSDP over every rank (a 1-D mesh), reducing as the policy's wire plans (sharded_sync)."""
    return _build("fsdp", model, wire, device, world_size, counts, memory, precision,
                  fsdp_units, 1, find_unused_parameters, compile)


def build_hsdp(model: nn.Module, wire: Wire, device: torch.device, world_size: int,
               counts: CommCounts, memory: MemoryMeter | None = None, precision: str = "fp32",
               fsdp_units: str = AUTO_UNITS, replicas: int = 0,
               find_unused_parameters: bool = False,
               compile: Compile | None = None) -> FSDPEngine:
    """HSDP: shard inside world / replicas ranks, replicate across `replicas` (0: one per
    host) such groups (a 2-D mesh)."""
    return _build("hsdp", model, wire, device, world_size, counts, memory, precision,
                  fsdp_units, replicas, find_unused_parameters, compile)


# engine=<name> (conf/engine/<name>.yaml): gradsync.engines collects these
ENGINES = {"fsdp": Registered(FSDPEngine, build_fsdp, FSDPSettings),
           "hsdp": Registered(HSDPEngine, build_hsdp, HSDPSettings)}
