"""The built-in models, ordinary ``_target_`` components (conf/model/): each is a class whose
constructor takes its config's keyword arguments plus what it declares of the data's sizes
(``in_dim``/``out_dim`` for feature data, ``vocab_size``/``max_len`` for token data)."""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import torch
import torch.nn.functional as F
from torch import nn

from gradsync.components import (
    CheckContext,
    ConfigError,
    build,
    checks,
    kind_of,
    reason,
    require,
    require_fits,
)

ACTIVATIONS = {"relu": nn.ReLU, "gelu": nn.GELU, "tanh": nn.Tanh}


class ModelBuilder(Protocol):
    """The model contract: a callable (usually an nn.Module class) returning an nn.Module. It
    receives its config's keyword arguments plus those data sizes that it names among its
    parameters: ``in_dim``, ``out_dim`` (feature data), ``vocab_size``, ``max_len`` (token
    data); see data.DataBundle.sizes."""

    def __call__(self, **kwargs: Any) -> nn.Module: ...


FORWARD = "_forward_"  # the model node's key for ModelCall's settings (never the target's)
FORWARD_KEYS = ("targets", "logits", "ignore_index")


@dataclass(frozen=True)
class ModelCall:
    """How gradsync calls a model and reads its logits: the model node's ``_forward_``.

    By default ``model(x)`` returns the logits. A model whose forward takes the targets too
    gets them under the keyword ``targets`` (nanoGPT's ``forward(idx, targets=None)`` returns
    the last position's logits only without them), each negative target (padding) as
    ``ignore_index`` (nanoGPT ignores -1; torch and Hugging Face -100). ``logits`` says where
    the output holds them: None (the output is the logits), a position (nanoGPT's
    ``(logits, loss)``: 0) or a name (a Hugging Face ``ModelOutput``'s ``logits``). Whatever
    loss the model computes itself is not used: gradsync computes the per-sample (per-token)
    loss from the logits, which keeps its exact normalisation over the global window."""

    targets: str | None = None
    logits: int | str | None = None
    ignore_index: int = -100

    def __call__(self, model: Any, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        if self.targets is None:
            return self.pick(model(x))
        if self.ignore_index != -100 and not y.is_floating_point():  # padding is -100
            y = y.masked_fill(y < 0, self.ignore_index)
        return self.pick(model(x, **{self.targets: y}))

    def pick(self, out: Any) -> torch.Tensor:
        if self.logits is None:
            return out
        if isinstance(self.logits, int):
            return out[self.logits]
        return out[self.logits] if isinstance(out, dict) else getattr(out, self.logits)


PLAIN_CALL = ModelCall()


def model_call(node: dict[str, Any]) -> tuple[dict[str, Any], ModelCall]:
    """A model node split into what builds the model (the node without ``_forward_``) and how
    the model is called; a ``_forward_`` that is not a mapping of known keys of the right
    types is a ConfigError naming the key."""
    spec = node.get(FORWARD)
    if spec is None:
        return node, PLAIN_CALL
    key = f"model.{FORWARD}"
    require(isinstance(spec, dict), key, f"a mapping of {', '.join(FORWARD_KEYS)}", spec)
    for name in spec:
        if name not in FORWARD_KEYS:
            raise ConfigError(f"{key}.{name}: unknown key; allowed keys: "
                              f"{', '.join(FORWARD_KEYS)}")
    targets, logits = spec.get("targets"), spec.get("logits")
    ignore = spec.get("ignore_index", -100)
    require(targets is None or isinstance(targets, str) and targets.isidentifier(),
            f"{key}.targets", "null, or the forward's keyword that takes the targets", targets)
    require(logits is None or isinstance(logits, str) and logits != "" or
            isinstance(logits, int) and not isinstance(logits, bool), f"{key}.logits",
            "null (the output is the logits), a position in the output (0) or a name "
            "(logits)", logits)
    require(isinstance(ignore, int) and not isinstance(ignore, bool), f"{key}.ignore_index",
            "an integer", ignore)
    return ({k: v for k, v in node.items() if k != FORWARD},
            ModelCall(targets, logits, ignore))


def check_call(model: nn.Module, call: ModelCall, x: torch.Tensor, y: torch.Tensor,
               sizes: dict[str, int], target: str,
               loss: Callable[[Any, torch.Tensor], Any] | None = None) -> Any:
    """One micro-batch through the model as the loop calls it, where the model lies (the meta
    device: shapes only, no memory, no compute): what the model cannot run (a sequence longer
    than its block, a width its heads do not divide), a targets keyword its forward lacks, an
    output without the logits where ``_forward_`` says, or logits of another shape than the
    data's (token data: [B, T, vocab_size]) is a ConfigError naming the model. An output that
    is no tensor without ``_forward_.logits`` passes where the data's own `loss` takes it.
    Returns the output; None where the meta device cannot run the model (a forward that reads
    a value) or the forward needs a rank (a process group): no check."""
    try:
        names = dict(inspect.signature(model.forward).parameters)
    except (TypeError, ValueError, AttributeError):
        names = {}
    if call.targets is not None and names and call.targets not in names and not any(
            p.kind == p.VAR_KEYWORD for p in names.values()):
        raise ConfigError(f"model.{FORWARD}.targets={call.targets!r} is not allowed: "
                          f"{target}'s forward takes no such keyword (it takes "
                          f"{', '.join(names)})")
    device = next((t.device for t in [*model.parameters(), *model.buffers()]),
                  torch.device("cpu"))
    where = f"a micro-batch of the data's shape (inputs {list(x.shape)})"
    try:
        with torch.no_grad():
            out = call(model, x.to(device), y.to(device))
    except Exception as e:
        if device.type == "meta" and meta_limit(e) or needs_a_rank(e):
            return None
        raise ConfigError(f"model ({target}) cannot run {where}: {reason(e)}") from None
    if not isinstance(out, torch.Tensor):
        if call.logits is None and loss is not None and takes(loss, out, y.to(device)):
            return out  # the data's loss reads the output itself
        hint = ("" if call.logits is not None else
                f": set model.{FORWARD}.logits to the logits' position (0) or name (logits)")
        raise ConfigError(f"model ({target}) returned {kind_of(out)} for {where}, where "
                          f"gradsync wants the logits{hint}")
    vocab = sizes.get("vocab_size")  # a vocabulary padded beyond the data's is fine
    if vocab is not None and y.dim() == 2 and (tuple(out.shape[:-1]) != tuple(y.shape)
                                               or out.dim() != 3 or out.shape[-1] < vocab):
        hint = (f"; without model.{FORWARD}.targets it may predict the last position only"
                if call.targets is None and out.dim() == 3 and out.shape[1] == 1 else "")
        raise ConfigError(f"model ({target}) returned logits of shape {list(out.shape)} for "
                          f"{where}; the data's targets want {[*y.shape, vocab]} (a score for "
                          f"each of the vocab_size={vocab} tokens at every position){hint}")
    return out


def takes(loss: Callable[[Any, torch.Tensor], Any], out: Any, y: torch.Tensor) -> bool:
    """Whether a data's loss runs on this output (where the meta device cannot run it: yes)."""
    try:
        with torch.no_grad():
            loss(out, y)
    except Exception as e:
        return meta_limit(e)
    return True


def needs_a_rank(e: BaseException) -> bool:
    """An error that says the forward wants what only a rank has (its process group, its
    GPU), not that the model is wrong: the check runs in the launcher, before any rank."""
    text = str(e).lower()
    return any(w in text for w in ("process group", "init_process_group", "cuda", "nccl"))


def meta_limit(e: BaseException) -> bool:
    """An error that says the meta device cannot run an operation (one that reads a value, as
    transformers' mask code does), not that the model is wrong."""
    return isinstance(e, NotImplementedError) or "meta" in str(e).lower()


def build_on_meta(node: dict[str, Any], sizes: dict[str, int]) -> Any:
    """What a model node builds with the data's sizes, on the meta device (the shapes and
    dtypes of its tensors, no memory for them) where its constructor can run there, else on
    the CPU: for the config check and +inspect=params."""
    try:
        with torch.device("meta"):
            return build(node, sizes)
    except Exception:
        return build(node, sizes)


def _check_mlp(a: dict[str, Any], ctx: CheckContext) -> None:
    require(all(h >= 1 for h in a["hidden_sizes"]), "model.hidden_sizes",
            "a list of integers >= 1", a["hidden_sizes"])
    require(a["activation"] in ACTIVATIONS, "model.activation",
            f"one of {', '.join(ACTIVATIONS)}", a["activation"])
    require(0.0 <= a["dropout"] < 1.0, "model.dropout", "a number in [0, 1)", a["dropout"])
    sizes = ctx.provided.get("sizes")
    if sizes:  # counted before anything is built: a width of 10**12 never reaches torch
        widths = [sizes["in_dim"], *a["hidden_sizes"], sizes["out_dim"]]
        n = sum(i * o + o for i, o in zip(widths[:-1], widths[1:], strict=True))
        require_fits(4 * n, f"model.hidden_sizes={a['hidden_sizes']!r}: the MLP's {n:,} "
                            f"parameters (in_dim={sizes['in_dim']}, out_dim={sizes['out_dim']} "
                            "from the data)")


@checks(_check_mlp)
class MLP(nn.Sequential):
    """A multi-layer perceptron on feature vectors."""

    def __init__(self, in_dim: int, out_dim: int,
                 hidden_sizes: list[int] | tuple[int, ...] = (128, 128),
                 activation: str = "relu", dropout: float = 0.0):
        layers: list[nn.Module] = []
        hidden = []
        for width in hidden_sizes:
            hidden.append(str(len(layers)))
            layers += [nn.Linear(in_dim, width), ACTIVATIONS[activation]()]
            if dropout:
                layers.append(nn.Dropout(dropout))  # draws from each rank's own stream
            in_dim = width
        layers.append(nn.Linear(in_dim, out_dim))
        super().__init__(*layers)
        # sharded engines (engines/fsdp.py): each hidden layer is a unit, the output layer
        # stays with the root
        self.fsdp_units = tuple(hidden)


class Block(nn.Module):
    """Pre-norm causal self-attention and MLP, each added to the residual stream."""

    def __init__(self, d_model: int, n_heads: int, mlp_ratio: int):
        super().__init__()
        self.n_heads = n_heads
        self.ln1, self.ln2 = nn.LayerNorm(d_model), nn.LayerNorm(d_model)
        self.qkv = nn.Linear(d_model, 3 * d_model)
        self.proj = nn.Linear(d_model, d_model)
        self.mlp = nn.Sequential(nn.Linear(d_model, mlp_ratio * d_model), nn.GELU(),
                                 nn.Linear(mlp_ratio * d_model, d_model))

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        b, t, d = h.shape
        q, k, v = self.qkv(self.ln1(h)).view(b, t, 3, self.n_heads, d // self.n_heads) \
            .permute(2, 0, 3, 1, 4)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        h = h + self.proj(a.transpose(1, 2).reshape(b, t, d))
        return h + self.mlp(self.ln2(h))


def _check_transformer(a: dict[str, Any], ctx: CheckContext) -> None:
    for key in ("n_layers", "n_heads", "mlp_ratio", "d_model"):
        require(a[key] >= 1, f"model.{key}", "an integer >= 1", a[key])
    require(a["d_model"] % a["n_heads"] == 0, "model.d_model",
            f"a positive multiple of model.n_heads={a['n_heads']}", a["d_model"])
    sizes = ctx.provided.get("sizes")
    if sizes:  # counted before anything is built
        v, t, d, r = sizes["vocab_size"], sizes["max_len"], a["d_model"], a["mlp_ratio"]
        block = 4 * d + (3 * d * d + 3 * d) + (d * d + d) + (d * r * d + r * d) + (r * d * d + d)
        n = v * d + t * d + a["n_layers"] * block + 2 * d + d * v + v
        require_fits(4 * n, f"model: the Transformer's {n:,} parameters (vocab_size={v}, "
                            f"max_len={t} from the data; d_model={d}, n_layers={a['n_layers']}, "
                            f"mlp_ratio={r})")


@checks(_check_transformer)
class Transformer(nn.Module):
    """Decoder-only causal language model: token ids [B, T] -> next-token logits [B, T, V].

    Batches are right-padded, so padding only ever follows a sequence's real tokens and the
    causal mask alone keeps every real position from attending to it: no padding mask needed.
    Logits at padding positions are meaningless; their targets are ignored by the loss."""

    fsdp_units = ("blocks.*",)  # sharded engines: each block is a unit (engines/fsdp.py)

    def __init__(self, vocab_size: int, max_len: int, d_model: int = 32, n_layers: int = 2,
                 n_heads: int = 2, mlp_ratio: int = 4):
        super().__init__()
        self.tok = nn.Embedding(vocab_size, d_model)
        self.pos = nn.Embedding(max_len, d_model)
        self.blocks = nn.ModuleList(Block(d_model, n_heads, mlp_ratio) for _ in range(n_layers))
        self.ln = nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, vocab_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.tok(x) + self.pos(torch.arange(x.shape[1], device=x.device))
        for block in self.blocks:
            h = block(h)
        return self.head(self.ln(h))
