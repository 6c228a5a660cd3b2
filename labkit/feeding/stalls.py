"""Input-pipeline stalls: how long each training step waits for data, and why "utilization" lies.

:func:`measure_stalls` wraps any iterable loader and a training step and times three phases of
every step: blocked in ``next(loader)`` (*wait*), the host-to-device copy (*copy*; CUDA events,
pinned or pageable; on CPU nothing is copied and it reports 0) and the step itself (*compute*,
synchronized on CUDA so queued kernels are not mistaken for finished ones). The input share of
step time, wait plus copy, is classified with the TensorFlow profiler's thresholds: under 5% not
input-bound, 5-20% moderately, 20% and over highly input-bound (``kModeratelyInfeedBoundThreshold...``
and ``kHighlyInfeedBoundThreshold...`` in tensorflow/core/profiler/convert/
op_stats_to_input_pipeline_analysis.cc, whose input time is "host wait input" + "host to device").

A utilization dashboard counts the device busy whenever a kernel runs (NVML's
``nvmlUtilization_t.gpu``, what nvidia-smi and ``torch.cuda.utilization`` show: "percent of time
over the past sample period during which one or more kernels was executing on the GPU"), so a
step spent on padding tokens, or spinning in an all-reduce while another rank waits for its data,
counts as busy. The report puts that busy share beside the throughput of useful (non-pad) tokens.

:func:`analytic_wait_fraction` is the steady state of a loader with known costs, the bound the
tests hold the measurement to. The workload datasets the lab starves and un-starves the model with
live in :mod:`labkit.feeding.workloads`; the background prefetcher that takes loading off the
critical path, in :mod:`labkit.feeding.prefetch`.
"""
from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import asdict, dataclass
from typing import Any

import torch

from labkit.core.checks import non_negative_int, one_of, positive_int
from labkit.core.devices import DEVICE_TYPES
from labkit.core import progress as progress_bars
from labkit.feeding.prefetch import batch_tensors, to_device

# TensorFlow profiler, op_stats_to_input_pipeline_analysis.cc: 5% and 20% of step time.
MODERATE, HIGH = 0.05, 0.20


@dataclass(frozen=True)
class StepRecord:
    """One step's phases, in seconds from the start of the measurement."""

    start: float
    wait: float  # blocked in next(loader)
    copy: float  # host-to-device copy (0 on CPU: nothing is copied)
    compute: float  # the training step, device synchronized
    end: float
    tokens: int  # every token the step computed on, pads included
    useful_tokens: int  # tokens that are not padding


@dataclass
class StallReport:
    """Per-step records and the steady-state shares derived from them (``warmup`` steps excluded)."""

    steps: list[StepRecord]
    warmup: int
    device: str
    pinned: bool | None  # were the host batches in pinned memory (None: nothing was copied)

    @property
    def steady(self) -> list[StepRecord]:
        return self.steps[self.warmup:]

    def _share(self, attr: str) -> float:
        """Sum of ``attr`` over the steady steps per second of their wall time."""
        return sum(getattr(r, attr) for r in self.steady) / self.elapsed_s

    @property
    def elapsed_s(self) -> float:
        # Steps run back to back, so the steady window is the sum of their wall times.
        return sum(r.end - r.start for r in self.steady)

    @property
    def wait_fraction(self) -> float:
        return self._share("wait")

    @property
    def median_wait_fraction(self) -> float:
        """The median over steady steps of each step's wait share: a typical step, robust to the
        few steps that another process on the machine delayed."""
        return float(statistics.median(r.wait / (r.end - r.start) for r in self.steady))

    @property
    def copy_fraction(self) -> float:
        return self._share("copy")

    @property
    def input_fraction(self) -> float:
        """What the TensorFlow profiler classifies: waiting for input plus host-to-device copy."""
        return self.wait_fraction + self.copy_fraction

    @property
    def busy_fraction(self) -> float:
        """What a utilization dashboard shows: the share of time the step (any kernel) runs."""
        return self._share("compute")

    @property
    def pad_fraction(self) -> float:
        tok = sum(r.tokens for r in self.steady)
        return 1 - sum(r.useful_tokens for r in self.steady) / tok if tok else 0.0

    @property
    def useful_busy_fraction(self) -> float:
        """Busy time spent on real tokens, if a step's cost is proportional to the tokens it holds."""
        return self.busy_fraction * (1 - self.pad_fraction)

    @property
    def step_s(self) -> float:
        return self.elapsed_s / len(self.steady)

    @property
    def tokens_per_s(self) -> float:
        return self._share("tokens")

    @property
    def useful_tokens_per_s(self) -> float:
        return self._share("useful_tokens")

    @property
    def classification(self) -> str:
        return classify(self.input_fraction)

    @property
    def diagnosis(self) -> str:
        return diagnose(self)

    def summary(self) -> dict:
        """The figures as a JSON-ready dict (per-step phases included, for timelines)."""
        keys = ("wait_fraction", "median_wait_fraction", "copy_fraction", "input_fraction",
                "busy_fraction", "pad_fraction", "useful_busy_fraction", "step_s", "tokens_per_s",
                "useful_tokens_per_s", "classification", "diagnosis", "elapsed_s")
        return {k: getattr(self, k) for k in keys} | dict(
            warmup=self.warmup, device=self.device, pinned=self.pinned, n_steps=len(self.steps),
            steps=[asdict(r) for r in self.steps])


def classify(input_fraction: float) -> str:
    """The TensorFlow profiler's verdict for an input share of step time."""
    if not 0.0 <= input_fraction <= 1.0 + 1e-9:
        raise ValueError(f"input_fraction must be in [0, 1], got {input_fraction!r}")
    # As TensorFlow's InputAnalysis: below 5% not, below 20% moderately, from 20% on highly.
    if input_fraction < MODERATE:
        return "not input-bound"
    return "moderately input-bound" if input_fraction < HIGH else "highly input-bound"


def diagnose(r: StallReport) -> str:
    """One line: the verdict and the next thing to try."""
    head = f"{r.input_fraction:.0%} of step time waiting for input: {r.classification}"
    if r.input_fraction < MODERATE:
        if r.pad_fraction > 0.2:
            return head + f"; but {r.pad_fraction:.0%} of the tokens computed are padding: pack or bucket sequences"
        return head + "; the step itself is the bottleneck"
    if r.copy_fraction > r.wait_fraction:
        fix = "pin host memory (pin_memory=True) and copy with non_blocking=True on a side stream"
    else:
        fix = ("add DataLoader workers, prefetch deeper, keep workers alive between epochs, "
               "or pre-tokenize to a memory-mapped file")
    return head + "; " + fix


def analytic_wait_fraction(load_s: float, compute_s: float, num_workers: int) -> float:
    """Steady-state share of step time spent waiting, for a loader of fixed cost per batch.

    With no workers the main process loads then computes: ``L / (L + C)``. With ``w`` workers
    (each with at least one batch of prefetch) they deliver a batch every ``L / w`` seconds, the
    step takes ``C``: the period is ``max(C, L/w)`` and the wait ``max(0, L/w - C)`` of it.
    """
    for name, v in (("load_s", load_s), ("compute_s", compute_s)):
        if not (isinstance(v, (int, float)) and math.isfinite(v) and v >= 0):
            raise ValueError(f"{name} must be a finite number of seconds >= 0, got {v!r}")
    non_negative_int("num_workers", num_workers)
    if load_s + compute_s == 0:
        raise ValueError("load_s and compute_s cannot both be 0: there is no step to share")
    if num_workers == 0:
        return load_s / (load_s + compute_s)
    per_batch = load_s / num_workers
    return max(0.0, per_batch - compute_s) / max(compute_s, per_batch)


def count_tokens(batch: Any, pad_id: int | None = None) -> tuple[int, int]:
    """``(tokens, useful tokens)`` of the first integer tensor in the batch (the input ids)."""
    ids = next((t for t in batch_tensors(batch) if not t.is_floating_point()), None)
    if ids is None:
        return 0, 0
    useful = ids.numel() if pad_id is None else int((ids != pad_id).sum())
    return ids.numel(), useful


def measure_stalls(
    loader: Iterable,
    step_fn: Callable[[Any], Any],
    steps: int | None = None,
    device: str | torch.device = "cpu",
    warmup: int = 1,
    pad_id: int | None = None,
    progress: bool | None = None,
    desc: str = "steps",
) -> StallReport:
    """Run ``step_fn(batch_on_device)`` over ``loader`` and time wait, copy and compute per step.

    ``steps=None`` runs until the loader is exhausted. The first ``warmup`` steps are recorded but
    left out of the shares: they pay one-off costs (worker start-up, the pipeline filling) that
    the steady state does not. ``pad_id`` marks padding in the input ids for the useful-token count.
    """
    if steps is not None:  # None: the whole loader
        positive_int("steps", steps)
    non_negative_int("warmup", warmup)
    if steps is not None and warmup >= steps:
        raise ValueError(f"warmup={warmup} leaves no steady steps out of steps={steps}; use warmup < steps")
    if not callable(step_fn):
        raise ValueError(f"step_fn must be callable (batch -> anything), got {type(step_fn).__name__}")
    if not isinstance(loader, Iterable):
        raise ValueError(f"loader must be iterable (a DataLoader, a generator...), got {type(loader).__name__}")
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError):
        dev = None
    one_of("device", dev.type if dev is not None else str(device), DEVICE_TYPES, "devices")
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError("device='cuda' but CUDA is not available; use device='cpu'")
    cuda = dev.type == "cuda"
    show = progress if progress is not None else progress_bars.wanted(steps)
    bar = progress_bars.bar(steps, desc, show)
    records: list[StepRecord] = []
    pinned: bool | None = None
    t_origin = time.perf_counter()
    # iter() starts a DataLoader's workers: their start-up is part of the first step's wait.
    it: Iterator = iter(loader)
    while steps is None or len(records) < steps:
        t0 = t_origin if not records else time.perf_counter()
        try:
            batch = next(it)
        except StopIteration:
            break
        t1 = time.perf_counter()
        if cuda:
            host = [t for t in batch_tensors(batch) if t.device.type == "cpu"]
            pinned = all(t.is_pinned() for t in host) if host else None
            # The GPU copies page-locked memory by DMA, asynchronously; pageable memory is first
            # staged by the driver through a pinned buffer, and the copy is synchronous (NVIDIA,
            # "How to Optimize Data Transfers in CUDA C/C++"). Events time the transfer on the device.
            ev0, ev1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            ev0.record()
            moved = to_device(batch, dev, non_blocking=bool(pinned))
            ev1.record()
            ev1.synchronize()
            copy_dev = ev0.elapsed_time(ev1) / 1e3
        else:
            moved, copy_dev = batch, 0.0  # CPU: the step reads the host batch; nothing moves
        t2 = time.perf_counter()
        step_fn(moved)
        if cuda:
            torch.cuda.synchronize(dev)  # a step is done when its kernels are, not when queued
        t3 = time.perf_counter()
        tokens, useful = count_tokens(batch, pad_id)
        copy = max(t2 - t1, copy_dev) if cuda else 0.0
        # The phases partition the step: whatever is neither waiting nor copying is the step's own
        # time (a rank descheduled between two clock reads still spent that time on this step).
        records.append(StepRecord(t0 - t_origin, t1 - t0, copy, t3 - t1 - copy, t3 - t_origin, tokens, useful))
        bar.update()
    bar.close()
    if steps is not None and len(records) < steps:
        raise ValueError(f"the loader yielded {len(records)} batches but steps={steps}; "
                         f"pass steps<={len(records)} or steps=None")
    if len(records) <= warmup:
        raise ValueError(f"the loader yielded {len(records)} batches, not more than warmup={warmup}; "
                         "use a longer loader or a smaller warmup")
    return StallReport(records, warmup, str(dev), pinned)
