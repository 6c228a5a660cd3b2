"""Softmax attention one block of keys at a time: the merge ring attention and FlashAttention share.

Keep each query row's log-sum-exp ``lse`` of the scores seen so far; a new block with its own output
``o_b`` and ``lse_b`` gives ``lse' = logaddexp(lse, lse_b)`` and ``o' = o exp(lse - lse') + o_b
exp(lse_b - lse')`` (Milakov & Gimelshein 2018, "Online normalizer calculation for softmax",
arXiv:1805.02867; the log-sum-exp form of Dao et al. 2022, FlashAttention, arXiv:2205.14135).
Backward per block is FlashAttention-2's (Dao 2023, arXiv:2307.08691): with the final ``lse`` and
``delta = rowsum(dO * O)``, a block's probabilities are recomputed, never stored.
"""
from __future__ import annotations

import torch
from torch import Tensor


def scores(q: Tensor, k: Tensor, mask: Tensor | None, scale: float) -> Tensor:
    s = (q @ k.transpose(-2, -1)) * scale
    return s if mask is None else s.masked_fill(~mask, float("-inf"))


def block_forward(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, scale: float) -> tuple[Tensor, Tensor]:
    """One block's attention output and per-row log-sum-exp (every row sees at least one key)."""
    s = scores(q, k, mask, scale)
    lse = torch.logsumexp(s, dim=-1)
    return torch.exp(s - lse[..., None]) @ v, lse


def merge(out: Tensor, lse: Tensor, o_b: Tensor, lse_b: Tensor) -> tuple[Tensor, Tensor]:
    """The running output and log-sum-exp after one more block (the online-softmax rescaling)."""
    new = torch.logaddexp(lse, lse_b)
    return out * torch.exp(lse - new)[..., None] + o_b * torch.exp(lse_b - new)[..., None], new


def block_backward(q: Tensor, k: Tensor, v: Tensor, do: Tensor, lse: Tensor, delta: Tensor,
                   mask: Tensor | None, scale: float) -> tuple[Tensor, Tensor, Tensor]:
    """dQ, dK, dV of one block, from the *final* lse and delta = rowsum(dO * O) (FlashAttention-2)."""
    p = torch.exp(scores(q, k, mask, scale) - lse[..., None])  # the block's true probabilities
    ds = p * (do @ v.transpose(-2, -1) - delta[..., None])
    return (ds @ k) * scale, (ds.transpose(-2, -1) @ q) * scale, p.transpose(-2, -1) @ do
