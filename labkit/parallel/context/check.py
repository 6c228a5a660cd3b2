"""Context-parallel attention held against one process, on every rank: what the lab measures.

:func:`attention_vs_one_process` runs ring attention (zig-zag and contiguous layouts) and Ulysses on
this rank's slice of q, k, v drawn identically on every rank, and compares the output and the
gradients of q, k and v with ``scaled_dot_product_attention`` on the whole sequence computed by the
same rank: the largest absolute difference, the query-key products each rank computed (the balance
the zig-zag split buys) and the bytes it sent.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

from labkit.parallel.context.ring import ring_attention
from labkit.parallel.context.layout import cp_shard
from labkit.parallel.context.ulysses import ulysses_attention

METHODS = {"ring, zig-zag": (ring_attention, "zigzag"), "ring, contiguous": (ring_attention, "contiguous"),
           "Ulysses (all-to-all)": (ulysses_attention, "contiguous")}


def attention_vs_one_process(seq_len: int, heads: int = 4, head_dim: int = 16, batch: int = 2,
                             causal: bool = True, seed: int = 0) -> dict[str, dict]:
    """Per method: ``max_err`` against one process (output, dq, dk, dv), this rank's ``scores``
    (query-key products computed), ``visible`` (those the causal mask keeps) and ``bytes`` sent."""
    C, r = dist.get_world_size(), dist.get_rank()
    gen = torch.Generator().manual_seed(seed)
    q, k, v, g = (torch.randn(batch, heads, seq_len, head_dim, generator=gen) for _ in range(4))
    ref_in = [t.clone().requires_grad_() for t in (q, k, v)]
    ref = F.scaled_dot_product_attention(*ref_in, is_causal=causal)
    (ref * g).sum().backward()
    want = [ref.detach()] + [t.grad for t in ref_in]
    out = {}
    for name, (fn, layout) in METHODS.items():
        mine = [cp_shard(t, C, r, 2, layout).requires_grad_() for t in (q, k, v)]
        stats: dict = {}
        extra = {"stats": stats} if fn is ring_attention else {}
        y = fn(*mine, causal=causal, layout=layout, **extra)
        (y * cp_shard(g, C, r, 2, layout)).sum().backward()
        got = [y.detach()] + [t.grad for t in mine]
        err = max((a - cp_shard(b, C, r, 2, layout)).abs().max().item() for a, b in zip(got, want))
        out[name] = {"max_err": err, "scores": stats.get("scores"), "visible": stats.get("visible"),
                     "bytes": stats.get("forward_bytes", 0) + stats.get("backward_bytes", 0)}
    return out
