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

from gradsync.components import CheckContext, ConfigError, checks, locate, require, require_extra

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
                 config: dict[str, Any] = TINY_LLAMA, attn_implementation: str = "eager"):
        super().__init__()
        transformers = _transformers()
        hf_config = _config_class(config_class)(
            **config, vocab_size=vocab_size, max_position_embeddings=max_len)
        self.model = transformers.AutoModelForCausalLM.from_config(
            hf_config, attn_implementation=attn_implementation)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids=x, use_cache=False).logits
