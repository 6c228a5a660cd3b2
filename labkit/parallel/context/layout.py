"""Context parallelism's bookkeeping: which positions each rank holds, which blocks it computes, what it sends.

Context parallelism (CP) splits the *sequence* over C ranks: each holds T/C tokens of every sequence
and all of the model. Attention is the one layer where tokens meet, so it is the one that talks
(:mod:`labkit.parallel.context.ring`, ring attention; :mod:`labkit.parallel.context.ulysses`, all-to-all).

Under a causal mask the contiguous split is unbalanced: rank 0's queries see only their own block,
rank C-1's see the whole sequence, and a ring step whose keys lie wholly in the future of its
queries is skipped, so the early ranks idle while the last computes. The *zig-zag* (head-tail)
split cuts the sequence into 2C chunks and gives rank r chunks r and 2C-1-r: an early chunk and a
late one, the same number of visible (query, key) pairs on every rank. It is the layout of
zhuzilin/ring-flash-attention (``zigzag_ring_flash_attn``), of Llama 3's context parallelism
(Dubey et al. 2024, section 3.3.2) and of PyTorch's ``_HeadTailLoadBalancer``.
"""
from __future__ import annotations

import torch

LAYOUTS = ("zigzag", "contiguous")


def _check(T: int, C: int, r: int, layout: str) -> None:
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    if C < 1 or not 0 <= r < C:
        raise ValueError(f"rank r={r} must lie in [0, C={C})")
    parts = 2 * C if layout == "zigzag" else C
    if T % parts:
        raise ValueError(f"sequence length T={T} must be divisible by {parts} "
                         f"({'2C' if layout == 'zigzag' else 'C'} with C={C}) for the {layout} layout")


def zigzag_indices(T: int, C: int, r: int) -> torch.Tensor:
    """The positions (of 0..T-1) rank ``r`` of ``C`` holds: chunks r and 2C-1-r of 2C equal chunks."""
    _check(T, C, r, "zigzag")
    n = T // (2 * C)
    return torch.cat([torch.arange(r * n, (r + 1) * n), torch.arange((2 * C - 1 - r) * n, (2 * C - r) * n)])


def cp_positions(T: int, C: int, r: int, layout: str = "zigzag") -> torch.Tensor:
    """The true positions of rank ``r``'s tokens, in the order it holds them (for the position
    embedding and the causal mask)."""
    if layout == "zigzag":
        return zigzag_indices(T, C, r)
    _check(T, C, r, layout)
    n = T // C
    return torch.arange(r * n, (r + 1) * n)


def cp_shard(x: torch.Tensor, C: int, r: int, dim: int = 1, layout: str = "zigzag") -> torch.Tensor:
    """Rank ``r``'s slice of ``x`` along its sequence dimension ``dim``."""
    idx = cp_positions(x.shape[dim], C, r, layout).to(x.device)
    return x.index_select(dim, idx)


def zigzag_shard(x: torch.Tensor, C: int, r: int, dim: int = 1) -> torch.Tensor:
    """Rank ``r``'s zig-zag slice of ``x`` along ``dim`` (chunks r and 2C-1-r of 2C)."""
    return cp_shard(x, C, r, dim, "zigzag")


def cp_unshard(shards: list[torch.Tensor], dim: int = 1, layout: str = "zigzag") -> torch.Tensor:
    """The inverse of :func:`cp_shard`: every rank's slice (in rank order) back into the full sequence."""
    C, T = len(shards), sum(s.shape[dim] for s in shards)
    order = torch.cat([cp_positions(T, C, r, layout) for r in range(C)]).to(shards[0].device)
    return torch.cat(shards, dim).index_select(dim, torch.argsort(order))


def zigzag_unshard(shards: list[torch.Tensor], dim: int = 1) -> torch.Tensor:
    """The inverse of :func:`zigzag_shard`."""
    return cp_unshard(shards, dim, "zigzag")


def visible_block(q_pos: torch.Tensor, k_pos: torch.Tensor,
                  causal: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None] | None:
    """What one ring step computes: the query rows and key columns that see anything, and the mask
    within them (None: all visible), or None when the block is wholly masked and is skipped.

    Zig-zag, keys from an earlier rank: every query against the keys' first chunk, unmasked; keys
    from a later rank: the queries' second chunk against all keys, unmasked; own keys: causal.
    """
    rows, cols = torch.arange(len(q_pos)), torch.arange(len(k_pos))
    if not causal:
        return rows, cols, None
    mask = q_pos[:, None] >= k_pos[None, :]  # a query sees keys at or before its true position
    rows, cols = rows[mask.any(1)], cols[mask.any(0)]
    if not len(rows):
        return None
    sub = mask[rows][:, cols]
    return rows, cols, None if bool(sub.all()) else sub


def ring_work(T: int, C: int, causal: bool = True, layout: str = "zigzag") -> list[dict[str, int]]:
    """Per rank, the attention work of one ring pass (per batch row and head): ``scores`` computed
    (the query x key products of the blocks not skipped) and ``visible`` (those the mask keeps)."""
    out = []
    for r in range(C):
        q_pos, scores, visible = cp_positions(T, C, r, layout), 0, 0
        for step in range(C):
            blk = visible_block(q_pos, cp_positions(T, C, (r - step) % C, layout), causal)
            if blk is not None:
                rows, cols, mask = blk
                scores += len(rows) * len(cols)
                visible += len(rows) * len(cols) if mask is None else int(mask.sum())
        out.append({"scores": scores, "visible": visible})
    return out


def cp_comm_bytes(method: str, batch: int, heads: int, seq_len: int, head_dim: int, world: int,
                  elem_bytes: int = 4, grad_elem_bytes: int = 4) -> dict[str, int]:
    """Bytes one rank sends to others per attention call, forward and backward, over ``world`` ranks
    holding ``seq_len / world`` tokens each (``elem_bytes`` per element of q, k, v).

    ``ring``: forward, C-1 steps each passing the local K and V on; backward, K and V again for C-1
    steps plus the dK, dV accumulators (``grad_elem_bytes``: fp32) for C steps, the last taking them
    home. ``ulysses``: four all-to-alls each way (q, k, v in and the output back; their gradients in
    backward), each keeping 1/C of a local tensor on its own rank and sending the rest.
    """
    if seq_len % world:
        raise ValueError(f"seq_len={seq_len} must be divisible by world={world}")
    local = batch * heads * (seq_len // world) * head_dim  # elements of one local q, k or v
    C = world
    if method == "ring":
        return {"forward": (C - 1) * 2 * local * elem_bytes,
                "backward": (C - 1) * 2 * local * elem_bytes + (C if C > 1 else 0) * 2 * local * grad_elem_bytes}
    if method == "ulysses":
        if heads % world:
            raise ValueError(f"heads={heads} must be divisible by world={world} for ulysses")
        each = 4 * local * elem_bytes * (C - 1) // C
        return {"forward": each, "backward": each}
    raise ValueError(f"method must be 'ring' or 'ulysses', got {method!r}")
