"""Runs of the composed layouts that tests/test_mesh.py holds against one process (spawned ranks import
them from here)."""
from __future__ import annotations

import torch

from labkit.core.model import GPTConfig
from labkit.train import TrainConfig, train


def runs(jobs: list[tuple[TrainConfig, GPTConfig]]) -> list[dict]:
    """Several runs of the loop in one launch, each with its own model; the big per-step lists that no
    test reads are dropped on the way back."""
    torch.set_num_threads(1)
    out = []
    for cfg, model in jobs:
        r = train(cfg, model)
        for rank in r["ranks"]:
            for key in ("comm_calls_per_step", "allreduce_calls_per_step", "step_timed_without_counter"):
                rank.pop(key, None)
        out.append(r)
    return out
