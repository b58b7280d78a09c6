"""Hugging Face transformers models as components (conf/model/hf_llama.yaml; docs/components.md
"Bring a Hugging Face model"). ``CausalLM`` builds a transformers causal LM from its config
class (``from_config``: random weights, no download) with the token data's ``vocab_size`` and
``max_len``, and speaks gradsync's model contract: token ids [B, T] in, next-token logits
[B, T, V] out (transformers' keyword ``input_ids`` in, its ``ModelOutput.logits`` out).

transformers is an optional dependency (``pip install 'gradsync[hf]'``; locked for the tests):
imported only when such a model is built or checked.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from gradsync.components import (
    CheckContext,
    ConfigError,
    build,
    checks,
    is_node,
    locate,
    reason,
    require,
    require_extra,
)

# model=hf_llama's default: a 2-layer Llama of width 32 (conf/model/hf_llama.yaml states it)
TINY_LLAMA: dict[str, Any] = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
                              "num_attention_heads": 2, "num_key_value_heads": 2,
                              "tie_word_embeddings": True}
ATTENTION = ("eager", "sdpa")  # transformers' attention implementations that run anywhere
FROM_DATA = {"vocab_size": "vocab_size", "max_position_embeddings": "max_len"}


def _transformers() -> Any:
    return require_extra("transformers", "hf", "model: a Hugging Face model")


def _config_class(path: str) -> Any:
    cls = locate(path, "model.config_class")
    if not (isinstance(cls, type) and issubclass(cls, _transformers().PretrainedConfig)):
        raise ConfigError(f"model.config_class={path!r} is not allowed: a transformers config "
                          "class, e.g. transformers.LlamaConfig")
    return cls


# The largest model CausalLM builds without being asked (model.max_parameters,
# model.max_layers; null: no limit): beyond it, building alone takes minutes and gigabytes.
MAX_PARAMETERS = 1_000_000_000
MAX_LAYERS = 1024


def hf_config(cls: Any, settings: dict[str, Any], sizes: dict[str, int], key: str) -> Any:
    """The config object, as the model will be built from it; what the config class itself
    refuses (transformers validates some architectures) is a ConfigError naming `key`."""
    try:
        return cls(**settings, **{name: sizes[size] for name, size in FROM_DATA.items()
                                  if size in sizes})
    except Exception as e:
        raise ConfigError(f"{key}: {cls.__name__} refuses it: {reason(e)}") from None


def check_architecture(config: Any, key: str) -> None:
    """What a transformers config accepts but its model cannot build or run: sizes below 1,
    a width its attention heads do not divide (where the config has no head_dim of its own),
    query heads that key-value heads do not divide (grouped-query attention). `key`: where the
    settings are (model.config), each named as the user wrote it (GPT-2's n_head...)."""
    names = getattr(type(config), "attribute_map", {})

    def value(attr: str) -> tuple[str, Any]:
        return f"{key}.{names.get(attr, attr)}", getattr(config, attr, None)

    for attr in ("num_hidden_layers", "hidden_size", "num_attention_heads",
                 "num_key_value_heads", "intermediate_size", "head_dim"):
        name, v = value(attr)
        if v is not None:
            require(isinstance(v, int) and v >= 1, name, "an integer >= 1", v)
    (heads_key, heads), (kv_key, kv) = value("num_attention_heads"), value("num_key_value_heads")
    if heads is None:
        return
    if kv is not None:
        require(heads % kv == 0, kv_key, f"a divisor of {heads_key}={heads} (grouped-query "
                "attention shares each key-value head among the same number of query heads)",
                kv)
    hidden_key, hidden = value("hidden_size")
    if getattr(config, "head_dim", None) is None and hidden is not None:
        require(hidden % heads == 0, hidden_key, f"a multiple of {heads_key}={heads} (each "
                "head takes an equal share of the width)", hidden)


def check_nested_configs(node: dict[str, Any], sizes: dict[str, int], key: str = "model") -> None:
    """A transformers config given as a nested node (`_target_: transformers.GPT2Config` under
    `_target_: transformers.GPT2LMHeadModel`), built as the model gets it: what its model cannot
    build or run (check_architecture), and positions fewer than the data's sequences (the
    first forward would index past them in a worker). Nothing is imported that the config did
    not name."""
    for name, value in node.items():
        if not (isinstance(value, dict) and is_node(value)):
            continue
        where = f"{key}.{name}"
        check_nested_configs(value, sizes, where)
        module = str(value["_target_"]).split(".")[0]
        if module != "transformers":
            continue
        cls = locate(value["_target_"], f"{where}._target_")
        if not (isinstance(cls, type) and issubclass(cls, _transformers().PretrainedConfig)):
            continue
        try:
            config = build(value, sizes)
        except Exception as e:
            raise ConfigError(f"{where}: {cls.__name__} refuses it: {reason(e)}") from None
        check_architecture(config, where)
        positions, longest = getattr(config, "max_position_embeddings", None), sizes.get("max_len")
        if isinstance(positions, int) and longest is not None and positions < longest:
            names = getattr(cls, "attribute_map", {})
            name_ = names.get("max_position_embeddings", "max_position_embeddings")
            raise ConfigError(f"{where}.{name_}={positions} is not allowed: at least the data's "
                              f"max_len={longest} (the positions of its longest sequence)")


def estimated_parameters(config: Any) -> int:
    """The model's parameter count without building it: one and two layers on the meta device,
    the rest by the difference (every decoder layer alike)."""
    import torch

    layers = config.num_hidden_layers

    def count(n: int) -> int:
        settings = config.to_dict() | {"num_hidden_layers": n}
        settings.pop("layer_types", None)  # per-layer lists: made again for n layers
        with torch.device("meta"):
            model = _transformers().AutoModelForCausalLM.from_config(
                type(config).from_dict(settings))
        return sum(p.numel() for p in model.parameters())

    one = count(1)
    return one if layers <= 1 else one + (layers - 1) * (count(2) - one)


def check_size(config: Any, key: str, max_parameters: int | None,
               max_layers: int | None) -> None:
    """Refuse a model above the documented size unless asked (max_parameters, max_layers;
    None: no limit): its layers counted from the config, its parameters estimated before
    anything is built."""
    names = getattr(type(config), "attribute_map", {})
    layers_key = f"{key}.{names.get('num_hidden_layers', 'num_hidden_layers')}"
    layers = config.num_hidden_layers
    if max_layers is not None and layers > max_layers:
        raise ConfigError(f"{layers_key}={layers} is not allowed: at most model.max_layers="
                          f"{max_layers} (building so many layers takes minutes; raise "
                          "model.max_layers, or null, to build it anyway)")
    if max_parameters is not None:
        try:
            n = estimated_parameters(config)
        except Exception as e:  # a size the model cannot be built with (GPT-2's n_inner=-3)
            raise ConfigError(f"{key}: its model cannot be built: {reason(e)}") from None
        if n > max_parameters:
            raise ConfigError(f"{key}: {type(config).__name__} of {n:,} parameters is not "
                              f"allowed: at most model.max_parameters={max_parameters:,} "
                              "(raise model.max_parameters, or null, to build it anyway)")


def _check(a: dict[str, Any], ctx: CheckContext) -> None:
    cls = _config_class(a["config_class"])
    settings = a["config"]
    require(isinstance(settings, dict), "model.config",
            f"a mapping of {cls.__name__}'s settings", settings)
    known = set(cls().to_dict())
    for key in settings:
        if key in FROM_DATA:
            raise ConfigError(f"model.config.{key}: set by the data ({FROM_DATA[key]}), not "
                              "here")
        if key not in known:  # transformers keeps unknown keys as attributes, unused
            raise ConfigError(f"model.config.{key}: not a setting of {cls.__name__}")
    require(a["attn_implementation"] in ATTENTION, "model.attn_implementation",
            f"one of {', '.join(ATTENTION)}", a["attn_implementation"])
    for limit in ("max_parameters", "max_layers"):
        require(a[limit] is None or isinstance(a[limit], int) and a[limit] >= 1,
                f"model.{limit}", "an integer >= 1, or null (no limit)", a[limit])
    config = hf_config(cls, settings, ctx.provided.get("sizes") or {}, "model.config")
    check_architecture(config, "model.config")
    check_size(config, "model.config", a["max_parameters"], a["max_layers"])


@checks(_check)
class CausalLM(nn.Module):
    """A transformers causal LM from its config: ``config_class`` (a dotted path) with the
    settings in ``config`` (its own keyword names; vocab_size and max_position_embeddings come
    from the data). Parameters are named as transformers names them, under ``model.``
    (``model.model.layers.0.self_attn.q_proj.weight``); tied embeddings
    (``tie_word_embeddings: true``) stay one parameter. Batches are right-padded, so the causal
    mask alone keeps real positions from attending to padding, as for the built-in Transformer.
    """

    # sharded engines: each decoder layer is a unit; embeddings, final norm and the (tied) head
    # stay in the root unit, so a tied weight is never split between two units
    fsdp_units = ("model.model.layers.*",)

    def __init__(self, vocab_size: int, max_len: int,
                 config_class: str = "transformers.LlamaConfig",
                 config: dict[str, Any] = TINY_LLAMA, attn_implementation: str = "eager",
                 max_parameters: int | None = MAX_PARAMETERS, max_layers: int | None = MAX_LAYERS):
        super().__init__()
        transformers = _transformers()
        built = hf_config(_config_class(config_class), config,
                          {"vocab_size": vocab_size, "max_len": max_len}, "model.config")
        self.model = transformers.AutoModelForCausalLM.from_config(
            built, attn_implementation=attn_implementation)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids=x, use_cache=False).logits
