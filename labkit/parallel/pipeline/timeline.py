"""Watching a pipeline: when each stage computed what, the bubble that leaves, and what it holds.

* :class:`Timeline` records the start and end of every forward (F) and backward (B) of every
  microbatch on one stage, relative to a common start (a barrier before the step).
* :func:`bubble_fraction` is the share of the step each stage sat idle, averaged over the stages;
  GPipe's analysis (Huang et al. 2019, section 2.2) and Megatron-LM's (Narayanan et al. 2021,
  section 2.2.1) give ``(p - 1) / (m + p - 1)`` for ``p`` stages and ``m`` microbatches of equal cost.
* :class:`ActivationMeter` counts the bytes autograd keeps for backward on a stage
  (``torch.autograd.graph.saved_tensors_hooks``; parameters excluded), live and at their peak:
  GPipe holds all ``m`` microbatches' activations before its first backward, 1F1B at most ``p``.
* :func:`plot_gantt` draws a step's timeline as a Gantt chart, one row per stage.
"""
from __future__ import annotations

import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Iterator

import torch

from labkit.core.checks import positive_int

if TYPE_CHECKING:
    from matplotlib.axes import Axes


def bubble_formula(p: int, m: int, v: int = 1) -> float:
    """Idle share of a step with ``p`` stages and ``m`` equal microbatches: (p-1)/(m+p-1); with ``v``
    interleaved chunks per rank the bubble shrinks ``v``-fold: (p-1)/(vm+p-1) (Narayanan et al. 2021)."""
    for name, x in (("p", p), ("m", m), ("v", v)):
        positive_int(name, x)
    return (p - 1) / (v * m + p - 1)


@dataclass
class Event:
    stage: int
    kind: str  # "F" (forward), "B" (backward, or its input gradient) or "W" (weight gradient)
    mb: int
    start: float  # seconds since the step began (the barrier)
    end: float
    saved_bytes: int = 0  # F: bytes this microbatch left for backward on this stage (with a meter)


class ActivationMeter:
    """Bytes of the tensors autograd saved for backward that are still alive, and their peak.

    Each saved tensor is wrapped in a small holder; when autograd frees it (after the backward that
    used it) the holder is collected and its bytes leave the count. Storages are counted once
    however many ops saved them; parameters of ``module`` are not activations and are skipped.
    """

    def __init__(self, module: torch.nn.Module | None = None) -> None:
        local = [p.to_local() if hasattr(p, "to_local") else p for p in (module.parameters() if module else [])]
        self.params = {p.untyped_storage().data_ptr() for p in local}  # a DTensor's: its shard's
        self._refs: dict[int, list[int]] = {}  # storage pointer -> [holders, bytes]
        self._lock = threading.Lock()  # the autograd engine frees saved tensors from its own thread
        self.live = 0
        self.peak = 0
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)

    def reset_peak(self) -> None:
        self.peak = self.live

    def _pack(self, t: torch.Tensor):
        if t.device.type == "meta":
            return t
        st = (t.to_local() if hasattr(t, "to_local") else t).untyped_storage()  # a DTensor: its local part
        key = st.data_ptr()
        if not key or key in self.params:
            return t
        with self._lock:
            entry = self._refs.setdefault(key, [0, st.nbytes()])
            if entry[0] == 0:
                self.live += entry[1]
                self.peak = max(self.peak, self.live)
            entry[0] += 1
        return _Held(self, t, key)

    @staticmethod
    def _unpack(x):
        return x.t if isinstance(x, _Held) else x

    def _release(self, key: int) -> None:
        with self._lock:
            entry = self._refs[key]
            entry[0] -= 1
            if entry[0] == 0:
                self.live -= entry[1]
                del self._refs[key]

    def __enter__(self) -> "ActivationMeter":
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        self._hooks.__exit__(*exc)


class _Held:
    __slots__ = ("meter", "t", "key")

    def __init__(self, meter: ActivationMeter, t: torch.Tensor, key: int) -> None:
        self.meter, self.t, self.key = meter, t, key

    def __del__(self) -> None:
        self.meter._release(self.key)


class Timeline:
    """F and B events of one stage, per step; ``start()`` at the common start of every step.

    On CUDA the kernels run asynchronously: each event is bracketed by CUDA events recorded on the
    stream (no synchronisation, which would serialise what the schedule overlaps) and the times are
    read once the step is over, in :meth:`finish`.
    """

    def __init__(self, stage: int, device: torch.device | None = None, meter: ActivationMeter | None = None) -> None:
        self.stage, self.meter = stage, meter
        self.cuda = device is not None and device.type == "cuda"
        self.steps: list[list[Event]] = []
        self.t0 = 0.0
        self._live_at_f = 0
        self._cuda_marks: list[tuple[Event, object, object]] = []
        self._cuda_t0 = None

    def start(self) -> None:
        self.t0 = time.perf_counter()
        self.steps.append([])
        if self.cuda:
            self._cuda_t0 = self._mark()
            self._cuda_marks = []
        if self.meter is not None:
            self.meter.reset_peak()

    @staticmethod
    def _mark():
        ev = torch.cuda.Event(enable_timing=True)
        ev.record()
        return ev

    def finish(self) -> None:
        """On CUDA, wait for the step's kernels once and turn the recorded marks into seconds."""
        if not self._cuda_marks:
            return
        torch.cuda.synchronize()
        for event, begin, end in self._cuda_marks:
            event.start = self._cuda_t0.elapsed_time(begin) / 1e3
            event.end = self._cuda_t0.elapsed_time(end) / 1e3
        self._cuda_marks = []

    @contextmanager
    def record(self, kind: str, mb: int) -> Iterator[None]:
        begin = self._mark() if self.cuda else None
        live = self.meter.live if self.meter is not None else 0
        events = self.steps[-1]
        if events and events[-1].kind == "F" and self.meter is not None:
            # A forward's saved bytes are counted up to the next event, not to its own end: the last
            # stage's loss is computed in between (by the schedule, outside the stage) and saves too.
            events[-1].saved_bytes = live - self._live_at_f
        self._live_at_f = live
        t = time.perf_counter() - self.t0
        yield
        events.append(Event(self.stage, kind, mb, t, time.perf_counter() - self.t0))
        if self.cuda:
            self._cuda_marks.append((events[-1], begin, self._mark()))


def bubble_fraction(events: list[Event]) -> float:
    """Idle share of one step, averaged over stages, from the events of every stage of that step.

    The step spans from the first event's start to the last event's end on any stage; a stage is
    busy while it computes a forward or backward and idle otherwise (waiting for a neighbour, or
    sending and receiving).
    """
    if not events:
        raise ValueError("bubble_fraction needs the events of at least one stage")
    span = max(e.end for e in events) - min(e.start for e in events)
    stages = sorted({e.stage for e in events})
    busy = {s: sum(e.end - e.start for e in events if e.stage == s) for s in stages}
    return sum(1 - busy[s] / span for s in stages) / len(stages)


def plot_gantt(ax: Axes, events: list[Event], title: str = "") -> None:
    """One row per stage (stage 0 on top): forwards blue, backwards (or, split, their input
    gradients) orange, weight gradients green; labelled by microbatch."""
    stages = sorted({e.stage for e in events})
    t0 = min(e.start for e in events)
    for e in events:
        y = len(stages) - 1 - stages.index(e.stage)
        color = {"F": "C0", "W": "C2"}.get(e.kind, "C1")
        ax.barh(y, (e.end - e.start) * 1e3, left=(e.start - t0) * 1e3, height=0.8, color=color,
                edgecolor="white", linewidth=0.5)
        ax.text((e.start - t0 + (e.end - e.start) / 2) * 1e3, y, str(e.mb), ha="center", va="center",
                fontsize=7, color="white")
    ax.set_yticks(range(len(stages)), [f"stage {s}" for s in reversed(stages)])
    ax.set_xlabel("ms since the step began")
    ax.set_title(title, fontsize=10)
