"""Learning-rate schedules: linear warmup (Goyal et al. 2017), then constant or cosine decay
(Loshchilov and Hutter 2017, SGDR without restarts), as ``torch.optim.lr_scheduler.LambdaLR``.

The scheduler's state is part of what a resume restores (:mod:`labkit.fault_tolerance.resume`): a cosine schedule
resumed at step 0 would warm up again.
"""
from __future__ import annotations

import math

import torch

LR_SCHEDULES = ("constant", "cosine")


def lr_factor(step: int, schedule: str, warmup_steps: int, total_steps: int, floor: float = 0.1) -> float:
    """Multiplier of the base lr at ``step``: warmup from 1/warmup_steps, then 1 or a cosine to ``floor``."""
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    if schedule == "constant":
        return 1.0
    progress = min(1.0, (step - warmup_steps) / max(1, total_steps - warmup_steps))
    return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * progress))


def lr_scheduler(optimizer: torch.optim.Optimizer, schedule: str = "constant", warmup_steps: int = 0,
                 total_steps: int = 1) -> torch.optim.lr_scheduler.LambdaLR | None:
    """The schedule as a LambdaLR, stepped once per optimizer step; None for a constant lr without warmup
    (no scheduler, so nothing changes for runs that do not ask for one)."""
    if schedule not in LR_SCHEDULES:
        raise ValueError(f"lr_schedule={schedule!r} is unknown; valid schedules: {list(LR_SCHEDULES)}")
    if schedule == "constant" and not warmup_steps:
        return None
    return torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda step: lr_factor(step, schedule, warmup_steps, total_steps))
