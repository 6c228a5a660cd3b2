"""Planted bug, communication: bus bandwidth uses the all-reduce factor for every collective."""
# -- grade_id: comm_alpha_beta --
import numpy as np


def fit_alpha_beta(sizes, times):
    s, t = np.asarray(sizes, dtype=float), np.asarray(times, dtype=float)
    if s.size < 2:
        raise ValueError(f"sizes: need at least two sizes, got {s.size}")
    a = np.stack([1 / t, s / t], axis=1)
    (alpha, beta), *_ = np.linalg.lstsq(a, np.ones_like(t), rcond=None)
    return float(alpha), float(beta)


def busbw(op, n, nbytes, seconds):
    return nbytes / seconds / 1e9 * 2 * (n - 1) / n
