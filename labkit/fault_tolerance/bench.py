"""What a checkpoint costs (save, restore, checksums), and what the popular shortcuts lose, measured.

``measure(model_cfg, directory)`` builds the GPT, takes one optimizer step (so Adam's moments exist,
as in any resume) and times :class:`labkit.fault_tolerance.Checkpointer` on that state: the time
the training loop is blocked and the time until the checkpoint is published, for synchronous and
asynchronous saves; a restore into a fresh model; and each checksum this machine computes (``available_hashes``) over the files
written. The fastest of ``repeats`` is reported: what the disk and memory can do, least disturbed
by other processes.

:func:`torn_single_file` and :func:`flipped_bit` test two shortcuts: one ``torch.save`` file
rewritten in place (what a kill mid-write leaves), and trusting the checkpoint format to notice a
flipped bit (``torch.save`` stores a CRC-32 per zip record and ``torch.load`` never checks it; DCP
stores none).
"""
from __future__ import annotations

import io
import os
import random
import subprocess
import sys
import time
import warnings
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp

from labkit.core.checks import positive_int
from labkit.core.model import GPTConfig, build_model
from labkit.fault_tolerance.checkpointer import Checkpointer
from labkit.fault_tolerance.files import available_hashes, file_digest
from labkit.fault_tolerance.resume import TrainState, restore, training_state


def measure(model_cfg: GPTConfig, directory: str | os.PathLike, repeats: int = 3, device: str = "cpu") -> dict:
    """Sync/async save, restore and checksum figures for the training state of ``model_cfg``."""
    positive_int("repeats", repeats)
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
            stats = ck.save(i + 1, training_state(i + 1, meta, [], TrainState(model, opt)))
            rows.append(ck.wait() or stats)  # async: training would run here while the thread writes
        bench[mode] = {k: min(getattr(s, k) for s in rows) for k in ("blocking_s", "total_s", "hash_s")}
        bench[mode]["bytes"] = rows[-1].bytes
        ck.close()
    fresh = build_model(model_cfg).to(dev)
    fresh_opt = torch.optim.AdamW(fresh.parameters(), lr=1e-4)
    t0 = time.perf_counter()
    restore(Checkpointer(directory / "bench_sync", readonly=True), meta, TrainState(fresh, fresh_opt))
    restore_s = time.perf_counter() - t0
    identical = all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), fresh.state_dict().values()))
    files = [p for p in (directory / "bench_sync" / Checkpointer.name(repeats)).rglob("*") if p.is_file()]
    gb = sum(p.stat().st_size for p in files) / 1e9
    hash_gbps = {}
    for algo in available_hashes():
        t0 = time.perf_counter()
        for p in files:
            file_digest(p, algo)
        hash_gbps[algo] = gb / (time.perf_counter() - t0)
    return {"bench": bench, "restore_s": restore_s, "restored_identical": identical, "state_gb": gb,
            "hash_gbps": hash_gbps, "write_gbps": gb / bench["sync"]["total_s"]}


def torn_single_file(path: str | os.PathLike, numel: int, trials: int, rng: random.Random) -> int:
    """How many of ``trials`` random instants leave an unloadable file, while another process rewrites
    one ``torch.save`` file of ``numel`` floats in a loop (as a naive training loop would). Copying the
    file at an instant is exactly what a kill at that instant would leave behind."""
    positive_int("numel", numel)
    positive_int("trials", trials)
    path = Path(path)
    writer = subprocess.Popen([sys.executable, "-c", (
        "import torch\n"
        f"state = {{'w': torch.randn({numel})}}\n"
        "while True:\n"
        f"    torch.save(state, {str(path)!r})\n")])
    try:
        while not path.exists() or path.stat().st_size < 4 * numel:
            time.sleep(0.05)
        torn = 0
        for _ in range(trials):
            time.sleep(rng.uniform(0.0, 0.05))
            try:
                torch.load(io.BytesIO(path.read_bytes()), weights_only=True)
            except Exception:  # truncated or half-written: nothing to resume from
                torn += 1
    finally:
        writer.kill()
        writer.wait()
    return torn


def torch_save_crc_unchecked(path: str | os.PathLike, numel: int = 1 << 12) -> dict:
    """``torch.save`` writes a zip archive, and zip stores a CRC-32 of every record; ``torch.load`` never
    checks it. One bit flipped in the tensor data: what ``torch.load`` returns, and what the zip's own
    check (``zipfile.ZipFile.testzip``) says of the same file."""
    import zipfile

    path = Path(path)
    w = torch.arange(numel, dtype=torch.float32)
    torch.save({"w": w}, path)
    with zipfile.ZipFile(path) as z:
        record = next(i for i in z.infolist() if i.filename.endswith("/data/0"))
    raw = bytearray(path.read_bytes())
    # the local header (30 bytes, then the name and an extra field of its own length) precedes the data
    name_len, extra_len = (int.from_bytes(raw[record.header_offset + k:record.header_offset + k + 2], "little")
                           for k in (26, 28))
    start = record.header_offset + 30 + name_len + extra_len
    raw[start + record.compress_size // 2] ^= 0x10  # one bit in the middle of the tensor bytes
    path.write_bytes(raw)
    back = torch.load(path, weights_only=True)["w"]
    with zipfile.ZipFile(path) as z:
        bad = z.testzip()
    return {"torch_load_values_changed": int((back != w).sum()), "zip_crc_names_the_record": bad}


def _flip_one_bit(directory: Path) -> None:
    data_file = next(directory.glob("*.distcp"))
    raw = bytearray(data_file.read_bytes())
    raw[len(raw) // 2] ^= 0x10  # one bit, in the middle of the tensor bytes
    data_file.write_bytes(raw)


def flipped_bit(directory: str | os.PathLike, numel: int = 1 << 16) -> dict:
    """One flipped bit in a checkpoint's tensor data: what plain ``dcp.load`` does (loads it), and what
    :class:`~labkit.fault_tolerance.checkpointer.Checkpointer` does (refuses it, falls back a step)."""
    directory = Path(directory)
    sd = {"w": torch.randn(numel)}
    dcp.save(sd, checkpoint_id=str(directory / "plain_dcp"), no_dist=True)
    _flip_one_bit(directory / "plain_dcp")
    back = {"w": torch.zeros(numel)}
    dcp.load(back, checkpoint_id=str(directory / "plain_dcp"), no_dist=True)  # no error
    ck = Checkpointer(directory / "checked", keep_last=2)
    ck.save(1, sd)
    ck.save(2, sd)
    _flip_one_bit(directory / "checked" / Checkpointer.name(2))
    problems = ck.verify(2)
    with warnings.catch_warnings(record=True):
        used = ck.load_latest()[0]
    ck.close()
    return {"dcp_values_changed": int((back["w"] != sd["w"]).sum()), "checkpointer_problems": problems,
            "checkpointer_loaded_step": used}
