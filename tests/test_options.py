"""Every option has a check that refuses nonsense (issue 26): every field of every settings
dataclass and every parameter of every built-in component is enumerated from the code, fed
values of the wrong type (derived from its annotation), NaN and infinities where it takes a
number, and the values out of its range that OPTIONS lists, and each must be a ConfigError
naming the option, before any worker starts. An option that is not in OPTIONS fails the
enumeration test: a new option cannot arrive unchecked."""

from __future__ import annotations

import copy
import functools
import math
import typing
from pathlib import Path

import pytest
import yaml

from gradsync.components import ConfigError, hints, locate, parameters
from gradsync.config.schema import (
    SCHEDULES,
    CompileConfig,
    EngineConfig,
    LossConfig,
    LRScalingConfig,
    NoiseScaleConfig,
    PrecisionConfig,
    TrainerConfig,
)
from gradsync.config.validate import RUNTIME
from gradsync.engines import ENGINES
from gradsync.run.main import CONF_DIR, compose_plain
from gradsync.run.preflight import preflight

# The overrides that choose each option's component (a built-in YAML option) or schema.
CHOICES = {"": [], "model=transformer": ["model=transformer", "data=synthetic_lm"],
           "data=synthetic": ["data=synthetic"], "data=digits": ["data=digits"],
           "data=synthetic_lm": ["data=synthetic_lm", "model=transformer"],
           "data=stdlib_text": ["data=stdlib_text", "model=transformer"],
           "sync=accumulate": ["sync=accumulate"], "sync=amp_aware": ["sync=amp_aware"],
           "sync=local_sgd": ["sync=local_sgd"], "sync=diloco": ["sync=diloco"],
           "lr_scheduler=cosine": ["lr_scheduler=cosine"],
           "schedule=constant": ["schedule=constant"],
           "schedule=epochwise": ["schedule=epochwise"],
           "schedule=global_batch": ["schedule=global_batch", "schedule.global_batch_size=64"],
           "schedule=adaptive": ["schedule=adaptive"],
           "precision=fp16": ["precision=fp16"], "model=mlp": ["model=mlp"],
           "model=hf_llama": ["model=hf_llama", "data=synthetic_lm"],
           "engine=fsdp": ["engine=fsdp"], "engine=hsdp": ["engine=hsdp"]}
BIG = 10**15  # a size no machine holds (bytes, samples, parameters)

# Each option: the values out of its range (besides the wrong types, NaN and infinities
# every option is fed), or, for an option whose every value of its type is legal, why.
OPTIONS: dict[tuple[str, str], list | str] = {
    # --- trainer (config/schema.py TrainerConfig) ------------------------------------------
    ("", "trainer.devices"): [0, -1, 10**6],
    ("", "trainer.max_steps"): [0, -2],
    ("", "trainer.max_epochs"): [0, -1, 10**9],
    ("", "trainer.log_every_windows"): [0, -1],
    ("", "trainer.eval_every_steps"): [-1],
    ("", "trainer.backend"): ["mpi", ""],
    ("", "trainer.bits"): ["exact", ""],
    ("", "engine.name"): ["ddp", ""],
    ("", "trainer.threads_per_worker"): [-1, 10**9],
    ("", "trainer.progress_bar"): "true or false: both are choices",
    ("", "trainer.clip_grad_norm"): [-1.0],
    ("", "engine.gradient_as_bucket_view"): "true or false: both are choices",
    ("", "engine.bucket_cap_mb"): [0, -1.0, 1e20],
    ("", "engine.allreduce"): ["nccl", ""],
    ("", "trainer.timeout_s"): [0, -1, 10**20],
    ("", "trainer.deterministic"): "true, false or null (the device's default): all choices",
    ("", "trainer.checkpoint_every_steps"): [-1],
    ("", "trainer.keep_checkpoints"): [0, -1],
    ("", "trainer.num_workers"): [-1, 10**6],
    ("", "trainer.check_replicas"): [-1],
    ("", "trainer.fail_at_step"): [0, -2],
    ("", "trainer.requeue"): "true or false: both are choices",
    ("", "engine.find_unused_parameters"): "true or false: both are choices",
    ("", "noise_scale.enabled"): "true or false: both are choices",
    ("", "noise_scale.decay"): [0, -0.5, 1.0, 1.5],
    ("", "engine.trace_sync"): "true or false: both are choices",
    # true needs CUDA ranks, a DDP engine and a model with BatchNorm: none here
    ("", "engine.sync_batchnorm"): [True],
    # true: refused with the default bucket size below 1 MB? no: 25 MB; a backend, a mode
    ("", "compile.enabled"): "true or false: both are choices",
    ("", "compile.backend"): ["nope", ""],
    ("", "compile.mode"): ["fastest"],
    ("", "compile.dynamic"): "true, false or null (torch's default): all choices",
    # the sharded engines' settings (engines/fsdp.py), checked against the model
    ("engine=fsdp", "engine.fsdp_units"): ["", "nope*", "0.weight"],
    ("engine=fsdp", "engine.find_unused_parameters"): "true or false: both are choices",
    ("engine=hsdp", "engine.fsdp_units"): ["", "nope*", "0.weight"],
    ("engine=hsdp", "engine.find_unused_parameters"): "true or false: both are choices",
    ("engine=hsdp", "engine.replicas"): [-1, 5],
    # --- schedule, precision, loss ----------------------------------------------------------
    ("schedule=constant", "schedule.name"): ["linear", ""],
    ("schedule=constant", "schedule.window_size"): [0, -1],
    ("schedule=constant", "schedule.micro_batch_size"): [0, -1],
    ("schedule=epochwise", "schedule.micro_batch_size"): [0, -1],
    ("schedule=global_batch", "schedule.micro_batch_size"): [0, -1],
    ("schedule=adaptive", "schedule.micro_batch_size"): [0, -1],
    ("schedule=epochwise", "schedule.name"): ["linear"],
    ("schedule=epochwise", "schedule.window_size_by_epoch"):
        ["2", [2], {1: 2}, {0: 0}, {0: 2, -1: 2}, {0: "2"}, {0: True}, {0: 1.5}],
    ("schedule=global_batch", "schedule.name"): ["linear"],
    ("schedule=global_batch", "schedule.global_batch_size"): [0, -64, 48],
    ("schedule=adaptive", "schedule.name"): ["linear"],
    ("schedule=adaptive", "schedule.scale"): [0, -1.0],
    ("schedule=adaptive", "schedule.initial_window_size"): [0, -1, 2**21],
    ("schedule=adaptive", "schedule.min_window_size"): [0, -1, 10**9],
    ("schedule=adaptive", "schedule.max_window_size"): [0, -1, 2**21],
    ("schedule=adaptive", "schedule.every_steps"): [0, -1],
    ("", "lr_scaling.name"): ["cubic", ""],
    ("", "lr_scaling.reference_batch"): [-1],
    ("precision=fp16", "precision.name"): ["fp64", "int8"],
    ("precision=fp16", "precision.init_scale"): [0, -1.0, 1e39],
    ("precision=fp16", "precision.growth_interval"): [0, -1, 2**31, 10**20],
    ("precision=fp16", "precision.growth_factor"): [1.0, 0.5, 0],
    ("precision=fp16", "precision.backoff_factor"): [0, 1.0, 1.5, -0.5],
    ("", "loss.normalize"): ["mean", ""],
    # --- top level --------------------------------------------------------------------------
    ("", "seed"): [-1, 2**63],
    ("", "resume"): ["", "/no/such/checkpoint.pt", "latest"],
    # --- models (gradsync/models.py) ----------------------------------------------------------
    ("model=hf_llama", "model.config_class"): ["torch.nn.Linear", "transformers.Nope", "x"],
    ("model=hf_llama", "model.config"): [{"hiden_size": 8}, {"vocab_size": 8}],
    ("model=hf_llama", "model.attn_implementation"): ["flash_attention_2", ""],
    ("model=hf_llama", "model.max_parameters"): [0, -1],
    ("model=hf_llama", "model.max_layers"): [0, -1],
    ("model=mlp", "model.hidden_sizes"): [[0], [-1], [8, 0], [10**12], [BIG, BIG]],
    ("model=mlp", "model.activation"): ["softmax", ""],
    ("model=mlp", "model.dropout"): [-0.1, 1.0, 2],
    ("model=transformer", "model.d_model"): [0, -2, 33, 10**8],
    ("model=transformer", "model.n_layers"): [0, -1, 10**12],
    ("model=transformer", "model.n_heads"): [0, -1, 3],
    ("model=transformer", "model.mlp_ratio"): [0, -1, 10**12],
    # --- data (gradsync/data/) ----------------------------------------------------------------
    ("data=synthetic", "data.num_samples"): [0, -1, BIG],
    ("data=synthetic", "data.eval_samples"): [0, -1, BIG],
    ("data=synthetic", "data.in_dim"): [0, -1, BIG],
    ("data=synthetic", "data.out_dim"): [0, -1, BIG],
    ("data=synthetic", "data.noise"): [-0.1],
    ("data=digits", "data.test_fraction"): [0, 1, -0.5, 1.5],
    ("data=digits", "data.split_seed"): [-1],
    ("data=synthetic_lm", "data.num_samples"): [0, -1, BIG],
    ("data=synthetic_lm", "data.eval_samples"): [0, -1, BIG],
    ("data=synthetic_lm", "data.vocab_size"): [0, 1, BIG],
    ("data=synthetic_lm", "data.min_len"): [0, 1, 65],
    ("data=synthetic_lm", "data.max_len"): [3, BIG],
    ("data=synthetic_lm", "data.max_stride"): [0, 32],
    ("data=synthetic_lm", "data.noise"): [-0.1, 1.5],
    ("data=stdlib_text", "data.max_len"): [0, 1, BIG],
    ("data=stdlib_text", "data.max_bytes"): [0, -1, 1],
    ("data=stdlib_text", "data.eval_fraction"): [0, 1, 1.5],
    ("data=stdlib_text", "data.root"): ["/no/such/dir", ""],
    ("data=stdlib_text", "data.packed"): "true or false: both are choices",
    # --- sync policies (gradsync/sync/) -------------------------------------------------------
    ("sync=accumulate", "sync.compression"): ["topk", ""],
    ("sync=accumulate", "sync.powersgd_rank"): [0, -1],
    ("sync=accumulate", "sync.powersgd_start_backwards"): [1, 0, -1],
    ("sync=accumulate", "sync.groups"):
        [[5], [{"params": 5}], [{"params": "*", "every": 0}], [{"params": "nope*"}],
         [{"params": "*", "comm_dtype": "int8"}], [{"params": "*", "foo": 1}]],
    ("sync=amp_aware", "sync.comm_dtype"): ["int8", "fp16"],
    ("sync=amp_aware", "sync.overflow_consensus"): "true or false: both are choices",
    ("sync=amp_aware", "sync.compression"): ["topk"],
    ("sync=amp_aware", "sync.powersgd_rank"): [0],
    ("sync=amp_aware", "sync.powersgd_start_backwards"): [1],
    ("sync=amp_aware", "sync.groups"): [[5], [{"params": "nope*"}]],
    ("sync=accumulate", "sync.reduce_scatter"): ["nope", "", "every"],
    ("sync=accumulate", "sync.replica_all_reduce"): ["nope", "", "every", "boundary"],
    ("sync=amp_aware", "sync.reduce_scatter"): ["nope", ""],
    ("sync=amp_aware", "sync.replica_all_reduce"): ["nope", ""],
    ("sync=local_sgd", "sync.every"): [0, -1],
    ("sync=local_sgd", "sync.warmup_windows"): [-1],
    ("sync=local_sgd", "sync.comm_dtype"): ["fp16", "int8"],
    ("sync=diloco", "sync.every"): [0],
    ("sync=diloco", "sync.warmup_windows"): [-1],
    ("sync=diloco", "sync.comm_dtype"): ["fp16"],
    ("sync=diloco", "sync.outer_lr"): [0, -0.7],
    ("sync=diloco", "sync.outer_momentum"): [-0.1, 1.0],
    ("sync=diloco", "sync.outer_nesterov"): "true or false (true needs outer_momentum > 0)",
    # --- LR schedulers (gradsync/train/lr_schedulers.py) --------------------------------------
    ("lr_scheduler=cosine", "lr_scheduler.warmup_steps"): [-1],
    ("lr_scheduler=cosine", "lr_scheduler.min_lr_ratio"): [-0.1, 1.5],
    ("lr_scheduler=cosine", "lr_scheduler.warmup"): ["linear", ""],
}


def enumerated() -> dict[tuple[str, str], typing.Any]:
    """Every option the code has, with its annotated type: the settings dataclasses' fields and
    the parameters of every built-in component (conf/'s YAML options with a gradsync
    target), those the worker passes at run time left out; optimizers are torch's own."""
    found: dict[tuple[str, str], typing.Any] = {}
    for choice, group, cls in [("", "trainer", TrainerConfig), ("", "compile", CompileConfig),
                               ("", "noise_scale", NoiseScaleConfig),
                               ("precision=fp16", "precision",
                                                               PrecisionConfig),
                               ("", "loss", LossConfig), ("", "lr_scaling", LRScalingConfig),
                               *((f"schedule={n}", "schedule", c) for n, c in SCHEDULES.items())]:
        for name, hint in typing.get_type_hints(cls).items():
            found[choice, f"{group}.{name}"] = hint
    found["", "seed"], found["", "resume"], found["", "engine.name"] = int, str, str
    kinds = set()  # each engine's own settings (their module's dataclass), once per dataclass
    for name, registered in ENGINES.items():
        if registered.settings not in kinds:
            kinds.add(registered.settings)
            choice = "" if name == EngineConfig().name else f"engine={name}"
            for key, hint in typing.get_type_hints(registered.settings).items():
                found[choice, f"engine.{key}"] = hint
    for group in ("model", "data", "sync", "lr_scheduler"):
        for path in sorted((Path(CONF_DIR) / group).glob("*.yaml")):
            target = locate(yaml.safe_load(path.read_text())["_target_"])
            choice = f"{group}={path.stem}"
            types = hints(target)
            for name in parameters(target):
                if name not in RUNTIME[group]:
                    found[choice, f"{group}.{name}"] = types.get(name, typing.Any)
    return found


ENUMERATED = enumerated()


def test_every_option_is_listed_with_its_nonsense_or_why_every_value_is_legal():
    assert [o for o in ENUMERATED if o not in OPTIONS] == [], "options without a listed check"
    assert [o for o in OPTIONS if o not in ENUMERATED] == [], "options the code no longer has"
    assert all(c in CHOICES for c, _ in OPTIONS)


def wrong_types(hint: typing.Any) -> list:
    """Values of a type the option does not take, NaN and infinities where it takes a
    number."""
    args = set(typing.get_args(hint)) or {hint}
    if hint is typing.Any:
        return []
    values: list = [] if type(None) in args else [None]
    if bool in args:
        values += ["maybe", "true", 1]
    elif int in args:
        values += ["3", 1.5, True]
    elif float in args:
        values += ["0.5", True, math.nan, math.inf, -math.inf]
    elif str in args:
        values += [5, True]
    elif typing.get_origin(hint) in (list, tuple) or {typing.get_origin(a) for a in args} & {
            list, tuple}:
        values += ["16", 16, [1.5], [True], ["a"]] if "int" in str(hint) else ["16", 16]
    return values


@functools.cache
def composed(choice: str) -> dict:
    return compose_plain(CHOICES[choice])


def with_value(choice: str, key: str, value) -> dict:
    cfg = copy.deepcopy(composed(choice))
    node = cfg
    *parents, last = key.split(".")
    for part in parents:
        node = node[part]
    node[last] = value
    return cfg


@pytest.mark.parametrize("choice,key", list(ENUMERATED), ids=[f"{c} {k}".strip()
                                                              for c, k in ENUMERATED])
def test_every_option_refuses_nonsense_naming_itself(choice, key):
    preflight(composed(choice))  # the option's own default is fine
    listed = OPTIONS.get((choice, key), [])
    nonsense = wrong_types(ENUMERATED[choice, key]) + (listed if isinstance(listed, list)
                                                       else [])
    assert nonsense, f"{key}: nothing to refuse"
    accepted, unnamed = [], []
    for value in nonsense:
        try:
            preflight(with_value(choice, key, value))
        except ConfigError as e:
            if key.rpartition(".")[2] not in str(e):
                unnamed.append((value, str(e)))
        else:
            accepted.append(value)
    assert accepted == [] and unnamed == []
