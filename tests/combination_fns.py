"""Runs for tests/test_combinations.py (spawned ranks import them from here)."""
from __future__ import annotations

import torch

from labkit.train import train


def each(jobs: list) -> list[dict]:
    """Every ``(TrainConfig, GPTConfig)`` of ``jobs`` in turn on this launch's ranks: its losses, or the
    error it raised in one line (every rank raises the same, so the next run still starts together),
    so that one broken combination does not hide the others."""
    torch.set_num_threads(1)
    out = []
    for cfg, model in jobs:
        try:
            out.append({"loss": train(cfg, model)["loss"]})
        except Exception as e:  # noqa: BLE001 - the test names the combination and its error
            out.append({"error": f"{type(e).__name__}: {e}".splitlines()[0][:300]})
    return out


def groups_made(layouts: list[dict]) -> tuple[list[int], list[str]]:
    """Process groups this rank joined while each layout's mesh was built, and the warnings raised."""
    import warnings

    import torch.distributed as dist

    from labkit.parallel.layout.mesh import Degrees, ParallelDims

    made = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for degrees in layouts:
            before = len(dist.distributed_c10d._world.pg_map)
            ParallelDims(Degrees(**degrees))
            made.append(len(dist.distributed_c10d._world.pg_map) - before)
    return made, [f"{w.category.__name__}: {w.message}" for w in caught]
