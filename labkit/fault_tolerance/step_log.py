"""A run's diary: one JSON line per step, checkpoint, restore and preemption, safe against SIGKILL;
and what each save and load reports."""
from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch.distributed as dist

from labkit.core.devices import env_int


class StepLog:
    """Append-only JSON lines (one per event) that survive a SIGKILL of the writer: rank 0 logs steps,
    checkpoints and restores; every rank logs its start (pid, restart count) so a fault injector can
    find it."""

    def __init__(self, path: str | os.PathLike | None) -> None:
        self.path = Path(path) if path else None
        self.rank = dist.get_rank() if dist.is_initialized() else 0
        self.restart = env_int("TORCHELASTIC_RESTART_COUNT", 0)
        if self.path:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self.event("start", all_ranks=True, pid=os.getpid())

    def event(self, kind: str, all_ranks: bool = False, **fields) -> None:
        if self.path is None or (self.rank != 0 and not all_ranks):
            return
        line = json.dumps({"event": kind, "rank": self.rank, "restart": self.restart, "time": time.time(), **fields})
        with open(self.path, "a") as f:  # one write of one line: appends from several ranks stay whole
            f.write(line + "\n")


@dataclass
class SaveStats:
    step: int
    path: str
    blocking_s: float  # how long save() held the training loop
    total_s: float | None = None  # snapshot to published (None while an async save is in flight)
    bytes: int = 0
    hash_s: float = 0.0  # checksumming this rank's share of the files
    done: bool = False


@dataclass
class LoadInfo:
    step: int
    path: str
    world_size: int
    seconds: float
    skipped: list[tuple[int, str]] = field(default_factory=list)  # (step, why) of newer unusable ones
