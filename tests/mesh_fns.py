"""Runs of the composed layouts that tests/test_mesh.py holds against one process (spawned ranks import
them from here)."""
from __future__ import annotations

import shutil
import warnings
from pathlib import Path

import torch
import torch.distributed as dist

from labkit.train import train


def only_step(src: str, dst: str, step: int) -> None:
    """A copy of the checkpoint directory ``src`` as it was when ``step`` was its newest checkpoint."""
    src, dst = Path(src), Path(dst)
    shutil.copytree(src, dst, ignore=lambda d, names: [n for n in names if n.startswith("step_")
                                                       and n != f"step_{step:08d}"])
    (dst / "latest").write_text(f"step_{step:08d}")


def runs(jobs: list) -> list[dict]:
    """Several runs of the loop in one launch, each ``(TrainConfig, GPTConfig)`` with its own model, or a
    ``("copy", src, dst, step)`` of a checkpoint directory made by rank 0 between runs (so that a run can
    resume what an earlier one saved: the processes' warm caches make a second launch unnecessary). The
    big per-step lists no test reads are dropped on the way back."""
    torch.set_num_threads(1)
    out = []
    for job in jobs:
        if job[0] == "copy":
            if dist.get_rank() == 0:
                only_step(*job[1:])
            dist.barrier()
            continue
        cfg, model = job
        r = train(cfg, model)
        for rank in r["ranks"]:
            for key in ("comm_calls_per_step", "allreduce_calls_per_step", "step_timed_without_counter"):
                rank.pop(key, None)
        out.append(r)
    return out


def runs_warned(jobs: list) -> tuple[list[dict], list[str]]:
    """:func:`runs`, and every warning this rank raised meanwhile (each occurrence, not Python's first
    one per place only)."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = runs(jobs)
    return out, [f"{w.category.__name__}: {w.message}" for w in caught]
