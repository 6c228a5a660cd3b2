"""Sequence packing: several whole sequences share one row, so rows carry no padding.

A batch of variable-length sequences is a rectangle: every row is padded to the batch's width, and
the padded positions cost the same compute as real tokens (:mod:`labkit.feeding.batching` measures that
waste under the usual batching policies). Packing removes it: several whole sequences share one row of
``capacity`` tokens (Krell et al. 2021, "Efficient Sequence Packing without Cross-contamination",
arXiv:2107.02027). ``labkit.feeding.collate`` turns packed rows into model inputs that keep the sequences
apart (position ids restarting per sequence, a block-diagonal causal mask, masked boundary labels).

``pack`` is best-fit decreasing (BFD; Johnson et al. 1974, "Worst-case performance bounds for simple
one-dimensional packing algorithms") over the whole data set, the packer of Ding et al. 2024,
"Fewer Truncations Improve Language Modeling" (arXiv:2404.10830) and of TRL's ``pack_dataset``.
"""
from __future__ import annotations

import math
from bisect import bisect_left, insort
from collections import deque
from typing import Sequence

import numpy as np

from labkit.core.checks import positive_int

OVERFLOW = ("split", "truncate")


def check_lengths(lengths: Sequence[int] | np.ndarray) -> np.ndarray:
    """``lengths`` as a 1-D int64 array; a ValueError for empty, non-integer or non-positive input."""
    arr = np.asarray(lengths)
    if arr.ndim != 1:
        raise ValueError(f"lengths must be a 1-D sequence of token counts, got shape {arr.shape}")
    if arr.size == 0:
        raise ValueError("lengths is empty; pass at least one sequence length (a positive integer)")
    if arr.dtype == bool or not (np.issubdtype(arr.dtype, np.integer)
                                 or (np.issubdtype(arr.dtype, np.floating) and np.all(arr == np.round(arr)))):
        raise ValueError(f"lengths must be integers (tokens per sequence), got dtype {arr.dtype}")
    arr = arr.astype(np.int64)
    bad = np.flatnonzero(arr <= 0)
    if bad.size:
        raise ValueError(f"lengths must be positive integers; lengths[{bad[0]}]={arr[bad[0]]} "
                         f"({bad.size} non-positive in all)")
    return arr


def lower_bound(lengths: Sequence[int] | np.ndarray, capacity: int) -> int:
    """Fewest rows any packer can reach: ceil(total / capacity), and one row per sequence longer than
    half the capacity (no two of those fit together). Sequences must fit (``<= capacity``)."""
    L, C = check_lengths(lengths), positive_int("capacity", capacity)
    if L.max() > C:
        raise ValueError(f"lengths up to {L.max()} exceed capacity={C}; split or truncate them first "
                         "(the bound counts whole sequences per row)")
    return max(math.ceil(int(L.sum()) / C), int((2 * L > C).sum()))


class Packing(list):
    """Rows of sequence indices (a plain ``list[list[int]]``) and the accounting of ``pack``.

    With ``overflow="split"`` a sequence longer than the capacity appears in ``ceil(len/capacity)``
    rows, and its k-th appearance in row order is the piece starting at token ``k * capacity``; with
    ``"truncate"`` it appears once and holds its first ``capacity`` tokens.
    """

    def __init__(self, rows: list[list[int]], fill: np.ndarray, capacity: int, overflow: str | None,
                 n_overflow: int, tokens_dropped: int, n_pieces: int) -> None:
        super().__init__(rows)
        self.fill = fill  # tokens per row
        self.capacity, self.overflow = capacity, overflow
        self.n_overflow = n_overflow  # sequences longer than capacity
        self.tokens_dropped = tokens_dropped  # by truncation
        self.n_pieces = n_pieces  # pieces the long sequences were cut into

    @property
    def efficiency(self) -> float:
        """Real tokens over row slots: 1 - padding fraction."""
        return float(self.fill.sum()) / (len(self) * self.capacity)

    def report(self) -> dict:
        return dict(rows=len(self), capacity=self.capacity, efficiency=self.efficiency,
                    overflow=self.overflow, n_overflow=self.n_overflow,
                    tokens_dropped=self.tokens_dropped, n_pieces=self.n_pieces)


def _take(chunks: deque, q: int) -> np.ndarray:
    """Pop the first ``q`` row ids from a bucket kept as a deque of arrays."""
    out = []
    while q:
        a = chunks[0]
        if len(a) <= q:
            out.append(chunks.popleft())
            q -= len(a)
        else:
            out.append(a[:q])
            chunks[0] = a[q:]
            q = 0
    return out[0] if len(out) == 1 else np.concatenate(out)


def _best_fit_decreasing(lengths: np.ndarray, C: int) -> tuple[np.ndarray, np.ndarray]:
    """Items sorted by decreasing length, and the row of each, under best-fit decreasing.

    Best fit puts each item in the open row with the least room that still holds it. Rows are kept
    in buckets by remaining room; the rooms that have rows form a sorted list, so "least room >= L"
    is a bisection, never a scan over rows. Equal items are placed as a group, which is exact: the
    row chosen for one item of length L is still the best fit for the next while its room is >= L,
    so a group fills the rows in increasing order of room, ``room // L`` items each, and rows with
    the same room are interchangeable. A row's room at least halves each time a group exhausts it
    (r mod L < r/2), so bucket moves total O(distinct lengths x log C) on top of the O(n log n) sort.
    """
    order = np.argsort(-lengths, kind="stable")
    sorted_len = lengths[order]
    starts = np.flatnonzero(np.r_[True, sorted_len[1:] != sorted_len[:-1]])
    ends = np.r_[starts[1:], len(order)]
    row_of = np.empty(len(order), dtype=np.int64)
    buckets: dict[int, deque] = {}  # room -> row ids with that room, as chunks
    size: dict[int, int] = {}  # room -> number of rows with that room
    rooms: list[int] = []  # sorted rooms that have at least one row
    n_rows = 0
    for s, e in zip(starts.tolist(), ends.tolist()):
        L, k = int(sorted_len[s]), e - s
        placed, moves = [], []
        i = bisect_left(rooms, L)
        while k and i < len(rooms):
            r = rooms[i]
            per_row, chunks, have = r // L, buckets[r], size[r]
            taken = min(have, k // per_row)
            if taken:
                ids = _take(chunks, taken)
                placed.append(np.repeat(ids, per_row))
                moves.append((r - per_row * L, ids))
                k -= taken * per_row
            if k and taken < have:  # the group ends inside this bucket
                ids = _take(chunks, 1)
                placed.append(np.repeat(ids, k))
                moves.append((r - k * L, ids))
                k, taken = 0, taken + 1
            size[r] = have - taken
            if chunks:
                i += 1
            else:
                del buckets[r], size[r], rooms[i]
        if k:  # no open row has room: open new ones, each taking C // L items
            per_row = C // L
            new = -(-k // per_row)
            ids = np.arange(n_rows, n_rows + new)
            n_rows += new
            counts = np.full(new, per_row)
            counts[-1] = k - per_row * (new - 1)
            placed.append(np.repeat(ids, counts))
            moves.append((C - per_row * L, ids[:-1]))
            moves.append((C - int(counts[-1]) * L, ids[-1:]))
        row_of[s:e] = np.concatenate(placed) if len(placed) > 1 else placed[0]
        for room, ids in moves:  # rooms below L (or the group is done): safe to add now
            if room and len(ids):
                if room not in buckets:
                    buckets[room], size[room] = deque(), 0
                    insort(rooms, room)
                buckets[room].append(ids)
                size[room] += len(ids)
    return order, row_of


def pack(lengths: Sequence[int] | np.ndarray, capacity: int, overflow: str | None = None) -> Packing:
    """Pack sequences into rows of ``capacity`` tokens by best-fit decreasing over the whole data set.

    Returns the rows as lists of indices into ``lengths`` (a ``Packing``, which is a ``list``), rows
    holding the longest sequences first. Sequences longer than ``capacity`` need ``overflow``:
    ``"split"`` cuts them into pieces of ``capacity`` tokens (each a row of its own) plus a
    remainder that is packed like any sequence; ``"truncate"`` keeps their first ``capacity`` tokens.
    """
    L, C = check_lengths(lengths), positive_int("capacity", capacity)
    if overflow is not None and overflow not in OVERFLOW:
        raise ValueError(f"overflow={overflow!r} is unknown; valid: None, 'split' or 'truncate'")
    long = np.flatnonzero(L > C)
    if long.size and overflow is None:
        raise ValueError(
            f"{long.size} sequences are longer than capacity={C} (lengths[{long[0]}]={L[long[0]]}, "
            f"longest {L.max()}); pass overflow='split' to cut them into pieces of at most {C} tokens "
            f"(every token kept) or overflow='truncate' to keep their first {C} tokens")
    rows: list[list[int]] = []
    dropped = pieces = 0
    items = np.arange(len(L))
    if overflow == "truncate":
        dropped = int((L[long] - C).sum())
        L = np.minimum(L, C)
    elif long.size:  # split: full pieces first, so a sequence's remainder lands in a later row
        n_full = L[long] // C
        rows = [[i] for i in np.repeat(long, n_full).tolist()]
        pieces = int(n_full.sum()) + int((L[long] % C > 0).sum())
        L = L % np.where(L > C, C, C + 1)  # remainders of the long ones, the others unchanged
        items = np.flatnonzero(L)
        L = L[items]
    fill = [np.full(len(rows), C, dtype=np.int64)]
    if len(L):
        order, row_of = _best_fit_decreasing(L, C)
        by_row = np.argsort(row_of, kind="stable")
        flat = items[order[by_row]].tolist()
        counts = np.bincount(row_of)
        bounds = np.r_[0, np.cumsum(counts)].tolist()
        rows += [flat[a:b] for a, b in zip(bounds[:-1], bounds[1:])]
        fill.append(np.bincount(row_of, weights=L[order]).astype(np.int64))
    return Packing(rows, np.concatenate(fill), C, overflow, int(long.size), dropped, pieces)
