"""Token data: variable-length sequences, padded per micro-batch, their next-token loss over
the non-padding targets (a sum plus a count), and the bundle every token data set returns
(synthetic_lm, corpus)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.utils.data import Dataset

from gradsync.data.contract import DataBundle, argmax_correct

IGNORE_INDEX = -100  # target of padding positions: no loss, no token count


class TokenSequences(Dataset):
    """Variable-length 1-D int64 token sequences."""

    def __init__(self, seqs: list[torch.Tensor]):
        self.seqs = seqs

    def __len__(self) -> int:
        return len(self.seqs)

    def __getitem__(self, i: int) -> torch.Tensor:
        return self.seqs[i]


def pad_batch(seqs: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """Next-token pairs, right-padded to the micro-batch's longest sequence: inputs s[:-1]
    (padding 0), targets s[1:] (padding IGNORE_INDEX)."""
    width = max(len(s) for s in seqs) - 1
    x = torch.zeros(len(seqs), width, dtype=torch.long)
    y = torch.full((len(seqs), width), IGNORE_INDEX, dtype=torch.long)
    for i, s in enumerate(seqs):
        x[i, :len(s) - 1] = s[:-1]
        y[i, :len(s) - 1] = s[1:]
    return x, y


def token_loss_per_sample(out: torch.Tensor,
                          y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Each sequence's summed next-token loss over its non-padding targets, and their count
    (logits [B, T, V], targets [B, T]; in float32). The cross-entropy runs over the B x T rows
    of V scores, as nanoGPT's and transformers' do (the same bits per token; a [B, V, T] view
    takes ~1.7x the time on CPU)."""
    tokens = F.cross_entropy(out.float().flatten(0, 1), y.flatten(), reduction="none",
                             ignore_index=IGNORE_INDEX).view(y.shape)  # [B, T], 0 at padding
    return tokens.sum(1), (y != IGNORE_INDEX).sum(1)


def token_bundle(train: list[torch.Tensor], held_out: list[torch.Tensor], vocab_size: int,
                 max_len: int) -> DataBundle:
    """Next-token prediction on variable-length sequences (at most max_len tokens each)."""
    lengths = torch.tensor([len(s) for s in train], dtype=torch.float64)
    return DataBundle(TokenSequences(train), TokenSequences(held_out), token_loss_per_sample,
                      {"vocab_size": vocab_size, "max_len": max_len - 1}, unit="tokens",
                      collate=pad_batch, correct=argmax_correct,
                      tokens_per_sample=float((lengths - 1).mean()),
                      uniform_length=bool((lengths == lengths[0]).all()))
