"""Choosing the batch: the gradient noise scale, the critical batch size, and what they say about ranks.

McCandlish et al. 2018, "An Empirical Model of Large-Batch Training" (arXiv:1812.06162):

* **The simple noise scale** (section 2.2) is ``B_simple = tr(Sigma) / |G|^2``: the summed variance
  of one example's gradient over the squared norm of the true gradient. A batch much smaller
  than it is mostly noise; one much larger repeats what a smaller one already knew.
* **Two batch sizes give both terms without bias** (appendix A.1). With ``|G_B|^2`` the squared
  norm of a gradient averaged over ``B`` examples, ``E|G_B|^2 = |G|^2 + tr(Sigma) / B``, so from a
  small batch ``b`` and a big one ``B``::

      |G|^2    ~ (B |G_B|^2 - b |G_b|^2) / (B - b)
      tr(Sigma) ~ (|G_b|^2 - |G_B|^2) / (1/b - 1/B)

  Data parallelism hands out both for free: a rank's local gradient (``b``) and the all-reduced one
  (``B = ranks x b``); so does gradient accumulation (a micro-batch and the accumulated step). Each
  estimate is noisy and the ratio of two noisy numbers is biased, so the paper averages ``|G|^2`` and
  ``tr(Sigma)`` separately over many steps and divides the averages (:class:`NoiseScale`).
* **Steps against examples** (section 2.3): to reach a given loss, training at batch ``B`` needs
  ``S = S_min (1 + B_noise / B)`` steps and ``E = E_min (1 + B / B_noise)`` examples, so
  ``(S / S_min - 1)(E / E_min - 1) = 1``. The critical batch ``B_crit = E_min / S_min`` is where
  both are twice their minimum; the paper finds ``B_crit ~ B_noise ~ B_simple``. Below it, doubling
  the batch (the ranks) nearly halves the steps for the same compute; above it, extra ranks buy
  few steps and cost proportionally more compute (:func:`rank_table`).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

from labkit.core.checks import positive_int, positive_number


def two_batch_estimates(sq_small: float, sq_big: float, b_small: float, b_big: float) -> tuple[float, float]:
    """Unbiased ``(|G|^2, tr(Sigma))`` from squared gradient norms at two batch sizes (appendix A.1).

    ``sq_small`` is ``|G_b|^2`` (a gradient averaged over ``b_small`` examples; averaging several
    such squared norms lowers the noise and keeps the estimate unbiased), ``sq_big`` is ``|G_B|^2``.
    """
    b, big = positive_number("b_small", b_small), positive_number("b_big", b_big)
    if big <= b:
        raise ValueError(f"b_big={b_big!r} must exceed b_small={b_small!r}: the two batches must differ")
    g2 = (big * sq_big - b * sq_small) / (big - b)
    trace = (sq_small - sq_big) / (1 / b - 1 / big)
    return g2, trace


@dataclass
class NoiseScale:
    """Running sums of the two estimates; :attr:`b_simple` divides their means (not a mean of ratios).

    ``decay`` < 1 keeps exponential moving averages instead (the paper's choice during training,
    where the noise scale drifts as the loss falls); 1.0 weighs every measurement alike.
    """

    decay: float = 1.0
    g2: float = 0.0
    trace: float = 0.0
    weight: float = 0.0
    history: list = field(default_factory=list)

    def update(self, sq_small: float, sq_big: float, b_small: float, b_big: float) -> float:
        """Add one measurement; return the running ``B_simple``."""
        if not 0 < self.decay <= 1:
            raise ValueError(f"decay must be in (0, 1], got {self.decay!r}")
        g2, trace = two_batch_estimates(sq_small, sq_big, b_small, b_big)
        self.g2 = self.decay * self.g2 + g2
        self.trace = self.decay * self.trace + trace
        self.weight = self.decay * self.weight + 1
        self.history.append({"g2": g2, "trace": trace, "b_simple": self.b_simple})
        return self.b_simple

    @property
    def b_simple(self) -> float:
        """``tr(Sigma) / |G|^2`` of the averages; ``inf`` while the mean ``|G|^2`` is not positive."""
        return self.trace / self.g2 if self.g2 > 0 else float("inf")


def steps_ratio(batch: float, b_noise: float) -> float:
    """``S / S_min = 1 + B_noise / B``: steps to a given loss, relative to an infinite batch."""
    return 1 + positive_number("b_noise", b_noise) / positive_number("batch", batch)


def examples_ratio(batch: float, b_noise: float) -> float:
    """``E / E_min = 1 + B / B_noise``: examples (compute) to a given loss, relative to a tiny batch."""
    return 1 + positive_number("batch", batch) / positive_number("b_noise", b_noise)


def rank_table(b_noise: float, micro_batch: int, ranks: list[int]) -> list[dict]:
    """Data parallelism over ``ranks`` ranks of ``micro_batch`` examples each (global batch = their
    product): steps and compute relative to their minimums, the speed-up over one rank at a fixed
    time per step, and the parallel efficiency (speed-up / ranks, which is also the compute one
    rank needs over the compute ``ranks`` ranks need)."""
    b = positive_int("micro_batch", micro_batch)
    one = steps_ratio(b, b_noise)
    rows = []
    for n in ranks:
        batch = positive_int("ranks", n) * b
        s = steps_ratio(batch, b_noise)
        rows.append({"ranks": n, "global_batch": batch, "steps_vs_min": s,
                     "compute_vs_min": examples_ratio(batch, b_noise), "speedup": one / s,
                     "efficiency": one / s / n})
    return rows


def useful_ranks(b_noise: float, micro_batch: int) -> int:
    """Ranks whose global batch reaches ``B_noise``: beyond them each doubling of the ranks saves
    less than a third of the steps and costs at least half again the compute."""
    return max(1, round(positive_number("b_noise", b_noise) / positive_int("micro_batch", micro_batch)))


def lr_optimum(lrs: list[float], losses: list[float]) -> float:
    """The learning rate of least loss on a grid, refined between grid points: the vertex of the
    parabola in ``log(lr)`` through the lowest point and its two neighbours (the lowest point
    itself when it lies on the grid's edge, or the three points do not curve upward)."""
    if len(lrs) != len(losses) or not lrs:
        raise ValueError(f"lrs and losses need the same, non-zero length; got {len(lrs)} and {len(losses)}")
    grid = sorted(zip((positive_number("lr", lr) for lr in lrs), losses))
    i = min(range(len(grid)), key=lambda k: grid[k][1])
    if i == 0 or i == len(grid) - 1:
        return grid[i][0]
    (x0, y0), (x1, y1), (x2, y2) = ((math.log(lr), loss) for lr, loss in grid[i - 1:i + 2])
    denom = (x0 - x1) * (x0 - x2) * (x1 - x2)
    a = (x2 * (y1 - y0) + x1 * (y0 - y2) + x0 * (y2 - y1)) / denom
    b = (x2 * x2 * (y0 - y1) + x1 * x1 * (y2 - y0) + x0 * x0 * (y1 - y2)) / denom
    if a <= 0:
        return grid[i][0]
    return math.exp(min(max(-b / (2 * a), x0), x2))


def scaled_lr(base_lr: float, base_batch: float, batch: float, power: float = 0.5) -> float:
    """``base_lr (batch / base_batch) ** power``: ``power`` 1 is the linear rule for SGD (Goyal et al.
    2017), 0.5 the square-root rule often used with Adam; McCandlish et al. 2018 report Adam's best
    learning rate growing as a power of the batch between 0.5 and 1 while the batch is below
    B_noise, and flattening above it."""
    positive_number("power", power)
    return positive_number("base_lr", base_lr) * (positive_number("batch", batch)
                                                  / positive_number("base_batch", base_batch)) ** power
