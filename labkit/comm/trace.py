"""Read a torch.profiler trace as two lanes, compute and communication, and measure what overlaps.

A trace (``prof.export_chrome_trace``, the Chrome trace-event format that Perfetto opens) holds
complete events (``"ph": "X"``, start ``ts`` and ``dur`` in microseconds). On a GPU, kernels are the
work: NCCL's kernels (``ncclDevKernel_*``, ``ncclKernel_*``) are communication, the others compute.
On the CPU with gloo, the collectives run on gloo's own threads and appear as ``gloo:<op>``
annotations, while the operators of the training thread are compute.

The *exposed* communication of a window is the time a collective runs while no compute does: the
part overlap did not hide, which a step pays for in full (the Ultra-Scale Playbook's "overlap"
sections; PyTorch's DDP notes on bucketing, Li et al. 2020).
"""
from __future__ import annotations

import json
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

Interval = tuple[float, float]  # start, end in microseconds

_COMM_KERNELS = ("nccl",)
_COMM_ANNOTATIONS = ("gloo:", "nccl:")
# Operators of the training thread that wait on or launch communication rather than compute
_NOT_COMPUTE = ("c10d::", "ProfilerStep", "labkit step", "record_param_comms", "Optimizer.")


@dataclass
class Lanes:
    compute: list[Interval] = field(default_factory=list)  # merged, sorted
    communication: list[tuple[float, float, str]] = field(default_factory=list)  # each collective, sorted
    device: str = "cpu"  # "cuda" when the trace has GPU kernels

    @property
    def start(self) -> float:
        points = [a for a, _ in self.compute] + [a for a, _, _ in self.communication]
        return min(points) if points else 0.0

    @property
    def end(self) -> float:
        points = [b for _, b in self.compute] + [b for _, b, _ in self.communication]
        return max(points) if points else 0.0


def merge(intervals: list[Interval]) -> list[Interval]:
    """The union of ``intervals`` as sorted, disjoint intervals (nested events fall inside parents)."""
    out: list[list[float]] = []
    for a, b in sorted(intervals):
        if out and a <= out[-1][1]:
            out[-1][1] = max(out[-1][1], b)
        else:
            out.append([a, b])
    return [(a, b) for a, b in out]


def length(intervals: list[Interval]) -> float:
    return sum(b - a for a, b in merge(intervals))


def subtract(intervals: list[Interval], cover: list[Interval]) -> list[Interval]:
    """The parts of ``intervals`` that no interval of ``cover`` covers."""
    cover = merge(cover)
    out = []
    for a, b in merge(intervals):
        cur = a
        for c, d in cover:
            if d <= cur or c >= b:
                continue
            if c > cur:
                out.append((cur, c))
            cur = max(cur, d)
            if cur >= b:
                break
        if cur < b:
            out.append((cur, b))
    return out


def load(path: str | Path) -> list[dict]:
    """The complete events of a trace file."""
    data = json.loads(Path(path).read_text())
    events = data["traceEvents"] if isinstance(data, dict) else data
    return [e for e in events if e.get("ph") == "X" and "dur" in e]


def lanes(events: list[dict]) -> Lanes:
    """Split a trace's events into compute and communication (see the module docstring)."""
    kernels = [e for e in events if e.get("cat") in ("kernel", "gpu_memcpy")]
    if kernels:
        comm = [e for e in kernels if e["name"].lower().startswith(_COMM_KERNELS)]
        work = [e for e in kernels if e not in comm and e.get("cat") == "kernel"]
        device = "cuda"
    else:
        comm = [e for e in events if e["name"].startswith(_COMM_ANNOTATIONS)]
        ops = [e for e in events if e.get("cat") == "cpu_op"]
        main = Counter(e.get("tid") for e in ops).most_common(1)[0][0] if ops else None
        work = [e for e in ops if e.get("tid") == main and not e["name"].startswith(_NOT_COMPUTE)]
        # The training thread blocked inside a c10d call (launching a collective, or waiting for one
        # at the end of backward) is not computing, though its parents' events span that time.
        blocked = [(e["ts"], e["ts"] + e["dur"]) for e in ops if e.get("tid") == main and e["name"].startswith("c10d::")]
        return Lanes(subtract([(e["ts"], e["ts"] + e["dur"]) for e in work], blocked),
                     sorted((e["ts"], e["ts"] + e["dur"], e["name"]) for e in comm), "cpu")
    return Lanes(merge([(e["ts"], e["ts"] + e["dur"]) for e in work]),
                 sorted((e["ts"], e["ts"] + e["dur"], e["name"]) for e in comm), device)


def exposed(l: Lanes) -> dict[str, float]:
    """Seconds of communication in total, hidden under compute, and exposed (not hidden)."""
    comm = [(a, b) for a, b, _ in l.communication]
    total = length(comm)
    bare = length(subtract(comm, l.compute))
    return {"communication_s": total / 1e6, "hidden_s": (total - bare) / 1e6, "exposed_s": bare / 1e6,
            "compute_s": length(l.compute) / 1e6, "window_s": (l.end - l.start) / 1e6}


def exposed_per_step(path: str | Path, steps: int) -> dict[str, float]:
    """:func:`exposed` of a trace of ``steps`` steps, per step."""
    return {k: v / steps for k, v in exposed(lanes(load(path))).items()}
