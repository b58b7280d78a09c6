"""The run's preflight: every check a composed config must pass before any worker starts, ending
in the one typed ``RunConfig`` the workers use. First the checks on the config itself
(config/validate.py), then each component built as a worker builds it and held against its
contract (the data, a meta-device model, the optimizer, LR scheduler and sync policy), then
what the parts must agree on (the engine's limits, the loss's unit, the noise scale). A failed
check raises ``ConfigError`` with one line naming the key and what is allowed. No Hydra here.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import replace
from functools import partial
from typing import TYPE_CHECKING, Any

from gradsync import hf
from gradsync.components import (
    CheckContext,
    ConfigError,
    build,
    check,
    config_args,
    kind_of,
    locate,
    parameters,
    reason,
    require,
    require_fits,
)
from gradsync.config.schema import RunConfig
from gradsync.config.validate import DATA_SIZES, RUNTIME, check_shape, first_line, validate
from gradsync.data.contract import DataBundle, build_data, check_bundle
from gradsync.engines import able, capabilities, settings_of
from gradsync.models import build_on_meta, check_call, model_call
from gradsync.run.placement import Placement, place_job
from gradsync.sync.layer_sync import parameter_infos
from gradsync.train import noise_scale, weight_decay
from gradsync.train.schedules import build_schedule, total_optimizer_steps

if TYPE_CHECKING:
    from torch import nn

    from gradsync.sync.policy import SyncPolicy

__all__ = ["ConfigError", "RunConfig", "preflight"]


def preflight(plain: dict[str, Any], placement: Placement | None = None) -> RunConfig:
    """Every check a composed config (plain data) must pass before any worker starts; the
    checked, typed config. placement: where the job's ranks run (the entry point's; default:
    the placement the config's trainer.backend and trainer.devices give here)."""
    if placement is None:
        check_shape(plain)  # the keys first, as validate checks them, then the placement
        placement = place_job(plain["trainer"]["backend"], plain["trainer"]["devices"])
    cfg = validate(plain, placement.world_size, placement.device_type)
    model, policy = check_components(plain, cfg, placement.world_size)
    check_engine(cfg, placement.world_size, placement.device_type, model, policy)
    noise_scale.check(cfg, placement.world_size, policy,
                      capabilities(cfg.engine.name).gradient_probe)
    return cfg


def check_components(plain: dict[str, Any], cfg: RunConfig,
                     world: int) -> tuple[nn.Module, SyncPolicy]:
    """Every component against its callable's signature and own checks, then against its
    contract, built as a worker builds it: the data (data/contract.py
    build_data) is a DataBundle with the sizes it declares; every size the model needs is
    one the data provides; the model (built on the meta device: no memory for the weights) is
    an nn.Module that fits in this machine's memory; the optimizer factory returns an
    optimizer and the LR scheduler factory a scheduler; the loss's unit; the sync policy meets
    the policy contract. Returns the model and the policy it built (for the checks after it)."""
    import torch

    data_node = plain["data"]
    model_node, call = model_call(plain["model"])  # _forward_: how the loop calls the model
    ctx = CheckContext("", world, cfg.precision.name, provided={
        "allreduce": cfg.engine.settings.get("allreduce"),
        "clip_grad_norm": cfg.trainer.clip_grad_norm})
    builder = check("data", data_node, RUNTIME["data"], replace(ctx, group="data"))
    data = check_bundle(built("data", cfg.data.target,
                              lambda: build_data(data_node, cfg.seed)),
                        builder, cfg.data.target)
    check_sizes(model_node, cfg.data.target, data.sizes)
    check("model", model_node, tuple(data.sizes),
          replace(ctx, group="model", provided=ctx.provided | {"sizes": data.sizes}))
    hf.check_nested_configs(model_node, data.sizes)  # a transformers config as a nested node
    model = built("model", cfg.model.target, lambda: build_on_meta(model_node, data.sizes))
    if not isinstance(model, torch.nn.Module):
        raise ConfigError(f"model ({cfg.model.target}): returned {kind_of(model)}, which is no "
                          "torch.nn.Module")
    probe = probe_batch(data)
    if probe is not None:
        check_call(model, call, *probe, data.sizes, cfg.model.target, data.loss)
    tensors = [*model.parameters(), *model.buffers()]
    require_fits(sum(t.numel() * t.element_size() for t in tensors),
                 f"model ({cfg.model.target}): its {sum(p.numel() for p in tensors):,} "
                 "parameters and buffers")
    # sync.groups: every rule must match one of the model's parameters
    ctx.provided["parameters"] = lambda: parameter_infos(model)
    optimizer_node, no_decay = weight_decay.split(plain["optimizer"])
    weight_decay.check(no_decay, (n for n, _ in model.named_parameters()))
    for group, node in (("sync", plain["sync"]), ("optimizer", optimizer_node),
                        ("lr_scheduler", plain["lr_scheduler"])):
        check(group, node, RUNTIME[group], replace(ctx, group=group))
    check_trackers(plain.get("logger") or {})
    cfg.loss.check(data.unit, cfg.data.target)
    optimizer = check_optimizer(optimizer_node)
    local_samples = -(-len(data.train) // world)  # type: ignore[arg-type]
    check_lr_scheduler(cfg.lr_scheduler.node, optimizer, total_optimizer_steps(
        build_schedule(cfg.schedule, world), cfg.trainer.max_epochs,
        cfg.trainer.max_steps, local_samples, cfg.micro_batch_size))
    return model, check_policy(cfg, world)


def check_trackers(loggers: dict[str, Any]) -> None:
    """Each experiment tracker (logger.<name>) against its signature and its own check (an
    extra that is not installed: one line naming it), built as the worker builds it: a
    train/trackers.py Tracker (start, log, flush, finish)."""
    from gradsync.train.trackers import Tracker

    for name, node in loggers.items():
        group = f"logger.{name}"
        check(group, node, (), CheckContext(group))
        tracker = built(group, node["_target_"], partial(build, node))
        if not all(callable(getattr(tracker, m, None)) for m in ("start", "log", "finish")):
            raise ConfigError(f"{group} ({node['_target_']}): returned {kind_of(tracker)}, "
                              f"which is no tracker (train/trackers.py {Tracker.__name__}: "
                              "start, log, flush, finish)")


def probe_batch(data: DataBundle) -> tuple[Any, Any] | None:
    """A micro-batch of the data's shape for the model's check, made without reading the data:
    token data's longest (two sequences of max_len tokens); None for other data (no check:
    its samples may be costly to read, and are read by the ranks)."""
    import torch

    if data.unit != "tokens" or "max_len" not in data.sizes:
        return None
    shape = (2, data.sizes["max_len"])
    return torch.zeros(shape, dtype=torch.long), torch.zeros(shape, dtype=torch.long)


def built(group: str, target: str, make: Callable[[], Any]) -> Any:
    """What a component's target returns, built for a check: whatever it raises is one line
    naming the component."""
    try:
        return make()
    except ConfigError:
        raise
    except Exception as e:
        raise ConfigError(f"{group} ({target}) cannot be built: {reason(e)}") from None


def check_sizes(model_node: dict[str, Any], data_target: str, sizes: dict[str, int]) -> None:
    """Every parameter the model requires that its config does not set is a size the data
    provides (the worker passes the model the data's sizes it names)."""
    target = model_node["_target_"]
    args = config_args(model_node)
    for name, p in parameters(locate(target, "model._target_")).items():
        if p.default is p.empty and name not in args and name not in sizes:
            also = "" if name in DATA_SIZES else f"; nor does the config set model.{name}"
            raise ConfigError(f"model: {target} needs {name}, which data ({data_target}) does "
                              f"not provide (it provides {', '.join(sizes) or 'no sizes'})"
                              f"{also}")


def check_policy(cfg: RunConfig, world: int) -> Any:
    """The sync component builds a policy (sync/policy.py's contract: should_sync(micro_index,
    window_size)); built here as a worker builds it, without a model. Returns it."""
    from gradsync.sync.comm import PLAIN, CommCounts, decides_per_bucket
    from gradsync.sync.policy import as_policy

    runtime = {"uses_scaler": cfg.precision.name == "fp16", "world_size": world,
               "counts": CommCounts()}
    policy = as_policy(build(cfg.sync.node, runtime), cfg.sync.target)
    if decides_per_bucket(policy.wire or PLAIN) and not capabilities(cfg.engine.name).per_bucket:
        raise ConfigError(f"sync ({cfg.sync.target}) decides per gradient bucket "
                          f"(sync_bucket), which engine={cfg.engine.name} cannot "
                          f"carry out: set engine={' or '.join(able('per_bucket'))}")
    return policy


def check_engine(cfg: RunConfig, world: int, device_type: str, model: nn.Module,
                 policy: SyncPolicy) -> None:
    """The engine's settings against its own dataclass and checks, then what the chosen engine
    cannot run with the other choices (a sharded engine: fp16, model averaging, a unit whose
    parameters reduce differently...; engines/fsdp.py check_config). model, policy: as
    check_components built them (the model on the meta device, else on the CPU)."""
    from gradsync.engines.fsdp import check_config

    name = cfg.engine.name
    can = capabilities(name)
    settings = settings_of(cfg.engine)
    settings.check(device_type)
    bucket_cap_mb = getattr(settings, "bucket_cap_mb", None)
    if cfg.compile.enabled and bucket_cap_mb is not None and \
            bucket_cap_mb < can.compile_min_bucket_mb:
        raise ConfigError(f"engine.bucket_cap_mb={bucket_cap_mb} with compile.enabled=true: "
                          f"torch's DDPOptimizer needs buckets of at least "
                          f"{can.compile_min_bucket_mb:g} MB (its first bucket's size)")
    from torch.nn.modules.batchnorm import _BatchNorm

    if getattr(settings, "sync_batchnorm", False) and \
            not any(isinstance(m, _BatchNorm) for m in model.modules()):
        raise ConfigError(f"engine.sync_batchnorm=true: the model ({cfg.model.target}) has no "
                          "BatchNorm layer to synchronise")
    check_config(name, settings, can, cfg.trainer.check_replicas, cfg.sync.node,
                 cfg.precision.name, world, policy=lambda: policy, model=lambda: model)


def check_optimizer(node: dict[str, Any]) -> Any:
    """The optimizer's own argument checks (torch raises on lr=nan, betas out of range...), run
    on one dummy parameter; what the factory returns must be a torch optimizer. Returns it."""
    import torch

    for key, value in node.items():
        values = value if isinstance(value, (list, tuple)) else [value]
        numbers = [v for v in values if isinstance(v, (int, float)) and not isinstance(v, bool)]
        require(all(map(math.isfinite, numbers)), f"optimizer.{key}", "finite numbers", value)
    try:
        optimizer = build(node)([torch.nn.Parameter(torch.zeros(1))])
    except Exception as e:
        raise ConfigError(f"optimizer ({node['_target_']}) refuses its arguments: "
                          f"{type(e).__name__}: {first_line(str(e))}") from None
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise ConfigError(f"optimizer ({node['_target_']}): returned {kind_of(optimizer)}, "
                          "which is no torch.optim.Optimizer")
    if isinstance(optimizer, _divides_by_eps()):  # torch itself accepts eps=0
        eps = optimizer.defaults.get("eps")
        require(not isinstance(eps, (int, float)) or eps > 0, "optimizer.eps",
                f"a positive number ({type(optimizer).__name__} divides by sqrt(v) + eps: with "
                "eps=0 a parameter whose gradients are 0 gets a NaN step)", eps)
    return optimizer


def _divides_by_eps() -> tuple[type, ...]:
    import torch

    return tuple(getattr(torch.optim, name) for name in (
        "Adam", "AdamW", "Adamax", "NAdam", "RAdam", "Adagrad", "RMSprop", "Adadelta",
        "SparseAdam") if hasattr(torch.optim, name))


def check_lr_scheduler(node: dict[str, Any], optimizer: Any, total_steps: int) -> None:
    """The LR scheduler factory, called as a worker calls it (on the dummy optimizer), returns
    a scheduler: something to step once per optimizer step and to save and restore."""
    try:
        scheduler = build(node, {"optimizer": optimizer, "total_steps": total_steps})
    except Exception as e:
        raise ConfigError(f"lr_scheduler ({node['_target_']}) refuses its arguments: "
                          f"{type(e).__name__}: {first_line(str(e))}") from None
    if not all(callable(getattr(scheduler, m, None))
               for m in ("step", "state_dict", "load_state_dict")):
        raise ConfigError(f"lr_scheduler ({node['_target_']}): returned {kind_of(scheduler)}, "
                          "which is no LR scheduler (it needs step, state_dict and "
                          "load_state_dict)")
