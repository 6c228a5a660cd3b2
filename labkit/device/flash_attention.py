"""FlashAttention from scratch: exact attention in tiles, never holding the s x s scores.

Dao et al. 2022, "FlashAttention: fast and memory-efficient exact attention with IO-awareness"
(arXiv:2205.14135), Algorithm 1, with FlashAttention-2's loop order and backward (Dao 2023,
arXiv:2307.08691, Algorithms 1 and 2): queries in tiles of ``block`` rows; each query tile runs over
the key/value tiles, folding each into a running output with the online-softmax merge
(:mod:`labkit.parallel.context.online_softmax`, the one ring attention uses), and keeps only its output and
its rows' log-sum-exp. Causal tiles wholly in the future are skipped. Backward recomputes each
tile's probabilities from the saved log-sum-exp: attention's memory is O(s) per head instead of
O(s^2), at the price of the forward's ``Q K^T`` computed again (backward: 5 tile matmuls instead of
4, so 2.5 times the forward's FLOPs instead of 2).

On a GPU the tiles live in on-chip SRAM and the win is HBM traffic; this version runs each tile as
PyTorch ops, so it shows the memory and the arithmetic, not the speed.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from labkit.parallel.context.online_softmax import block_backward, block_forward, merge


def _tiles(s: int, block: int, causal: bool):
    """(query slice, key slice, mask or None) for every tile pair that has a visible score."""
    for i in range(0, s, block):
        rows = slice(i, min(i + block, s))
        for j in range(0, rows.stop if causal else s, block):
            cols = slice(j, min(j + block, s))
            mask = None
            if causal and cols.stop - 1 > rows.start:  # the diagonal tile: keys at or before each query
                mask = torch.arange(rows.start, rows.stop)[:, None] >= torch.arange(cols.start, cols.stop)[None]
            yield rows, cols, mask


def _forward(q: Tensor, k: Tensor, v: Tensor, causal: bool, block: int, stats: dict | None) -> tuple[Tensor, Tensor]:
    B, H, S, D = q.shape
    scale = 1.0 / math.sqrt(D)
    out = torch.zeros(B, H, S, D, dtype=torch.float32, device=q.device)
    lse = torch.full((B, H, S), float("-inf"), dtype=torch.float32, device=q.device)
    for rows, cols, mask in _tiles(S, block, causal):
        m = None if mask is None else mask.to(q.device)
        o_b, lse_b = block_forward(q[:, :, rows], k[:, :, cols], v[:, :, cols], m, scale)
        out[:, :, rows], lse[:, :, rows] = merge(out[:, :, rows], lse[:, :, rows], o_b, lse_b)
        if stats is not None:
            stats["tiles"] = stats.get("tiles", 0) + 1
    return out, lse


def _backward(q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, dout: Tensor, causal: bool,
              block: int) -> tuple[Tensor, Tensor, Tensor]:
    S, D = q.shape[2], q.shape[3]
    scale = 1.0 / math.sqrt(D)
    delta = (dout * out).sum(-1)
    dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    for rows, cols, mask in _tiles(S, block, causal):
        m = None if mask is None else mask.to(q.device)
        dq_b, dk_b, dv_b = block_backward(q[:, :, rows], k[:, :, cols], v[:, :, cols], dout[:, :, rows],
                                          lse[:, :, rows], delta[:, :, rows], m, scale)
        dq[:, :, rows] += dq_b
        dk[:, :, cols] += dk_b
        dv[:, :, cols] += dv_b
    return dq, dk, dv


class _FlashAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q: Tensor, k: Tensor, v: Tensor, causal: bool, block: int, stats: dict | None) -> Tensor:
        qf, kf, vf = q.float(), k.float(), v.float()
        out, lse = _forward(qf, kf, vf, causal, block, stats)
        ctx.save_for_backward(q, k, v, out.to(q.dtype), lse)  # O(s) per head: no s x s tensor kept
        ctx.args = (causal, block)
        return out.to(q.dtype)

    @staticmethod
    def backward(ctx, dout: Tensor) -> tuple[Tensor | None, ...]:
        q, k, v, out, lse = ctx.saved_tensors
        dq, dk, dv = _backward(q.float(), k.float(), v.float(), out.float(), lse, dout.float(), *ctx.args)
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None, None


def flash_attention(q: Tensor, k: Tensor, v: Tensor, causal: bool = True, block: int = 64,
                    stats: dict | None = None) -> Tensor:
    """``scaled_dot_product_attention(q, k, v, is_causal=causal)`` in tiles of ``block`` x ``block``.

    ``q``, ``k``, ``v``: ``[batch, heads, seq, head_dim]`` (as many K/V heads as query heads).
    ``stats``, if given, counts the tile pairs computed (``tiles``)."""
    if q.dim() != 4 or k.shape != q.shape or v.shape != q.shape:
        raise ValueError(f"q, k, v must share one shape [batch, heads, seq, head_dim]; got "
                         f"{tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}")
    if not isinstance(block, int) or block < 1:
        raise ValueError(f"block must be a positive int (tile rows and columns), got {block!r}")
    return _FlashAttention.apply(q, k, v, causal, block, stats)


def naive_attention(q: Tensor, k: Tensor, v: Tensor, causal: bool = True) -> Tensor:
    """Attention as written in the paper, the full s x s scores and probabilities materialised."""
    s = (q @ k.transpose(-2, -1)) / math.sqrt(q.shape[-1])
    if causal:
        S = q.shape[2]
        s = s.masked_fill(torch.ones(S, S, dtype=torch.bool, device=q.device).triu(1), float("-inf"))
    return torch.softmax(s, dim=-1) @ v


def error_against_sdpa(q: Tensor, k: Tensor, v: Tensor, causal: bool = True, block: int = 64) -> float:
    """The largest difference between :func:`flash_attention` and PyTorch's
    ``scaled_dot_product_attention`` over the output and the three gradients (for one random output
    gradient), with fp32 matmuls in full precision whatever the process set (TF32 would hide it)."""
    q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
    precision = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("highest")
    try:
        ref = F.scaled_dot_product_attention(q, k, v, is_causal=causal)
        grad = torch.randn_like(ref)
        want = torch.autograd.grad(ref, (q, k, v), grad)
        out = flash_attention(q, k, v, causal, block)
        got = torch.autograd.grad(out, (q, k, v), grad)
    finally:
        torch.set_float32_matmul_precision(precision)
    return max([(out - ref).abs().max().item()] + [(a - b).abs().max().item() for a, b in zip(got, want)])


class _Largest(TorchDispatchMode):
    """The bytes of the largest tensor any op creates while active."""

    def __init__(self) -> None:
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if isinstance(t, Tensor):
                self.largest = max(self.largest, t.numel() * t.element_size())
        return out


def attention_memory(fn, q: Tensor, k: Tensor, v: Tensor) -> dict[str, int]:
    """What ``fn(q, k, v)`` costs in memory, forward and backward: bytes autograd saves for backward
    (``saved_tensors_hooks``), and the largest tensor any op creates (a dispatch mode)."""
    q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
    saved: dict[int, int] = {}

    def pack(t: Tensor) -> Tensor:
        if t.dim() == 0:  # a scalar, not attention's data: CUDA's kernels save an RNG seed and offset
            return t
        st = t.untyped_storage()
        saved.setdefault(st.data_ptr(), st.nbytes())
        return t

    inputs = {t.untyped_storage().data_ptr() for t in (q, k, v)}
    with _Largest() as mode:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            out = fn(q, k, v)
        out.sum().backward()
    return {"saved_bytes": sum(n for p, n in saved.items() if p not in inputs), "largest_tensor_bytes": mode.largest}
