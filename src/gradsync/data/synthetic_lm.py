"""Variable-length token sequences from the seed (``data=synthetic_lm``): per-token accuracy
and perplexity."""

from __future__ import annotations

from typing import Any

import torch

from gradsync.components import CheckContext, checks, require, require_fits
from gradsync.data.contract import DataBundle, provides
from gradsync.data.tokens import token_bundle


def _check_synthetic_lm(a: dict[str, Any], ctx: CheckContext) -> None:
    for key in ("num_samples", "eval_samples"):
        require(a[key] >= 1, f"data.{key}", "an integer >= 1", a[key])
    require(a["vocab_size"] >= 2, "data.vocab_size", "an integer >= 2", a["vocab_size"])
    require(a["min_len"] >= 2, "data.min_len",
            "an integer >= 2 (a sequence needs one input and one target)", a["min_len"])
    require(a["max_len"] >= a["min_len"], "data.max_len",
            f"an integer >= data.min_len={a['min_len']}", a["max_len"])
    require(1 <= a["max_stride"] < a["vocab_size"], "data.max_stride",
            f"an integer in [1, data.vocab_size={a['vocab_size']})", a["max_stride"])
    require(0.0 <= a["noise"] <= 1.0, "data.noise", "a number in [0, 1]", a["noise"])
    # each sequence: its int64 tokens (and as much again while it is made) and a tensor object
    mean_len = (a["min_len"] + a["max_len"]) / 2
    require_fits((a["num_samples"] + a["eval_samples"]) * (16 * mean_len + 400),
                 f"data: num_samples={a['num_samples']} + eval_samples={a['eval_samples']} "
                 f"sequences of min_len={a['min_len']} to max_len={a['max_len']} tokens")


@checks(_check_synthetic_lm)
@provides("vocab_size", "max_len", unit="tokens")
def synthetic_lm(seed: int, num_samples: int = 2048, eval_samples: int = 256,
                 vocab_size: int = 32, min_len: int = 4, max_len: int = 64, max_stride: int = 4,
                 noise: float = 0.05) -> DataBundle:
    """Token sequences from the seed, lengths uniform in [min_len, max_len]: each counts from a
    random start by a random stride in 1..max_stride modulo vocab_size, and each token is
    replaced by a random one with probability noise. Predicting the next token needs the
    stride, read from earlier tokens: a bigram model gets about 1/max_stride of them right."""
    g = torch.Generator().manual_seed(seed)
    n, vocab = num_samples + eval_samples, vocab_size
    lengths = torch.randint(min_len, max_len + 1, (n,), generator=g)
    starts = torch.randint(0, vocab, (n,), generator=g)
    strides = torch.randint(1, max_stride + 1, (n,), generator=g)
    seqs = []
    for length, start, stride in zip(lengths.tolist(), starts.tolist(), strides.tolist(),
                                     strict=True):
        clean = (start + stride * torch.arange(length)) % vocab
        noisy = torch.rand(length, generator=g) < noise
        seqs.append(torch.where(noisy, torch.randint(0, vocab, (length,), generator=g), clean))
    return token_bundle(seqs[:num_samples], seqs[num_samples:], vocab, max_len)
