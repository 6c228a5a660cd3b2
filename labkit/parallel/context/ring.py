"""Ring attention from scratch: exact attention over a sequence split across ranks.

Each of C ranks holds a slice of the sequence's queries, keys and values. The K/V blocks travel
round the ring (rank r sends to r+1, receives from r-1) for C-1 steps while every rank attends its
own queries to the block it holds and folds the partial result into a running output with the
online-softmax merge of :mod:`labkit.parallel.context.online_softmax` (FlashAttention's, with the blocks
on other ranks). No rank ever holds the full T x T scores or the full K/V: the activation memory of
attention falls as 1/C (Liu, Zaharia & Abbeel 2023, "Ring Attention with Blockwise Transformers for
Near-Infinite Context", arXiv:2310.01889).

Backward (FlashAttention-2's, Dao 2023, arXiv:2307.08691, per block): with the final ``lse`` and
``delta = rowsum(dO * O)`` saved, each block's probabilities are recomputed, dQ accumulates locally,
and dK, dV accumulators travel round the ring *with* their K/V block, a last step taking them home.

The causal mask is applied by true positions (:mod:`labkit.parallel.context.layout`); blocks wholly in
the future are skipped, which is why the zig-zag layout balances the work. Messages go through
:func:`labkit.comm.p2p.exchange` (sends and receives posted as one ``batch_isend_irecv`` group:
safe under NCCL). This teaching version waits for each exchange before computing; production
kernels (zhuzilin/ring-flash-attention, PyTorch's ``context_parallel``) post the next exchange
before computing on the current block, hiding the transfer behind the compute.
"""
from __future__ import annotations

import math
from contextlib import contextmanager
from typing import Iterator

import torch
import torch.distributed as dist
from torch import Tensor

from labkit.comm.p2p import exchange
from labkit.parallel.context.layout import LAYOUTS, cp_positions, visible_block
from labkit.parallel.context.online_softmax import block_backward, block_forward, merge


def _ring(group: dist.ProcessGroup | None) -> tuple[int, int, int, int]:
    """(rank in group, group size, global rank of the next, global rank of the previous)."""
    rank, C = dist.get_rank(group), dist.get_world_size(group)
    glob = (lambda i: dist.get_global_rank(group, i)) if group is not None else (lambda i: i)
    return rank, C, glob((rank + 1) % C), glob((rank - 1) % C)


def _pass_on(tensors: list[Tensor], group: dist.ProcessGroup | None, stats: dict | None,
             key: str) -> list[Tensor]:
    """Send each tensor to the next rank and receive its like from the previous, in one group."""
    _, _, nxt, prv = _ring(group)
    got = [torch.empty_like(t) for t in tensors]
    exchange([(t.contiguous(), nxt) for t in tensors], [(g, prv) for g in got], group)
    if stats is not None:
        stats[key] = stats.get(key, 0) + sum(t.numel() * t.element_size() for t in tensors)
    return got


def _count(stats: dict | None, rows: Tensor, cols: Tensor, mask: Tensor | None) -> None:
    if stats is not None:
        stats["scores"] = stats.get("scores", 0) + len(rows) * len(cols)
        stats["visible"] = stats.get("visible", 0) + (len(rows) * len(cols) if mask is None else int(mask.sum()))


def _on_device(blk: tuple, kv: Tensor, device: torch.device) -> tuple:
    """A visible block's query rows, key columns and mask on ``device``, and its K and V in fp32."""
    rows, cols = (i.to(device) for i in blk[:2])
    mask = None if blk[2] is None else blk[2].to(device)
    kb, vb = (kv[i].index_select(2, cols).float() for i in (0, 1))
    return rows, cols, mask, kb, vb


def _ring_forward(q: Tensor, k: Tensor, v: Tensor, group: dist.ProcessGroup | None, causal: bool, layout: str,
                  stats: dict | None) -> tuple[Tensor, Tensor]:
    """Output (fp32) and log-sum-exp of this rank's queries against every rank's keys."""
    rank, C, _, _ = _ring(group)
    B, H, L, D = q.shape
    q_pos, scale, qf = cp_positions(L * C, C, rank, layout), 1.0 / math.sqrt(D), q.float()
    out = torch.zeros(B, H, L, D, dtype=torch.float32, device=q.device)
    lse = torch.full((B, H, L), float("-inf"), dtype=torch.float32, device=q.device)
    kv = torch.stack([k, v])  # travels in the inputs' dtype
    for step in range(C):
        blk = visible_block(q_pos, cp_positions(L * C, C, (rank - step) % C, layout), causal)
        if blk is not None:
            rows, cols, mask, kb, vb = _on_device(blk, kv, q.device)
            o_b, lse_b = block_forward(qf.index_select(2, rows), kb, vb, mask, scale)
            o_new, lse_new = merge(out.index_select(2, rows), lse.index_select(2, rows), o_b, lse_b)
            out.index_copy_(2, rows, o_new)
            lse.index_copy_(2, rows, lse_new)
            _count(stats, *blk)
        if step < C - 1:
            (kv,) = _pass_on([kv], group, stats, "forward_bytes")
    return out, lse


def _ring_backward(q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, dout: Tensor,
                   group: dist.ProcessGroup | None, causal: bool, layout: str,
                   stats: dict | None) -> tuple[Tensor, Tensor, Tensor]:
    """dQ, dK, dV: dQ stays; dK/dV accumulators ride the ring with their K/V block, then go home."""
    rank, C, _, _ = _ring(group)
    B, H, L, D = q.shape
    q_pos, scale, qf, do = cp_positions(L * C, C, rank, layout), 1.0 / math.sqrt(D), q.float(), dout.float()
    delta = (do * out).sum(-1)
    dq = torch.zeros_like(qf)
    kv = torch.stack([k, v])
    dkv = torch.zeros(2, B, H, L, D, dtype=torch.float32, device=q.device)
    for step in range(C):
        blk = visible_block(q_pos, cp_positions(L * C, C, (rank - step) % C, layout), causal)
        if blk is not None:
            rows, cols, mask, kb, vb = _on_device(blk, kv, q.device)
            dq_b, dk_b, dv_b = block_backward(qf.index_select(2, rows), kb, vb, do.index_select(2, rows),
                                              lse.index_select(2, rows), delta.index_select(2, rows), mask, scale)
            dq.index_add_(2, rows, dq_b)
            dkv[0].index_add_(2, cols, dk_b)
            dkv[1].index_add_(2, cols, dv_b)
        if step < C - 1:
            kv, dkv = _pass_on([kv, dkv], group, stats, "backward_bytes")
        elif C > 1:  # the accumulators of rank r+1's block: one more hop takes them home
            (dkv,) = _pass_on([dkv], group, stats, "backward_bytes")
    return dq.to(q.dtype), dkv[0].to(k.dtype), dkv[1].to(v.dtype)


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q: Tensor, k: Tensor, v: Tensor, group: dist.ProcessGroup | None, causal: bool,
                layout: str, stats: dict | None) -> Tensor:
        with torch.autocast(q.device.type, enabled=False):  # the blocks compute in fp32 whatever calls them
            out, lse = _ring_forward(q, k, v, group, causal, layout, stats)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.args = (group, causal, layout, stats)
        return out.to(q.dtype)

    @staticmethod
    def backward(ctx, dout: Tensor) -> tuple[Tensor | None, ...]:
        q, k, v, out, lse = ctx.saved_tensors
        with torch.autocast(q.device.type, enabled=False):  # a pipeline runs backward under autocast too
            dq, dk, dv = _ring_backward(q, k, v, out, lse, dout, *ctx.args)
        return dq, dk, dv, None, None, None, None


_OPEN: list[dict] = []  # open record_ring() logs


@contextmanager
def record_ring() -> Iterator[dict]:
    """Count, while open, the work and bytes of every ring attention on this rank that was given no
    ``stats`` of its own, into the dict yielded (the keys of :func:`ring_attention`'s ``stats``): how
    a training step is measured without the model holding any measurement state."""
    log: dict = {}
    _OPEN.append(log)
    try:
        yield log
    finally:
        _OPEN.remove(log)


def ring_attention(q: Tensor, k: Tensor, v: Tensor, group: dist.ProcessGroup | None = None,
                   causal: bool = True, layout: str = "zigzag", stats: dict | None = None) -> Tensor:
    """Exact softmax attention of this rank's queries over the whole sequence split across ``group``.

    ``q``, ``k``, ``v``: ``[batch, heads, local_seq, head_dim]``, this rank's slice of the sequence in
    ``layout`` (:func:`labkit.parallel.context.layout.cp_shard`; the full length is local_seq x C). Returns
    this rank's slice of the output, as ``scaled_dot_product_attention`` on the full sequence would
    give it (scale 1/sqrt(head_dim), no dropout). Every rank of ``group`` must call it together, and
    backward too (it is a ring). ``stats``, if given (or an open :func:`record_ring`'s log),
    accumulates the work done (``scores``, ``visible``: query x key products computed, and kept by
    the mask) and the bytes sent (``forward_bytes``, ``backward_bytes``).
    """
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    if q.dim() != 4 or k.shape != q.shape or v.shape != q.shape:
        raise ValueError(f"q, k, v must share one shape [batch, heads, local_seq, head_dim]; got "
                         f"{tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}")
    C = dist.get_world_size(group)
    cp_positions(q.shape[2] * C, C, 0, layout)  # raises if the length does not split in this layout
    if stats is None and _OPEN:
        stats = _OPEN[-1]
    return _RingAttention.apply(q, k, v, group, causal, layout, stats)
