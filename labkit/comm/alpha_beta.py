"""The latency-bandwidth (alpha-beta) model of a collective's time, fitted to measured times.

Hockney's model (Hockney 1994; Thakur, Rabenseifner and Gropp 2005 for the collectives): a message
of ``S`` bytes takes ``t(S) = alpha + beta * S``, ``alpha`` the start-up latency (software, the
kernel launch, the hops) and ``beta`` the inverse bandwidth. For a ring collective over ``n`` ranks
the terms multiply: a ring all-reduce makes 2(n-1) steps of S/n bytes each, so
``t = 2(n-1) alpha + 2(n-1)/n * S * beta_link``; fitted on one rank count both collapse into one
``alpha`` and one ``beta`` per collective, which is what :func:`fit` returns.

Small messages sit on the flat ``alpha`` part (latency rules), large ones on the ``beta * S`` line
(bandwidth rules); they cross at ``S* = alpha / beta`` bytes. A gradient bucket much smaller than
``S*`` spends most of its time in start-up costs, which is why DDP packs gradients into buckets.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class AlphaBeta:
    alpha_s: float  # start-up latency per call, seconds
    beta_s_per_byte: float  # seconds per byte of S (1 / the asymptotic algorithm bandwidth)

    @property
    def bandwidth_gbps(self) -> float:
        """The asymptotic algorithm bandwidth ``1 / beta``, GB/s (1e9 bytes)."""
        return 1 / self.beta_s_per_byte / 1e9 if self.beta_s_per_byte > 0 else float("inf")

    @property
    def crossover_bytes(self) -> float:
        """``alpha / beta``: below it latency is most of the time, above it bandwidth."""
        return self.alpha_s / self.beta_s_per_byte if self.beta_s_per_byte > 0 else float("inf")

    def time_s(self, nbytes) -> np.ndarray:
        """The model's time for ``nbytes`` (a number or an array)."""
        return self.alpha_s + self.beta_s_per_byte * np.asarray(nbytes, dtype=float)


def fit(nbytes, times_s) -> AlphaBeta:
    """Fit ``t = alpha + beta * S`` to measured ``(S, t)`` pairs, minimising the *relative* error.

    Plain least squares on seconds would let the largest messages decide alone; dividing every row
    by its measured time weighs a 1 KB message as much as a 16 MB one, so the fit holds across the
    five orders of magnitude a benchmark spans. ``alpha`` and ``beta`` are kept non-negative."""
    s, t = np.asarray(nbytes, dtype=float), np.asarray(times_s, dtype=float)
    if s.shape != t.shape or s.size < 2:
        raise ValueError(f"need at least two (bytes, time) pairs of equal length, got {s.size} and {t.size}")
    if np.any(s <= 0) or np.any(t <= 0) or not np.all(np.isfinite(s * t)):
        raise ValueError("bytes and times must be positive and finite")
    a = np.stack([1 / t, s / t], axis=1)
    (alpha, beta), *_ = np.linalg.lstsq(a, np.ones_like(t), rcond=None)
    if alpha < 0:  # bandwidth alone: t = beta S, fitted in the same relative sense
        alpha, beta = 0.0, float(np.sum(s / t) / np.sum((s / t) ** 2))
    elif beta < 0:  # latency alone: t = alpha
        alpha, beta = float(np.sum(1 / t) / np.sum(1 / t ** 2)), 0.0
    return AlphaBeta(float(alpha), float(beta))


def relative_errors(model: AlphaBeta, nbytes, times_s) -> np.ndarray:
    """``|model - measured| / measured`` at every measured size."""
    t = np.asarray(times_s, dtype=float)
    return np.abs(model.time_s(nbytes) - t) / t


def fit_rows(rows: list[dict]) -> dict[str, AlphaBeta]:
    """One fit per collective of benchmark rows (``{"op", "bytes", "time_us"}``, as
    :mod:`labkit.comm.bench` writes them)."""
    ops = sorted({r["op"] for r in rows})
    return {op: fit([r["bytes"] for r in rows if r["op"] == op], [r["time_us"] / 1e6 for r in rows if r["op"] == op])
            for op in ops}
