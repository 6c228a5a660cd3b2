"""What a checkpoint costs: save (sync and async), restore and checksum throughput, measured.

``measure(model_cfg, directory)`` builds the GPT, takes one optimizer step (so Adam's moments exist,
as in any resume) and times :class:`labkit.fault_tolerance.Checkpointer` on that state: the time
the training loop is blocked and the time until the checkpoint is published, for synchronous and
asynchronous saves; a restore into a fresh model; and each checksum of ``HASHES`` over the files
written. The fastest of ``repeats`` is reported: what the disk and memory can do, least disturbed
by other processes.
"""
from __future__ import annotations

import os
import time
from pathlib import Path

import torch

from labkit.checkpoint_files import HASHES, file_digest
from labkit.fault_tolerance import Checkpointer
from labkit.model import GPTConfig, build_model
from labkit.resume import restore, training_state


def measure(model_cfg: GPTConfig, directory: str | os.PathLike, repeats: int = 3, device: str = "cpu") -> dict:
    """Sync/async save, restore and checksum figures for the training state of ``model_cfg``."""
    if not isinstance(repeats, int) or isinstance(repeats, bool) or repeats < 1:
        raise ValueError(f"repeats must be a positive integer, got {repeats!r}")
    directory, dev = Path(directory), torch.device(device)
    model = build_model(model_cfg).to(dev)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    x = torch.randint(0, model_cfg.vocab_size, (2, model_cfg.block_size), device=dev)
    model(x, x)[1].backward()
    opt.step()
    meta = {"strategy": "single", "world_size": 1, "seed": 0, "batch_size": 2, "model": model_cfg.to_dict()}
    bench = {}
    for mode in ("sync", "async"):
        ck = Checkpointer(directory / f"bench_{mode}", keep_last=1, async_save=mode == "async")
        rows = []
        for i in range(repeats):
            stats = ck.save(i + 1, training_state(i + 1, meta, [], model, opt))
            rows.append(ck.wait() or stats)  # async: training would run here while the thread writes
        bench[mode] = {k: min(getattr(s, k) for s in rows) for k in ("blocking_s", "total_s", "hash_s")}
        bench[mode]["bytes"] = rows[-1].bytes
    fresh = build_model(model_cfg).to(dev)
    fresh_opt = torch.optim.AdamW(fresh.parameters(), lr=1e-4)
    t0 = time.perf_counter()
    restore(Checkpointer(directory / "bench_sync"), meta, fresh, fresh_opt)
    restore_s = time.perf_counter() - t0
    identical = all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), fresh.state_dict().values()))
    files = [p for p in (directory / "bench_sync" / Checkpointer.name(repeats)).rglob("*") if p.is_file()]
    gb = sum(p.stat().st_size for p in files) / 1e9
    hash_gbps = {}
    for algo in HASHES:
        t0 = time.perf_counter()
        for p in files:
            file_digest(p, algo)
        hash_gbps[algo] = gb / (time.perf_counter() - t0)
    return {"bench": bench, "restore_s": restore_s, "restored_identical": identical, "state_gb": gb,
            "hash_gbps": hash_gbps, "write_gbps": gb / bench["sync"]["total_s"]}
