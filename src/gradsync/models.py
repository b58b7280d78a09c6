"""Models, built from plain config plus the data's input/output sizes."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

ACTIVATIONS = {"relu": nn.ReLU, "gelu": nn.GELU, "tanh": nn.Tanh}


class MLP(nn.Sequential):
    def __init__(self, in_dim: int, hidden_sizes: list[int], out_dim: int, activation: str,
                 dropout: float = 0.0):
        layers: list[nn.Module] = []
        for width in hidden_sizes:
            layers += [nn.Linear(in_dim, width), ACTIVATIONS[activation]()]
            if dropout:
                layers.append(nn.Dropout(dropout))  # draws from each rank's own stream
            in_dim = width
        layers.append(nn.Linear(in_dim, out_dim))
        super().__init__(*layers)


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


class Transformer(nn.Module):
    """Decoder-only causal language model: token ids [B, T] -> next-token logits [B, T, V].

    Batches are right-padded, so padding only ever follows a sequence's real tokens and the
    causal mask alone keeps every real position from attending to it: no padding mask needed.
    Logits at padding positions are meaningless; their targets are ignored by the loss."""

    def __init__(self, vocab_size: int, max_len: int, d_model: int, n_layers: int,
                 n_heads: int, mlp_ratio: int):
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


def build_model(cfg: dict[str, Any], in_dim: int, out_dim: int, max_len: int = 0) -> nn.Module:
    """in_dim/out_dim: features and outputs, or the vocabulary size twice for token data;
    max_len: the longest token sequence (token data only)."""
    if cfg["name"] == "mlp":
        return MLP(in_dim, list(cfg["hidden_sizes"]), out_dim, cfg["activation"],
                   cfg["dropout"])
    if cfg["name"] == "transformer":
        return Transformer(in_dim, max_len, cfg["d_model"], cfg["n_layers"], cfg["n_heads"],
                           cfg["mlp_ratio"])
    raise ValueError(f"unknown model {cfg['name']!r}")
