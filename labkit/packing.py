"""Padding waste, batching policies and sequence packing.

A batch of variable-length sequences is a rectangle: every row is padded to the batch's width, and
the padded positions cost the same compute as real tokens. This module measures that waste for the
usual batching policies and removes it by *packing*: several whole sequences share one row of
``capacity`` tokens (Krell et al. 2021, "Efficient Sequence Packing without Cross-contamination",
arXiv:2107.02027). ``labkit.collate`` turns packed rows into model inputs that keep the sequences
apart (position ids restarting per sequence, a block-diagonal causal mask, masked boundary labels).

Policies (``make_batches``):

* ``"pad_to_max"``: random batches of ``batch_size`` sequences padded to ``max_len`` (static shapes).
* ``"random"``: random batches padded to their longest sequence (``DataCollatorWithPadding``).
* ``"length_grouped"``: shuffle, sort within mega-batches of ``megabatch * batch_size`` sequences,
  cut into batches (Hugging Face ``LengthGroupedSampler``).
* ``"token_budget"``: like length-grouped, but a batch takes sequences while ``rows x width`` stays
  within ``max_tokens`` (fairseq's ``--max-tokens`` dynamic batching).
* ``"packed"``: ``pack(lengths, max_len)`` rows, ``batch_size`` rows per batch.

``pack`` is best-fit decreasing (BFD; Johnson et al. 1974, "Worst-case performance bounds for simple
one-dimensional packing algorithms") over the whole data set, the packer of Ding et al. 2024,
"Fewer Truncations Improve Language Modeling" (arXiv:2404.10830) and of TRL's ``pack_dataset``.
"""
from __future__ import annotations

import math
from bisect import bisect_left, insort
from collections import deque
from itertools import chain
from dataclasses import asdict, dataclass
from typing import NamedTuple, Sequence

import numpy as np

POLICIES = ("pad_to_max", "random", "length_grouped", "token_budget", "packed")
OVERFLOW = ("split", "truncate")


def _positive_int(name: str, value) -> int:
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)) or value <= 0:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")
    return int(value)


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
    L, C = check_lengths(lengths), _positive_int("capacity", capacity)
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
    L, C = check_lengths(lengths), _positive_int("capacity", capacity)
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


class Batch(NamedTuple):
    """One batch: rows of sequence indices (one index per row unless packed), padded to ``width``."""

    rows: list[list[int]]
    width: int


def make_batches(lengths: Sequence[int] | np.ndarray, policy: str, *, max_len: int, batch_size: int = 32,
                 max_tokens: int | None = None, megabatch: int = 50, seed: int = 0) -> list[Batch]:
    """Batches of ``lengths`` under ``policy`` (see the module docstring); one pass over the data."""
    L = check_lengths(lengths)
    max_len, batch_size = _positive_int("max_len", max_len), _positive_int("batch_size", batch_size)
    megabatch = _positive_int("megabatch", megabatch)
    if policy not in POLICIES:
        raise ValueError(f"policy={policy!r} is unknown; valid policies: {list(POLICIES)}")
    if L.max() > max_len:
        raise ValueError(f"lengths up to {L.max()} exceed max_len={max_len}; truncate or split them first "
                         f"(pack(..., overflow='split'|'truncate') for packing)")
    rng = np.random.default_rng(seed)
    if policy == "packed":
        rows = pack(L, max_len)
        perm = rng.permutation(len(rows)).tolist()
        return [Batch([rows[j] for j in perm[a:a + batch_size]], max_len) for a in range(0, len(rows), batch_size)]
    idx = rng.permutation(len(L))
    if policy in ("pad_to_max", "random"):
        chunks = [idx[a:a + batch_size] for a in range(0, len(idx), batch_size)]
        return [Batch([[i] for i in c.tolist()], max_len if policy == "pad_to_max" else int(L[c].max()))
                for c in chunks]
    # Sort within mega-batches, longest first: neighbours have similar lengths, order stays random.
    mb = megabatch * batch_size
    idx = np.concatenate([m[np.argsort(-L[m], kind="stable")] for m in np.split(idx, range(mb, len(idx), mb))])
    if policy == "length_grouped":
        cuts = list(range(batch_size, len(idx), batch_size))
    else:
        if max_tokens is None:
            raise ValueError("policy='token_budget' needs max_tokens (padded tokens per batch), "
                             "e.g. max_tokens=batch_size * max_len")
        max_tokens = _positive_int("max_tokens", max_tokens)
        if max_tokens < max_len:
            raise ValueError(f"max_tokens={max_tokens} cannot hold one sequence of max_len={max_len}; "
                             f"use max_tokens >= {max_len}")
        cuts, count, width = [], 0, 0
        for pos, n in enumerate(L[idx].tolist()):
            if count and (count + 1) * max(width, n) > max_tokens:
                cuts.append(pos)
                count, width = 0, 0
            count, width = count + 1, max(width, n)
    groups = np.split(idx, cuts)
    batches = [Batch([[i] for i in g.tolist()], int(L[g].max())) for g in groups]
    return [batches[j] for j in rng.permutation(len(batches)).tolist()]  # sorted order is not random


@dataclass(frozen=True)
class PaddingStats:
    """Padding of one pass over the data: padded slots are ``rows x width`` summed over batches."""

    n_batches: int
    sequences: int
    real_tokens: int
    padded_tokens: int
    padding_fraction: float  # padding slots / all slots
    tokens_per_batch_mean: float  # real tokens per batch
    tokens_per_batch_std: float
    tokens_per_batch_min: int
    tokens_per_batch_max: int
    slots_per_batch_mean: float  # rows x width per batch: the compute each batch costs

    def to_dict(self) -> dict:
        return asdict(self)


def padding_stats(lengths: Sequence[int] | np.ndarray, batches: Sequence[Batch]) -> PaddingStats:
    """Padding fraction and real tokens per batch (mean, spread) of ``batches`` over ``lengths``."""
    L = check_lengths(lengths)
    if not batches:
        raise ValueError("batches is empty; pass the output of make_batches")
    rows = [r for b in batches for r in b.rows]
    sizes = np.fromiter(map(len, rows), dtype=np.int64, count=len(rows))
    flat = np.fromiter(chain.from_iterable(rows), dtype=np.int64, count=int(sizes.sum()))
    row_tokens = np.add.reduceat(L[flat], np.r_[0, np.cumsum(sizes)[:-1]])  # rows are never empty
    rows_per_batch = np.array([len(b.rows) for b in batches])
    widths = np.array([b.width for b in batches])
    over = np.flatnonzero(row_tokens > np.repeat(widths, rows_per_batch))
    if over.size:
        raise ValueError(f"a row holds {row_tokens[over[0]]} tokens, more than its batch's width")
    real = np.add.reduceat(row_tokens, np.r_[0, np.cumsum(rows_per_batch)[:-1]])
    slots = rows_per_batch * widths
    return PaddingStats(
        n_batches=len(batches), sequences=len(flat), real_tokens=int(real.sum()), padded_tokens=int(slots.sum()),
        padding_fraction=float(1 - real.sum() / slots.sum()), tokens_per_batch_mean=float(real.mean()),
        tokens_per_batch_std=float(real.std()), tokens_per_batch_min=int(real.min()),
        tokens_per_batch_max=int(real.max()), slots_per_batch_mean=float(slots.mean()))


def compare_policies(lengths: Sequence[int] | np.ndarray, *, max_len: int, batch_size: int = 32,
                     max_tokens: int | None = None, megabatch: int = 50, seed: int = 0) -> dict[str, PaddingStats]:
    """``padding_stats`` of every policy on the same lengths; ``max_tokens`` defaults to a
    ``pad_to_max`` batch's slots (``batch_size * max_len``), so every policy gets the same budget."""
    budget = max_tokens if max_tokens is not None else batch_size * max_len
    return {p: padding_stats(lengths, make_batches(lengths, p, max_len=max_len, batch_size=batch_size,
                                                   max_tokens=budget, megabatch=megabatch, seed=seed))
            for p in POLICIES}
