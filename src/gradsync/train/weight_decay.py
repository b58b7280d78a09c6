"""Weight-decay groups by config: the optimizer node's ``no_decay`` (read by gradsync, never
passed to the optimizer) names the parameters that get ``weight_decay: 0``; the optimizer then
gets two parameter groups, ``decay`` (its own weight_decay) and ``no_decay``, each holding its
parameters' names (torch's named parameter groups), so a checkpoint's ``optimizer``
``param_groups`` say which parameter is decayed.

A rule is a list of entries, each a kind of parameter or a glob over parameter names
(``fnmatch``, as ``sync.groups`` matches them):

- ``bias``: every parameter named ``bias`` (the last part of its name);
- ``norm``: the parameters of normalisation layers (torch's ``LayerNorm``, ``RMSNorm``,
  ``GroupNorm``, batch and instance norms, and any module whose class name ends in ``Norm``:
  nanoGPT's ``LayerNorm``, Llama's ``LlamaRMSNorm``);
- ``embedding``: the weights of ``nn.Embedding`` layers (a weight tied to the output head
  included).

``[bias, norm]`` (the built-in optimizers' default) is nanoGPT's rule for its GPT (no decay on
parameters of fewer than 2 dimensions) and Hugging Face Trainer's (no decay on biases and
norm weights); add ``embedding`` for minGPT's and OLMo's. ``null`` or ``[]``: one group, every
parameter decayed (torch's own behaviour).
"""

from __future__ import annotations

import fnmatch
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import nn

from gradsync.components import ConfigError, build, require

NO_DECAY = "no_decay"  # the optimizer node's key gradsync reads
KINDS = ("bias", "norm", "embedding")
_NORMS = (nn.LayerNorm, nn.GroupNorm, nn.LocalResponseNorm, nn.modules.batchnorm._NormBase,
          *((nn.RMSNorm,) if hasattr(nn, "RMSNorm") else ()))


def split(node: dict[str, Any]) -> tuple[dict[str, Any], list[str]]:
    """An optimizer node split into what builds the optimizer and its no_decay rule (empty:
    none); a rule that is not a list of strings is a ConfigError."""
    rule = node.get(NO_DECAY)
    rest = {k: v for k, v in node.items() if k != NO_DECAY}
    if rule is None:
        return rest, []
    require(isinstance(rule, list) and all(isinstance(r, str) and r for r in rule),
            f"optimizer.{NO_DECAY}", f"a list of {', '.join(KINDS)} or globs over parameter "
            "names (null: every parameter decayed)", rule)
    return rest, list(rule)


def _is_norm(module: nn.Module) -> bool:
    return isinstance(module, _NORMS) or type(module).__name__.endswith("Norm")


def undecayed(model: nn.Module, rule: list[str]) -> set[str]:
    """The names (model.named_parameters') of the parameters the rule exempts from decay."""
    names = {id(p): n for n, p in model.named_parameters()}
    out: set[str] = set()
    for module in model.modules():
        for local, p in module.named_parameters(recurse=False):
            if id(p) not in names:
                continue
            if ("norm" in rule and _is_norm(module)
                    or "embedding" in rule and isinstance(module, nn.Embedding)
                    and local == "weight"):
                out.add(names[id(p)])
    for name in names.values():
        if "bias" in rule and name.rsplit(".", 1)[-1] == "bias" or any(
                fnmatch.fnmatchcase(name, g) for g in rule if g not in KINDS):
            out.add(name)
    return out


def check(rule: list[str], names: Iterable[str]) -> None:
    """Every glob of the rule matches a parameter of the model (a typo would decay what it
    meant to exempt, silently)."""
    names = list(names)
    for glob in rule:
        if glob not in KINDS and not any(fnmatch.fnmatchcase(n, glob) for n in names):
            raise ConfigError(f"optimizer.{NO_DECAY}: {glob!r} matches no parameter of the "
                              f"model (a kind, {', '.join(KINDS)}, or a glob over its "
                              "parameter names: +inspect=params lists them)")


def param_groups(model: nn.Module, params: Iterable[torch.Tensor],
                 rule: list[str]) -> list[Any]:
    """What the optimizer gets: the parameters in `params`' order, without a rule as they are;
    with one, named groups ``decay`` and ``no_decay`` (weight_decay 0), an empty one left
    out."""
    params = list(params)
    if not rule:
        return params
    names = {id(p): n for n, p in model.named_parameters()}
    exempt = undecayed(model, rule)
    groups: dict[str, list[tuple[str, torch.Tensor]]] = {"decay": [], "no_decay": []}
    for p in params:
        name = names[id(p)]
        groups["no_decay" if name in exempt else "decay"].append((name, p))
    out: list[dict[str, Any]] = [{"params": groups["decay"], "name": "decay"},
                                 {"params": groups["no_decay"], "name": "no_decay",
                                  "weight_decay": 0.0}]
    return [g for g in out if g["params"]]  # torch wants every group named or none


def build_optimizer(node: dict[str, Any], model: nn.Module,
                    params: Iterable[torch.Tensor]) -> torch.optim.Optimizer:
    """The optimizer an optimizer node builds (``_partial_``: a factory called with the
    parameters, in groups where the node has a no_decay rule)."""
    rest, rule = split(node)
    factory: Callable[[Any], torch.optim.Optimizer] = build(rest)
    return factory(param_groups(model, params, rule))
