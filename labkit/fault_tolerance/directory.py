"""A checkpoint directory on disk: published steps, manifests, atomic publication and retention.

Layout (one directory per run)::

    step_00000040/      a published checkpoint: DCP files, rank{r}.pt, manifest.json
    step_00000050/
    latest              the newest published step's name (for people and scripts; loading lists steps)
    .tmp-step_00000060/ a save in progress (never loaded)
    .trash-step_.../    a checkpoint being retired (never loaded)

Publication is write-then-rename (POSIX ``rename(2)`` is atomic within a filesystem): files are
written and fsynced under ``.tmp-*``, the manifest last, then the directory is renamed to
``step_*`` and the parent fsynced. A kill at any instant leaves the previous checkpoint or the new one.
These functions touch only the filesystem; :class:`labkit.fault_tolerance.Checkpointer` runs them
on the right rank.
"""
from __future__ import annotations

import json
import os
import shutil
import time
import zlib
from pathlib import Path

from labkit.fault_tolerance.files import (
    CheckpointError,
    file_digest,
    fsync_dir,
    write_durably,
)

MANIFEST, LATEST = "manifest.json", "latest"
FORMAT = 1  # the manifest's format: a loader refuses what it does not know


def step_name(step: int) -> str:
    return f"step_{step:08d}"


def published_steps(directory: Path) -> list[int]:
    """Published checkpoints, oldest first (whether they verify or not)."""
    return sorted(int(p.name[5:]) for p in directory.glob("step_*") if p.is_dir() and p.name[5:].isdigit())


def clear_leftovers(directory: Path) -> None:
    """Remove what saves or retirements killed half-way left behind (never loaded, never needed)."""
    for pattern in (".tmp-*", ".trash-*"):
        for p in directory.glob(pattern):
            shutil.rmtree(p, ignore_errors=True)


def write_manifest(tmp: Path, step: int, world_size: int, hash: str, files: dict[str, list]) -> None:
    """The manifest: every file's size and checksum, and a CRC-32 of the manifest itself on line one."""
    body = json.dumps({"format": FORMAT, "step": step, "world_size": world_size, "hash": hash,
                       "files": dict(sorted(files.items())), "time": time.time()}, sort_keys=True)
    write_durably(tmp / MANIFEST, f"{zlib.crc32(body.encode()):08x}\n{body}".encode())


def read_manifest(path: Path) -> dict:
    """The manifest of the checkpoint at ``path``; CheckpointError when it is damaged."""
    raw = (path / MANIFEST).read_bytes()
    head, _, body = raw.partition(b"\n")
    if head != f"{zlib.crc32(body):08x}".encode():
        raise CheckpointError(f"{MANIFEST} of {path.name} fails its own checksum")
    return json.loads(body)


def files_of(path: Path) -> list[str]:
    """The files of a checkpoint directory, relative to it, the manifest left out."""
    return sorted(str(p.relative_to(path)) for p in path.rglob("*") if p.is_file() and p.name != MANIFEST)


def check_files(path: Path, manifest: dict, names: list[str]) -> list[str]:
    """Problems of ``names`` (files of the checkpoint at ``path``) against the manifest: size, then checksum."""
    problems = []
    for f in names:
        size, digest = manifest["files"][f]
        if (path / f).stat().st_size != size:
            problems.append(f"{f}: {(path / f).stat().st_size} bytes, the manifest says {size}")
        elif file_digest(path / f, manifest["hash"]) != digest:
            problems.append(f"{f}: {manifest['hash']} checksum mismatch")
    return problems


def publish(directory: Path, tmp: Path, final: Path) -> None:
    """Make the complete checkpoint in ``tmp`` visible as ``final`` in one rename, then point ``latest`` at it."""
    fsync_dir(tmp)
    if final.exists():  # the same step saved again after a restart: retire the old copy first
        os.rename(final, directory / f".trash-{final.name}")
    os.rename(tmp, final)  # the instant the checkpoint becomes visible, complete
    fsync_dir(directory)
    write_durably(directory / f".{LATEST}.tmp", final.name.encode())
    os.replace(directory / f".{LATEST}.tmp", directory / LATEST)
    fsync_dir(directory)


def retire(directory: Path, keep_step: int, keep_last: int) -> None:
    """Retention, after ``keep_step`` is durable: keep it and the ``keep_last - 1`` newest others."""
    others = [s for s in published_steps(directory) if s != keep_step]
    for s in others[: max(0, len(others) - (keep_last - 1))]:
        trash = directory / f".trash-{step_name(s)}"
        os.rename(directory / step_name(s), trash)  # never a half-deleted step_* directory
        shutil.rmtree(trash, ignore_errors=True)
    for p in directory.glob(".trash-*"):
        shutil.rmtree(p, ignore_errors=True)
