"""Rank functions of the context-parallel tests (spawned ranks import them from here).

One launch per world size runs every check and returns the largest deviations from one process,
the work and bytes each rank measured, and the point-to-point posts of one ring pass.
"""
from __future__ import annotations

from dataclasses import asdict

import torch
import torch.distributed as dist
import torch.nn.functional as F

from labkit.comm.p2p import P2PRecorder
from labkit.parallel.context.ring import ring_attention
from labkit.parallel.context.layout import cp_shard
from labkit.parallel.context.ulysses import ulysses_attention


def _full(shape: tuple, seed: int) -> list[torch.Tensor]:
    """q, k, v and the output's upstream gradient g, the same on every rank."""
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(*shape, generator=gen) for _ in range(4)]


def _max_err(fn, full: list[torch.Tensor], causal: bool, layout: str, C: int, r: int, **kw) -> float:
    """Largest |difference| of this rank's output, dq, dk, dv from SDPA by one process on the full sequence."""
    q, k, v, g = full
    ref_in = [t.clone().requires_grad_() for t in (q, k, v)]
    ref = F.scaled_dot_product_attention(*ref_in, is_causal=causal)
    (ref * g).sum().backward()
    want = [ref.detach()] + [t.grad for t in ref_in]
    mine = [cp_shard(t, C, r, 2, layout).requires_grad_() for t in (q, k, v)]
    out = fn(*mine, causal=causal, layout=layout, **kw)
    (out * cp_shard(g, C, r, 2, layout)).sum().backward()
    got = [out.detach()] + [t.grad for t in mine]
    return max((a - cp_shard(b, C, r, 2, layout)).abs().max().item() for a, b in zip(got, want))


class _CountAllToAll:
    """Counts ``dist.all_to_all_single`` calls and the bytes they send to other ranks."""

    def __init__(self, C: int) -> None:
        self.C, self.calls, self.sent = C, 0, 0

    def __enter__(self):
        self._orig = dist.all_to_all_single

        def counted(out, inp, *a, **kw):
            self.calls += 1
            self.sent += inp.numel() * inp.element_size() * (self.C - 1) // self.C
            return self._orig(out, inp, *a, **kw)

        dist.all_to_all_single = counted
        return self

    def __exit__(self, *exc) -> None:
        dist.all_to_all_single = self._orig


def _ulysses_checks(C: int, r: int, heads: int, lengths: tuple, batch: int, head_dim: int) -> dict:
    out = {"err": {}}
    for T in lengths:
        full = _full((batch, heads, T, head_dim), seed=T + 1)
        for causal, layout in ((True, "contiguous"), (False, "contiguous"), (True, "zigzag")):
            out["err"][(T, causal, layout)] = _max_err(ulysses_attention, full, causal, layout, C, r)
    q = torch.randn(batch, heads, lengths[0] // C, head_dim, requires_grad=True)
    with _CountAllToAll(C) as fwd:
        y = ulysses_attention(q, q * 2, q * 3)
    with _CountAllToAll(C) as bwd:
        y.sum().backward()
    out["calls"], out["bytes"] = (fwd.calls, bwd.calls), (fwd.sent, bwd.sent)
    try:
        ulysses_attention(*(torch.zeros(1, C + 1, 2, 4) for _ in range(3)))
    except ValueError as e:
        out["heads_error"] = str(e)
    return out


def _ring_bookkeeping(C: int, r: int, T: int, batch: int, heads: int, head_dim: int) -> dict:
    """Work per rank in both layouts (measured in the run), bytes sent and the posts of one pass."""
    out = {}
    for layout in ("zigzag", "contiguous"):
        stats: dict = {}
        qkv = [torch.randn(batch, heads, T // C, head_dim, requires_grad=True) for _ in range(3)]
        with P2PRecorder() as rec:
            ring_attention(*qkv, causal=True, layout=layout, stats=stats).sum().backward()
        out[layout] = {"stats": stats, "posts": [asdict(o) for o in rec.ops]}
    return out


def cp_suite(lengths: tuple, heads: int = 6, batch: int = 2, head_dim: int = 8, subgroups: bool = False) -> dict:
    """Ring attention (causal zig-zag, causal contiguous, non-causal) and Ulysses against one process
    for each sequence length; balance, bytes and posts; with ``subgroups``, ring and Ulysses on
    two CP groups of world/2 ranks (the other dimension data parallel)."""
    C, r = dist.get_world_size(), dist.get_rank()
    res = {"ring_err": {}}
    for T in lengths:
        full = _full((batch, heads, T, head_dim), seed=T)
        for causal, layout in ((True, "zigzag"), (True, "contiguous"), (False, "zigzag"), (False, "contiguous")):
            res["ring_err"][(T, causal, layout)] = _max_err(ring_attention, full, causal, layout, C, r)
    res["ulysses"] = _ulysses_checks(C, r, heads, lengths, batch, head_dim)
    res["book"] = _ring_bookkeeping(C, r, lengths[-1], batch, heads, head_dim)
    if subgroups:
        half = C // 2
        groups = [dist.new_group(list(range(i * half, (i + 1) * half))) for i in range(2)]
        g, gr = groups[r // half], r % half
        full = _full((batch, heads, lengths[0], head_dim), seed=99 + r // half)  # replicas see different data
        res["group_err"] = {"ring": _max_err(ring_attention, full, True, "zigzag", half, gr, group=g),
                            "ulysses": _max_err(ulysses_attention, full, True, "contiguous", half, gr, group=g)}
    if C == 2:
        from labkit.parallel.context.torch_cp import check_against_torch_cp

        res["torch_cp"] = check_against_torch_cp(batch=1, heads=2, seq=16, head_dim=8)
    return res
