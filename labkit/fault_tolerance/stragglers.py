"""Stragglers: the slow rank is the one that waits least.

In synchronous training every rank leaves each collective together, so every rank's step takes the
slowest rank's time: step time cannot say which rank is slow. What differs is where the time goes.
:class:`PhaseTimer` splits each rank's step into *compute* (its own forward and backward) and *wait*
(inside the collective, which on the fast ranks is mostly waiting for the slow one); the device is
synchronized at each boundary, so queued GPU kernels count where they run, not where they are
waited for. :func:`find_stragglers` names the ranks whose compute exceeds the others' median by a
margin. Production systems do the same at scale: MegaScale (Jiang et al. 2024) records the
execution time of critical code segments on every rank with CUDA events, which need no
synchronization and so can stay on in production (this timer synchronizes: affordable in a lab, not
on 10,000 GPUs); PyTorch's flight recorder keeps each rank's recent collectives, so the rank that
never entered one is found after a hang (PyTorch, "Flight Recorder for Debugging Stuck Jobs"). The
split needs no clock shared between machines: each rank measures only its own durations.
"""
from __future__ import annotations

import statistics
import time
from contextlib import contextmanager
from typing import Iterator

import torch

from labkit.core.checks import non_negative_number
from labkit.core.devices import synchronize


class PhaseTimer:
    """Seconds per phase per step: ``with timer.phase("compute"): ...``, then :meth:`end_step`."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.steps: list[dict[str, float]] = []
        self.current: dict[str, float] = {}

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        synchronize(self.device)  # what was queued before belongs to the phase before
        t0 = time.perf_counter()
        try:
            yield
        finally:
            synchronize(self.device)
            self.current[name] = self.current.get(name, 0.0) + time.perf_counter() - t0

    def end_step(self) -> dict[str, float]:
        step, self.current = self.current, {}
        self.steps.append(step)
        return step

    def median(self, name: str, skip: int = 1) -> float:
        """The median seconds of phase ``name`` over the steps, the first ``skip`` left out (warm-up)."""
        values = [s.get(name, 0.0) for s in self.steps[skip:] or self.steps]
        return statistics.median(values) if values else 0.0


def find_stragglers(compute_s: list[float], wait_s: list[float], margin: float = 0.5) -> dict:
    """The ranks whose compute time exceeds the median of the *other* ranks' by more than ``margin``
    (0.5: half as long again), from each rank's median compute and wait seconds per step.

    Returns ``stragglers``, each rank's ``slowdown`` (compute over the others' median) and the rank
    that waited least (``least_wait``), which is the straggler when there is one."""
    non_negative_number("margin", margin)
    if len(compute_s) != len(wait_s) or len(compute_s) < 2:
        raise ValueError("find_stragglers needs compute and wait times of the same two or more ranks")
    slowdown = []
    for r, c in enumerate(compute_s):
        others = statistics.median(compute_s[:r] + compute_s[r + 1:])
        slowdown.append(c / others if others > 0 else float("inf"))
    return {"stragglers": [r for r, s in enumerate(slowdown) if s > 1 + margin], "slowdown": slowdown,
            "least_wait": min(range(len(wait_s)), key=wait_s.__getitem__)}


def medians(timings: list[list[dict[str, float]]], skip: int = 1) -> dict[str, list[float]]:
    """Per phase, each rank's median seconds per step (``timings[rank]`` is a :attr:`PhaseTimer.steps`),
    the first ``skip`` steps left out (warm-up)."""
    phases = sorted({k for rank in timings for step in rank for k in step})
    return {name: [statistics.median(s.get(name, 0.0) for s in (rank[skip:] or rank)) for rank in timings]
            for name in phases}
