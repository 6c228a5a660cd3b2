"""Failures at scale, as arithmetic: interruptions per day as a job grows, the checkpoint interval,
and the goodput (useful time over wall time) that checkpoint and restart costs leave.

* **Rates.** A per-GPU failure rate ``lam`` (failures per GPU-day) makes a job of ``N`` GPUs fail
  ``lam * N`` times a day, every ``24 / (lam * N)`` hours on average: any one failure stops a
  synchronous job. :data:`LLAMA3` is the one public figure used here: Llama 3 405B's pre-training,
  419 unexpected interruptions (466 with 47 planned) in a 54-day snapshot on up to 16K H100s
  (Dubey et al. 2024, "The Llama 3 Herd of Models", section 3.3.4 and its Table 5).
* **Interval.** Young's first-order optimum ``sqrt(2 C M)`` for a checkpoint costing ``C`` and a mean
  time between failures ``M`` (Young 1974); Daly's higher-order one
  ``sqrt(2 C M) [1 + sqrt(C / 2M) / 3 + (C / 2M) / 9] - C`` for ``C < 2M``, else ``M`` (Daly 2006,
  whose Figs. 3-5 give 117, 57 and 9.1 minutes for C = 5 min, R = 10 min and M = 24 h, 6 h and
  15 min: ``tests/test_failures_at_scale.py`` reproduces them).
* **Goodput.** Daly's expected wall time per segment of ``tau`` hours of work, checkpointed at its
  end and failing as a Poisson process (failures during a restart too), is
  ``M exp(R/M) (exp((tau + C)/M) - 1)`` (Daly 2006's complete model, for a run of one segment);
  the goodput is ``tau`` over it. :func:`labkit.planning.cost.expected_wall_hours` is the same
  expectation to first order in ``R`` (``(M + R)`` for ``M exp(R/M)``).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from labkit.core.checks import non_negative_number, positive_int, positive_number

HOURS_PER_DAY = 24.0

# Dubey et al. 2024, section 3.3.4 and Table 5 (counts only: the table's percentage for "Faulty GPU",
# 30.1%, is not 148 / 419; the counts add up to 419).
LLAMA3 = dict(gpus=16384, days=54, interruptions=466, planned=47, unexpected=419,
              hardware_share=0.78,  # "approximately 78% ... attributed to confirmed hardware issues"
              effective_training=0.90,  # "more than 90% effective training time"
              silent_data_corruption=6,  # Table 5's row: interruptions caused by SDC
              gpu_hbm3=72, faulty_gpu=148)


def failures_per_gpu_day(failures: float, gpus: int, days: float) -> float:
    """A per-GPU rate from a published count: ``failures / (gpus * days)``."""
    return (non_negative_number("failures", failures) / positive_int("gpus", gpus, accept_float=True)
            / positive_number("days", days))


def interruptions_per_day(n_gpus: int, per_gpu_day: float) -> float:
    """How often a synchronous job of ``n_gpus`` stops: any one GPU's failure stops it."""
    return positive_int("n_gpus", n_gpus, accept_float=True) * positive_number("per_gpu_day", per_gpu_day)


def mtbf_hours(n_gpus: int, per_gpu_day: float) -> float:
    """Mean hours between interruptions of a job of ``n_gpus``."""
    return HOURS_PER_DAY / interruptions_per_day(n_gpus, per_gpu_day)


def young_interval(checkpoint: float, mtbf: float) -> float:
    """Young's optimum interval between checkpoints, ``sqrt(2 C M)`` (Young 1974), in C's units."""
    return math.sqrt(2 * positive_number("checkpoint", checkpoint) * positive_number("mtbf", mtbf))


def daly_interval(checkpoint: float, mtbf: float) -> float:
    """Daly's higher-order optimum compute time between checkpoints (Daly 2006), in C's units."""
    c, m = positive_number("checkpoint", checkpoint), positive_number("mtbf", mtbf)
    if c >= 2 * m:  # a checkpoint as long as two failure intervals: checkpoint every M
        return m
    x = c / (2 * m)
    return math.sqrt(2 * c * m) * (1 + math.sqrt(x) / 3 + x / 9) - c


def wall_per_segment(tau: float, mtbf: float, checkpoint: float = 0.0, restart: float = 0.0) -> float:
    """Expected wall time to get ``tau`` of work done and checkpointed (Daly 2006's model, one
    segment): ``M exp(R/M) (exp((tau + C)/M) - 1)``, all in one unit of time."""
    tau, m = positive_number("tau", tau), positive_number("mtbf", mtbf)
    c, r = non_negative_number("checkpoint", checkpoint), non_negative_number("restart", restart)
    return m * math.exp(r / m) * math.expm1((tau + c) / m)


def goodput(mtbf: float, checkpoint: float, restart: float, tau: float | None = None) -> float:
    """Useful time over wall time: ``tau / wall_per_segment`` at the interval ``tau`` (Daly's
    optimum when None). To first order, ``1 - C/tau - tau/(2M) - R/M``."""
    tau = daly_interval(checkpoint, mtbf) if tau is None else tau
    return tau / wall_per_segment(tau, mtbf, checkpoint, restart)


@dataclass(frozen=True)
class Path:
    """One way to survive failures: what a checkpoint costs the run (``checkpoint_s``) and what a
    failure costs besides the lost work (``restart_s``: new processes, restore)."""

    name: str
    checkpoint_s: float
    restart_s: float

    def __post_init__(self) -> None:
        positive_number(f"{self.name}: checkpoint_s", self.checkpoint_s)
        non_negative_number(f"{self.name}: restart_s", self.restart_s)


def goodput_table(gpu_counts: list[int], per_gpu_day: float, paths: list[Path]) -> list[dict]:
    """Per job size and path: interruptions a day, MTBF, Young's and Daly's intervals, the goodput."""
    rows = []
    for n in gpu_counts:
        m_s = mtbf_hours(n, per_gpu_day) * 3600
        for p in paths:
            tau = daly_interval(p.checkpoint_s, m_s)
            rows.append({"gpus": int(n), "path": p.name, "per_day": interruptions_per_day(n, per_gpu_day),
                         "mtbf_h": m_s / 3600, "checkpoint_s": p.checkpoint_s, "restart_s": p.restart_s,
                         "young_interval_min": young_interval(p.checkpoint_s, m_s) / 60,
                         "daly_interval_min": tau / 60,
                         "goodput": goodput(m_s, p.checkpoint_s, p.restart_s, tau)})
    return rows


def cost_per_interruption_h(days: float, interruptions: int, effective: float) -> float:
    """The most each interruption can have cost on average (lost work, restart) for a run of ``days``
    that kept ``effective`` of its time: ``(1 - effective) * days * 24 / interruptions`` hours."""
    return ((1 - non_negative_number("effective", effective)) * positive_number("days", days) * HOURS_PER_DAY
            / positive_int("interruptions", interruptions))
