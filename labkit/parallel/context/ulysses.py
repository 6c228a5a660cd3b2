"""All-to-all sequence parallelism (DeepSpeed-Ulysses): trade the sequence split for a head split.

Jacobs et al. 2023, "DeepSpeed Ulysses: System Optimizations for Enabling Training of Extreme Long
Sequence Transformer Models" (arXiv:2309.14509). Each of C ranks holds T/C tokens of q, k, v with
all H heads. One all-to-all per tensor swaps that for all T tokens of H/C heads; attention heads are
independent, so each rank runs ordinary (fused) attention on its heads over the full sequence; a
last all-to-all swaps the output back to the sequence split. Four all-to-alls each way, each rank
sending (C-1)/C of a local tensor per all-to-all: the volume per rank stays constant as C grows with
T (the ring's grows with C). Its limit: C must divide the number of heads (and of K/V heads under
grouped-query attention), and each rank holds the full sequence's scores for its heads.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

from labkit.parallel.context.layout import LAYOUTS, cp_positions


def _seq_to_heads(x: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    """[B, H, T/C, D] (my tokens, all heads) -> [B, H/C, T, D] (all tokens in rank order, my heads)."""
    C = dist.get_world_size(group)
    B, H, L, D = x.shape
    send = x.reshape(B, C, H // C, L, D).transpose(0, 1).contiguous()  # chunk j: head group j, to rank j
    got = torch.empty_like(send)
    dist.all_to_all_single(got, send, group=group)  # got[j]: rank j's tokens of my head group
    return got.permute(1, 2, 0, 3, 4).reshape(B, H // C, C * L, D)


def _heads_to_seq(x: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    """The inverse: [B, H/C, T, D] -> [B, H, T/C, D]."""
    C = dist.get_world_size(group)
    B, h, T, D = x.shape
    send = x.reshape(B, h, C, T // C, D).permute(2, 0, 1, 3, 4).contiguous()  # chunk j: rank j's tokens
    got = torch.empty_like(send)
    dist.all_to_all_single(got, send, group=group)  # got[j]: my tokens of head group j
    return got.transpose(0, 1).reshape(B, C * h, T // C, D)


class _AllToAll(torch.autograd.Function):
    """The all-to-all as an autograd op: the gradient of a swap is the reverse swap."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: dist.ProcessGroup | None, to_heads: bool) -> torch.Tensor:
        ctx.group, ctx.to_heads = group, to_heads
        return _seq_to_heads(x, group) if to_heads else _heads_to_seq(x, group)

    @staticmethod
    def backward(ctx, g: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        g = g.contiguous()
        return (_heads_to_seq(g, ctx.group) if ctx.to_heads else _seq_to_heads(g, ctx.group)), None, None


def ulysses_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group: dist.ProcessGroup | None = None,
                      causal: bool = True, layout: str = "contiguous") -> torch.Tensor:
    """Attention over the sequence split across ``group`` by two head/sequence all-to-alls.

    ``q``, ``k``, ``v``: ``[batch, heads, local_seq, head_dim]``, this rank's slice in ``layout``
    (``"contiguous"``, or ``"zigzag"`` to share ring attention's shards). Returns this rank's slice of
    ``scaled_dot_product_attention`` on the full sequence. Differentiable; every rank of ``group``
    calls it together. Raises ValueError when ``heads`` is not divisible by the group size.
    """
    C = dist.get_world_size(group)
    if q.dim() != 4 or k.shape != q.shape or v.shape != q.shape:
        raise ValueError(f"q, k, v must share one shape [batch, heads, local_seq, head_dim]; got "
                         f"{tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}")
    if q.shape[1] % C:
        raise ValueError(f"ulysses_attention: heads (q.shape[1]={q.shape[1]}) must be divisible by the group "
                         f"size {C}: each rank takes heads/{C} whole heads; use ring attention instead")
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    T = q.shape[2] * C
    q, k, v = (_AllToAll.apply(t, group, True) for t in (q, k, v))
    order = torch.cat([cp_positions(T, C, r, layout) for r in range(C)]).to(q.device)  # held -> true
    if layout != "contiguous":  # put the gathered tokens in true order for the causal mask
        q, k, v = (t.index_select(2, torch.argsort(order)) for t in (q, k, v))
    y = F.scaled_dot_product_attention(q, k, v, is_causal=causal)
    if layout != "contiguous":
        y = y.index_select(2, order)
    return _AllToAll.apply(y, group, False)
