"""A small GPT with nanoGPT's interface, written for the tests (nanoGPT's own model.py is not in
the repo; bench/gpt.py and examples/nanogpt run it from a clone): ``GPT(config)`` takes a
``GPTConfig`` dataclass, its ``forward(idx, targets=None)`` returns ``(logits, loss)``, the
logits of the last position only when no targets are given, its loss a mean that ignores
targets of -1; the token embedding is tied to the output head. ``Logits`` is the same network
returning every position's logits: the reference a model plugged in through ``_forward_`` must
train bit for bit."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass
class GPTConfig:
    block_size: int = 16
    vocab_size: int = 64
    n_layer: int = 1
    n_head: int = 2
    n_embd: int = 16
    dropout: float = 0.0
    bias: bool = True


class LayerNorm(nn.Module):
    """Its own class (not nn.LayerNorm), as nanoGPT's: the decay rule finds it by its name."""

    def __init__(self, width: int, bias: bool):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(width))
        self.bias = nn.Parameter(torch.zeros(width)) if bias else None

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return F.layer_norm(h, self.weight.shape, self.weight, self.bias, 1e-5)


class Block(nn.Module):
    def __init__(self, c: GPTConfig):
        super().__init__()
        self.n_head = c.n_head
        self.ln_1, self.ln_2 = LayerNorm(c.n_embd, c.bias), LayerNorm(c.n_embd, c.bias)
        self.c_attn = nn.Linear(c.n_embd, 3 * c.n_embd, bias=c.bias)
        self.c_proj = nn.Linear(c.n_embd, c.n_embd, bias=c.bias)
        self.mlp = nn.Sequential(nn.Linear(c.n_embd, 4 * c.n_embd, bias=c.bias), nn.GELU(),
                                 nn.Linear(4 * c.n_embd, c.n_embd, bias=c.bias))

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        b, t, d = h.shape
        q, k, v = (z.view(b, t, self.n_head, d // self.n_head).transpose(1, 2)
                   for z in self.c_attn(self.ln_1(h)).split(d, dim=2))
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        h = h + self.c_proj(a.transpose(1, 2).reshape(b, t, d))
        return h + self.mlp(self.ln_2(h))


class GPT(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        assert config.n_embd % config.n_head == 0
        self.config = config
        self.wte = nn.Embedding(config.vocab_size, config.n_embd)
        self.wpe = nn.Embedding(config.block_size, config.n_embd)
        self.drop = nn.Dropout(config.dropout)
        self.h = nn.ModuleList(Block(config) for _ in range(config.n_layer))
        self.ln_f = LayerNorm(config.n_embd, config.bias)
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        self.wte.weight = self.lm_head.weight  # tied

    def hidden(self, idx: torch.Tensor) -> torch.Tensor:
        t = idx.shape[1]
        assert t <= self.config.block_size, f"sequence of {t} > block_size"
        h = self.drop(self.wte(idx) + self.wpe(torch.arange(t, device=idx.device)))
        for block in self.h:
            h = block(h)
        return self.ln_f(h)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None):
        h = self.hidden(idx)
        if targets is None:
            return self.lm_head(h[:, [-1], :]), None  # the last position only
        logits = self.lm_head(h)
        loss = F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1),
                               ignore_index=-1)
        return logits, loss


class Logits(GPT):
    """The same network, every position's logits out: what gradsync's contract asks."""

    def forward(self, idx: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        return self.lm_head(self.hidden(idx))
