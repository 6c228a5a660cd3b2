"""Rank functions of the fault-tolerance tests (spawned ranks import them from this module)."""
from __future__ import annotations

import json
import os
import pickle
import zlib
from pathlib import Path

import torch.distributed as dist

from labkit.fault_tolerance.files import file_digest
from labkit.fault_tolerance import Checkpointer
from labkit.core.model import GPTConfig
from labkit.train import TrainConfig, train


class Payload:
    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def resign(ckpt_dir: Path, step: int) -> None:
    """Rewrite a manifest so it matches the files as they are now (what an attacker could do)."""
    ckpt = Checkpointer.__new__(Checkpointer)  # only the path helpers: no process group involved
    ckpt.dir, ckpt.readonly = Path(ckpt_dir), False
    path = ckpt.dir / Checkpointer.name(step)
    m = ckpt.manifest(step)
    for f in m["files"]:
        m["files"][f] = [(path / f).stat().st_size, file_digest(path / f, m["hash"])]
    body = json.dumps(m, sort_keys=True)
    (path / "manifest.json").write_bytes(f"{zlib.crc32(body.encode()):08x}\n{body}".encode())


def deepspeed_resume(strategy: str, ckpt_dir: str, marker: str) -> dict:
    """DeepSpeed behind the same Checkpointer: save at steps 2, 4 and 6; plant a pickle in step 6's
    optimizer file, and in step 4 move DeepSpeed's tag directory elsewhere, link it back and plant the
    pickle there (``Path.rglob`` does not enter a linked directory, DeepSpeed reads through it with
    ``weights_only=False``); rewrite both manifests; resume (6 and 4 refused, 2 used) and compare with
    an uninterrupted run; then resume with another weight decay (refused: the engine restores its own)."""
    model = GPTConfig(block_size=16, n_layer=1)
    base = dict(strategy=strategy, steps=6, lr_schedule="cosine", warmup_steps=1, return_params=True, keep_last=3)
    ref = train(TrainConfig(**base), model)
    train(TrainConfig(**base, checkpoint_dir=ckpt_dir, save_every=2), model)
    if dist.get_rank() == 0:
        victim = next((Path(ckpt_dir) / "step_00000006").rglob("*optim_states.pt"))
        victim.write_bytes(pickle.dumps(Payload(marker)))
        resign(Path(ckpt_dir), 6)
        tag = Path(ckpt_dir) / "step_00000004" / "engine" / "ckpt"
        moved = Path(ckpt_dir).parent / "moved_tag"
        tag.rename(moved)
        tag.symlink_to(moved, target_is_directory=True)
        next(moved.rglob("*optim_states.pt")).write_bytes(pickle.dumps(Payload(marker)))
        resign(Path(ckpt_dir), 4)
    dist.barrier()
    resumed = train(TrainConfig(**base, checkpoint_dir=ckpt_dir, save_every=2), model)
    same = all(ref["params"][k].equal(resumed["params"][k]) for k in ref["params"])
    try:  # the engine would load the saved weight decay over this one: refused before it loads
        train(TrainConfig(**base, checkpoint_dir=ckpt_dir, save_every=2, weight_decay=0.1), model)
        refused = ""
    except ValueError as e:
        refused = str(e)
    return {"start_step": resumed["start_step"], "notes": resumed["resume_notes"], "bit_exact": same,
            "loss_equal": ref["loss"] == resumed["loss"], "refused": refused}


def readers_load(ckpt_dir: str) -> int:
    """A reader on two ranks whose rank 0 listed the directory before the writer published its newest
    step and rank 1 after: both must load the same step (rank 0's view decides)."""
    reader = Checkpointer(ckpt_dir, readonly=True)
    if dist.get_rank() == 0:
        newest = max(reader.steps())
        listed = [s for s in reader.steps() if s != newest]
        reader.steps = lambda: listed
    step, _ = reader.load_latest()
    reader.close()
    return step
