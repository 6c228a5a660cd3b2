"""A checkpoint directory on disk: published steps, manifests, atomic publication and retention.

Layout (one directory per run)::

    step_00000040/      a published checkpoint: DCP files, rank{r}.pt, manifest.json
    step_00000050/
    latest              the newest published step's name (for people and scripts; loading lists steps)
    .lock               held by the one writer (labkit.fault_tolerance.lock)
    .tmp-step_00000060/ a save in progress (never loaded)
    .old-step_00000050/ the previous copy of a step being saved again, until the new one is in place
    .trash-step_.../    a checkpoint being retired (never loaded)

Publication is write-then-rename (POSIX ``rename(2)`` is atomic within a filesystem): files are
written and fsynced under ``.tmp-*``, the manifest last, then the directory is renamed to
``step_*`` and the parent fsynced. A kill at any instant leaves the previous checkpoint or the new one.
Only names this module writes are ever read or deleted (``.tmp-build/`` is not a checkpoint's), a
checkpoint holds regular files and directories only (a symbolic link or a FIFO makes it unusable), and
the manifest is checked for its structure before it is believed. These functions touch only the
filesystem; :class:`labkit.fault_tolerance.Checkpointer` runs them on the right rank.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import stat
import time
import zlib
from pathlib import Path

from labkit.fault_tolerance.files import HASHES, CheckpointError, file_digest, fsync_dir, write_durably

MANIFEST, LATEST = "manifest.json", "latest"
FORMAT = 1  # the manifest's format: a loader refuses what it does not know
STEP = re.compile(r"step_([0-9]{8,})", re.ASCII)  # step_00000040: ASCII digits, at least 8, as step_name writes
LEFTOVER = re.compile(r"\.(tmp|old|trash)-(step_[0-9]{8,})", re.ASCII)


def step_name(step: int) -> str:
    return f"step_{step:08d}"


def _step_of(name: str) -> int | None:
    m = STEP.fullmatch(name)
    return int(m.group(1)) if m and step_name(int(m.group(1))) == name else None  # canonical names only


def published_steps(directory: Path) -> list[int]:
    """Published checkpoints, oldest first (whether they verify or not). Names that ``step_name`` would
    not write (``step_²``, a copied ``step_000010``) are not checkpoints of this directory."""
    steps = (_step_of(p.name) for p in directory.iterdir() if p.is_dir())
    return sorted(s for s in steps if s is not None)


def readable_steps(directory: Path) -> list[int]:
    """What a reader may load, oldest first: the published steps, and a step whose re-save was
    interrupted, whose only complete copy is ``.old-step_X`` until a writer puts it back."""
    old = (m.group(2) for m in (LEFTOVER.fullmatch(p.name) for p in directory.iterdir()
                                if p.is_dir() and not p.is_symlink()) if m is not None and m.group(1) == "old")
    return sorted(set(published_steps(directory)) | {s for s in map(_step_of, old) if s is not None})


def step_path(directory: Path, step: int, readonly: bool = False) -> Path:
    """Where step ``step`` is: ``step_X``; for a reader, its ``.old-`` copy while ``step_X`` is away."""
    final = directory / step_name(step)
    old = directory / f".old-{final.name}"
    return old if readonly and not final.exists() and old.is_dir() and not old.is_symlink() else final


def recover_leftovers(directory: Path) -> list[str]:
    """Tidy what a killed save or retirement left; what was done, one line each.

    A step saved again is set aside as ``.old-step_X`` while its new copy moves in: killed between the
    two renames, the old copy (published and complete) goes back. Half-written ``.tmp-*`` and
    half-deleted ``.trash-*`` directories are removed; a symbolic link under these names is removed
    as a link, never followed."""
    done = []
    for p in sorted(directory.iterdir()):
        m = LEFTOVER.fullmatch(p.name)
        if m is None:
            continue  # not a name this module writes: not ours to touch
        kind, name = m.groups()
        if kind == "old" and not (directory / name).exists() and not p.is_symlink():
            os.rename(p, directory / name)
            done.append(f"restored {name} from {p.name} (a save of the same step was interrupted)")
        elif p.is_symlink():
            p.unlink()
        else:
            shutil.rmtree(p, ignore_errors=True)
    if done:
        fsync_dir(directory)
    return done


def write_manifest(tmp: Path, step: int, world_size: int, hash: str, files: dict[str, list]) -> None:
    """The manifest: every file's size and checksum, and a CRC-32 of the manifest itself on line one.

    The CRC finds a torn or flipped manifest; it is no signature. Whoever can write the directory can
    rewrite a manifest to match altered files (a signature needs a key the writer of the files does
    not have: an HMAC with a secret outside the directory, or a public-key signature)."""
    body = json.dumps({"format": FORMAT, "step": step, "world_size": world_size, "hash": hash,
                       "files": dict(sorted(files.items())), "time": time.time()}, sort_keys=True)
    write_durably(tmp / MANIFEST, f"{zlib.crc32(body.encode()):08x}\n{body}".encode())


def _regular(path: Path) -> None:
    """Refuse anything but a regular file before opening it (a FIFO would block the reader forever)."""
    mode = os.lstat(path).st_mode
    if not stat.S_ISREG(mode):
        kind = "a symbolic link" if stat.S_ISLNK(mode) else "not a regular file"
        raise CheckpointError(f"{path.name} is {kind}")


def _check_structure(m: object, path: Path) -> dict:
    if not isinstance(m, dict):
        raise CheckpointError(f"{MANIFEST} of {path.name} is not a JSON object")
    if m.get("format") != FORMAT:
        raise CheckpointError(f"{MANIFEST} of {path.name} has format {m.get('format')!r}; this labkit reads "
                              f"format {FORMAT}")
    ok = (isinstance(m.get("step"), int) and m["step"] == _step_of(path.name.removeprefix(".old-"))
          and isinstance(m.get("world_size"), int) and m["world_size"] > 0 and m.get("hash") in HASHES
          and isinstance(m.get("files"), dict)
          and all(isinstance(f, str) and isinstance(v, list) and len(v) == 2 and isinstance(v[0], int)
                  and isinstance(v[1], str) for f, v in m["files"].items()))
    if not ok:
        raise CheckpointError(f"{MANIFEST} of {path.name} does not have the structure labkit writes (step, "
                              "world_size, hash and a size and checksum per file)")
    return m


def read_manifest(path: Path) -> dict:
    """The manifest of the checkpoint at ``path``; CheckpointError when it is damaged or malformed."""
    _regular(path / MANIFEST)
    raw = (path / MANIFEST).read_bytes()
    head, _, body = raw.partition(b"\n")
    if head != f"{zlib.crc32(body):08x}".encode():
        raise CheckpointError(f"{MANIFEST} of {path.name} fails its own checksum")
    try:
        m = json.loads(body)
    except ValueError as e:
        raise CheckpointError(f"{MANIFEST} of {path.name} is not JSON ({e})") from None
    return _check_structure(m, path)


def files_of(path: Path) -> tuple[list[str], list[str]]:
    """The regular files of a checkpoint directory, relative to it (the manifest left out), and what
    else is there: symbolic links, FIFOs, devices. Links are never followed."""
    files, odd = [], []
    for d, dirs, names in os.walk(path, followlinks=False):
        for n in dirs + names:
            p = Path(d) / n
            rel = str(p.relative_to(path))
            mode = os.lstat(p).st_mode
            if stat.S_ISLNK(mode):
                odd.append(f"{rel}: a symbolic link (a checkpoint holds plain files only)")
            elif stat.S_ISREG(mode):
                if rel != MANIFEST:
                    files.append(rel)
            elif not stat.S_ISDIR(mode):
                odd.append(f"{rel}: not a regular file")
    return sorted(files), odd


def tree_problems(path: Path) -> list[str]:
    """What makes the directory at ``path`` unsafe to read, before any file in it is opened."""
    if path.is_symlink():
        return [f"{path.name} is a symbolic link (a checkpoint directory must be the directory itself)"]
    _, odd = files_of(path)
    return odd


def check_files(path: Path, manifest: dict, names: list[str]) -> list[str]:
    """Problems of ``names`` (files of the checkpoint at ``path``) against the manifest: size, then checksum."""
    problems = []
    root = os.path.realpath(path)
    for f in names:
        real = os.path.realpath(path / f)
        if os.path.commonpath([root, real]) != root:
            problems.append(f"{f}: outside the checkpoint directory")
            continue
        size, digest = manifest["files"][f]
        if (path / f).stat().st_size != size:
            problems.append(f"{f}: {(path / f).stat().st_size} bytes, the manifest says {size}")
        elif file_digest(path / f, manifest["hash"]) != digest:
            problems.append(f"{f}: {manifest['hash']} checksum mismatch")
    return problems


def publish(directory: Path, tmp: Path, final: Path) -> None:
    """Make the complete checkpoint in ``tmp`` visible as ``final`` in one rename. A step saved again
    (after a restart) sets the old copy aside as ``.old-*`` first: :func:`recover_leftovers` puts it back
    if a kill lands between the renames."""
    fsync_dir(tmp)
    old = directory / f".old-{final.name}"
    if final.exists():
        os.rename(final, old)
    os.rename(tmp, final)  # the instant the checkpoint becomes visible, complete
    fsync_dir(directory)
    if old.exists():  # out of a reader's sight in one rename, then deleted (a reader re-lists)
        trash = directory / f".trash-{final.name}"
        shutil.rmtree(trash, ignore_errors=True)
        os.rename(old, trash)
        shutil.rmtree(trash, ignore_errors=True)


def point_latest(directory: Path, name: str) -> None:
    """Replace the ``latest`` pointer atomically (loading never needs it: it lists the steps)."""
    write_durably(directory / f".{LATEST}.tmp", name.encode())
    os.replace(directory / f".{LATEST}.tmp", directory / LATEST)
    fsync_dir(directory)


def publish_step(directory: Path, tmp: Path, step: int, world_size: int, hash: str, files: dict[str, list],
                 keep_last: int) -> str | None:
    """Manifest, publication, then the ``latest`` pointer and retention. An OSError means nothing was
    published; once published, a failure of the rest is returned as a line (it costs no checkpoint)."""
    write_manifest(tmp, step, world_size, hash, files)
    publish(directory, tmp, directory / step_name(step))
    try:
        point_latest(directory, step_name(step))
        retire(directory, step, keep_last)
    except OSError as e:
        return f"{type(e).__name__}: {e}"
    return None


def retire(directory: Path, keep_step: int, keep_last: int) -> None:
    """Retention, once ``keep_step`` is durable: keep it and the ``keep_last - 1`` newest older ones.

    Steps newer than ``keep_step`` are never deleted: they exist only when a run restarted over
    checkpoints that did not verify, and may still be salvaged by hand."""
    older = [s for s in published_steps(directory) if s < keep_step]
    for s in older[: max(0, len(older) - (keep_last - 1))]:
        trash = directory / f".trash-{step_name(s)}"
        os.rename(directory / step_name(s), trash)  # never a half-deleted step_* directory
        shutil.rmtree(trash, ignore_errors=True)
