"""Batching policies and the padding each one wastes.

Every row of a batch is padded to the batch's width, and padded positions cost the same compute as
real tokens. :func:`padding_stats` counts that waste for one pass over the data, :func:`make_batches`
builds the batches under the usual policies and :func:`compare_policies` runs them all on the same
lengths.

Policies (``make_batches``):

* ``"pad_to_max"``: random batches of ``batch_size`` sequences padded to ``max_len`` (static shapes).
* ``"random"``: random batches padded to their longest sequence (``DataCollatorWithPadding``).
* ``"length_grouped"``: shuffle, sort within mega-batches of ``megabatch * batch_size`` sequences,
  cut into batches (Hugging Face ``LengthGroupedSampler``).
* ``"token_budget"``: like length-grouped, but a batch takes sequences while ``rows x width`` stays
  within ``max_tokens`` (fairseq's ``--max-tokens`` dynamic batching).
* ``"packed"``: ``pack(lengths, max_len)`` rows, ``batch_size`` rows per batch.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass
from itertools import chain
from typing import NamedTuple, Sequence

import numpy as np

from labkit.core.checks import positive_int
from labkit.feeding.packing import check_lengths, pack

POLICIES = ("pad_to_max", "random", "length_grouped", "token_budget", "packed")


class Batch(NamedTuple):
    """One batch: rows of sequence indices (one index per row unless packed), padded to ``width``."""

    rows: list[list[int]]
    width: int


def make_batches(lengths: Sequence[int] | np.ndarray, policy: str, *, max_len: int, batch_size: int = 32,
                 max_tokens: int | None = None, megabatch: int = 50, seed: int = 0) -> list[Batch]:
    """Batches of ``lengths`` under ``policy`` (see the module docstring); one pass over the data."""
    L = check_lengths(lengths)
    max_len, batch_size = positive_int("max_len", max_len), positive_int("batch_size", batch_size)
    megabatch = positive_int("megabatch", megabatch)
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
        max_tokens = positive_int("max_tokens", max_tokens)
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
