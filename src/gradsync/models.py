"""The built-in models, ordinary ``_target_`` components (conf/model/): each is a class whose
constructor takes its config's keyword arguments plus what it declares of the data's sizes
(``in_dim``/``out_dim`` for feature data, ``vocab_size``/``max_len`` for token data)."""

from __future__ import annotations

from typing import Any, Protocol

import torch
import torch.nn.functional as F
from torch import nn

from gradsync.components import CheckContext, build, checks, require, require_fits

ACTIVATIONS = {"relu": nn.ReLU, "gelu": nn.GELU, "tanh": nn.Tanh}


class ModelBuilder(Protocol):
    """The model contract: a callable (usually an nn.Module class) returning an nn.Module. It
    receives its config's keyword arguments plus those data sizes that it names among its
    parameters: ``in_dim``, ``out_dim`` (feature data), ``vocab_size``, ``max_len`` (token
    data); see data.DataBundle.sizes."""

    def __call__(self, **kwargs: Any) -> nn.Module: ...


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
