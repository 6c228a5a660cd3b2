"""Checkpoints that survive a kill at any instant: atomic publication, checksums, retention, async writes.

``Checkpointer(directory, keep_last=k, async_save=False)`` saves ``save(step, state)`` and returns
``load_latest() -> (step, state) | None``, in one process or on every rank of a process group.

* **Layout.** Tensors anywhere in ``state`` (DTensor shards included) go through
  ``torch.distributed.checkpoint`` (DCP): every rank writes its own shards, and a checkpoint saved on
  N ranks loads on M, or with no process group. Plain values, and ``state["local"]`` (this rank's own,
  such as RNG states) go to ``rank{r}.pt``; a DeepSpeed engine saves itself into the same directory.
* **Atomic publication** (write, fsync, ``rename(2)``; :mod:`.directory`): a kill leaves the old or the new.
* **Integrity.** The manifest holds a size and an xxHash (XXH3) per file and a checksum of its own
  (DCP, ``torch.save`` and safetensors store none); ``load_latest`` skips, warning, a failed checkpoint.
* **Safe loading.** Nothing is unpickled beyond data: ``rank{r}.pt`` loads with
  ``torch.load(weights_only=True)`` and DCP's pickled ``.metadata`` through an allow-list of DCP's
  metadata classes (DCP itself calls ``pickle.load`` on it), whose storage paths must name files of
  the manifest. A checkpoint holding a symbolic link, a FIFO or a file outside its directory is
  refused before anything in it is opened. The manifest's checksum finds damage, not tampering
  (:func:`labkit.fault_tolerance.directory.write_manifest` says what a signature would be).
* **One writer.** The writer holds an exclusive lock on the directory (:mod:`.lock`) and touches only
  names it writes; ``readonly=True`` opens a directory to load from while another run writes it, and
  on every rank loads the step rank 0 listed (ranks listing either side of a publish would differ).
* **Nothing lost.** A value that would save but never load (a NumPy scalar that is not exactly a
  Python one, an ``IntEnum``) is refused at save time, by key. When checkpoints exist and none
  verifies, ``load_latest`` raises with each step and why (``if_unusable="start_over"`` is the
  deliberate restart), and retention never deletes a checkpoint newer than the one just published.
* **Async save.** ``save`` blocks only while DCP's stager copies the tensors to host memory; writing,
  hashing and publishing run in a thread over a gloo group of their own (not the training group's).
"""
from __future__ import annotations

import io
import os
import shutil
import threading
import time
import warnings
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from labkit.core.checks import non_negative_int, one_of, output_dir, positive_int
from labkit.core.devices import side_group
from labkit.fault_tolerance import directory as ckdir
from labkit.fault_tolerance import loading
from labkit.fault_tolerance.directory import LATEST, MANIFEST  # noqa: F401 - part of this module's names
from labkit.fault_tolerance.files import (DEFAULT_HASH, HASHES, CheckpointError, check_loadable, describe,
                                          file_digest, free_space, fsync_tree, split, write_durably)
from labkit.fault_tolerance.loading import LOCAL, is_engine
from labkit.fault_tolerance.lock import Closing, DirectoryLock, lock_wanted
from labkit.fault_tolerance.step_log import LoadInfo, SaveStats

IF_UNUSABLE = ("raise", "start_over")


class Checkpointer(Closing):
    """Atomic, verified, retained checkpoints of a nested ``state`` dict; see the module docstring."""

    def __init__(self, directory: str | os.PathLike, keep_last: int = 2, async_save: bool = False,
                 hash: str | None = None, readonly: bool = False) -> None:
        positive_int("keep_last", keep_last)
        hash = hash or DEFAULT_HASH
        one_of("hash", hash, HASHES, "hashes")
        self.dir, self.keep_last, self.async_save, self.hash = Path(directory), keep_last, async_save, hash
        self.readonly, self.lock, want_lock = readonly, None, lock_wanted()
        if not readonly:
            output_dir("directory", self.dir)
        elif not self.dir.is_dir():
            raise ValueError(f"directory={str(directory)!r} is not a directory to read checkpoints from")
        self.dist = dist.is_available() and dist.is_initialized()
        self.rank, self.world = (dist.get_rank(), dist.get_world_size()) if self.dist else (0, 1)
        # Checkpoint collectives get their own gloo group: on the training group an async save's
        # collectives would interleave with the loop's (a hang; NOTES.md), and gloo moves CPU objects.
        self.pg = side_group() if self.dist else None
        err = None
        if self.rank == 0 and not readonly:
            try:  # one writer at a time; then what saves or deletions killed half-way left behind
                self.lock = DirectoryLock(self.dir) if want_lock else None
                for line in ckdir.recover_leftovers(self.dir):
                    warnings.warn(f"{self.dir}: {line}", stacklevel=2)
            except (OSError, CheckpointError) as e:
                err = e
        self._check_all(err, None)
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self.pending: SaveStats | None = None
        self.last_save: SaveStats | None = None
        self.last_load: LoadInfo | None = None
        self.last_skipped: list[tuple[int, str]] = []  # (step, why) of checkpoints the last load skipped

    # -- a collective over the checkpoint group (none in one process) --
    def _gather(self, obj: Any) -> list:
        out = [None] * self.world
        if self.dist:
            dist.all_gather_object(out, obj, group=self.pg)
        else:
            out = [obj]
        return out

    name = staticmethod(ckdir.step_name)

    def _listed(self) -> list[int]:  # newest first, as rank 0 lists them (the module's "One writer")
        return self._gather(list(reversed(self.steps())))[0]

    def steps(self) -> list[int]:
        """Published checkpoints, oldest first (whether they verify or not); a reader also sees a step
        whose re-save was interrupted (:func:`~.directory.readable_steps`)."""
        return (ckdir.readable_steps if self.readonly else ckdir.published_steps)(self.dir)

    def path(self, step: int) -> Path:
        """Where step ``step`` is read from: ``step_X``, or for a reader its ``.old-`` copy while away."""
        return ckdir.step_path(self.dir, step, self.readonly)

    # -- saving --
    def save(self, step: int, state: dict) -> SaveStats:
        """Checkpoint ``state`` as ``step``; a collective on every rank. Returns when it is published
        (sync) or, with ``async_save``, as soon as the tensors are copied to host memory."""
        non_negative_int("step", step)
        if self.readonly:
            raise ValueError(f"this Checkpointer of {self.dir} was opened with readonly=True: it cannot save")
        if not isinstance(state, dict):
            raise TypeError(f"state must be a dict, got {type(state).__name__}")
        self.wait()  # one save in flight at a time
        t0 = time.perf_counter()
        engine = {k: v for k, v in state.items() if is_engine(v)}
        tensors: dict = {}
        skeleton = split({k: v for k, v in state.items() if k != LOCAL and k not in engine}, (), tensors)
        buf = io.BytesIO()
        torch.save({"skeleton": skeleton, "local": split(state.get(LOCAL), (LOCAL,), None),
                    "engines": sorted(engine)}, buf)
        check_loadable(buf.getvalue())  # what the weights-only loader would refuse, refused now
        stats = SaveStats(step, str(self.dir / self.name(step)), 0.0)
        if self.async_save and not engine:
            writer = dcp.FileSystemWriter(self.dir / f".tmp-{self.name(step)}", sync_files=True)
            staged = writer.stage(tensors)  # DCP's stager: fresh host copies, so training may go on
            stats.blocking_s = time.perf_counter() - t0
            self.pending = stats
            self._thread = threading.Thread(target=self._write_async, args=(stats, staged, buf.getvalue(), t0),
                                            name="labkit-checkpoint", daemon=True)
            self._thread.start()
            return stats
        self._write(stats, tensors, buf.getvalue(), engine)
        stats.blocking_s = stats.total_s = time.perf_counter() - t0
        return stats

    def _write_async(self, stats: SaveStats, staged: dict, rank_file: bytes, t0: float) -> None:
        try:
            self._write(stats, staged, rank_file, {})
            stats.total_s = time.perf_counter() - t0
        except BaseException as e:  # noqa: BLE001 - re-raised by wait() in the training thread
            self._error = e

    def wait(self) -> SaveStats | None:
        """Block until an async save in flight is published; raise its error, if it failed."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        done, self.pending = self.pending, None
        if self._error is not None:
            err, self._error = self._error, None
            raise err
        return done

    def _write(self, stats: SaveStats, tensors: dict, rank_file: bytes, engines: dict) -> None:
        name = self.name(stats.step)
        tmp, final = self.dir / f".tmp-{name}", self.dir / name
        err = None
        try:
            if self.rank == 0:
                shutil.rmtree(tmp, ignore_errors=True)
                tmp.mkdir()
        except OSError as e:
            err = e
        self._check_all(err, stats.step)
        try:
            if tensors or not engines:
                dcp.save(tensors, storage_writer=dcp.FileSystemWriter(tmp, sync_files=True),
                         process_group=self.pg, no_dist=not self.dist)
            for key, eng in engines.items():  # collective inside DeepSpeed (its default group)
                eng.save_checkpoint(str(tmp / key), tag="ckpt", save_latest=False)
                fsync_tree(tmp / key)  # DeepSpeed's torch.save calls do not fsync
            write_durably(tmp / f"rank{self.rank}.pt", rank_file)
        except (Exception, dcp.CheckpointException) as e:  # noqa: BLE001 - every rank must learn of it
            err = e
        self._check_all(err, stats.step, tmp)
        # Every rank checksums a share of the files, in parallel; rank 0 publishes.
        t0 = time.perf_counter()
        files = sorted(str(p.relative_to(tmp)) for p in tmp.rglob("*") if p.is_file())
        mine = {f: [(tmp / f).stat().st_size, file_digest(tmp / f, self.hash)] for f in files[self.rank::self.world]}
        stats.hash_s = time.perf_counter() - t0
        entries = {k: v for share in self._gather(mine) for k, v in share.items()}
        stats.bytes = sum(v[0] for v in entries.values())
        err, after = None, None
        if self.rank == 0:
            try:
                after = ckdir.publish_step(self.dir, tmp, stats.step, self.world, self.hash, entries, self.keep_last)
            except OSError as e:
                err = e
        self._check_all(err, stats.step, tmp)
        if after:
            warnings.warn(f"step {stats.step} was published in {final}, but updating '{LATEST}' or retiring old "
                          f"checkpoints failed ({after}); loading does not need either", stacklevel=3)
        stats.done = True
        self.last_save = stats

    def _check_all(self, err: BaseException | None, step: int | None, tmp: Path | None = None) -> None:
        mine = None if err is None else (f"rank {self.rank}: {describe(err)}"
                                         + (free_space(self.dir) if step is not None else ""))
        errors = [e for e in self._gather(mine) if e is not None]
        if not errors:
            return
        if step is None:  # opening the directory
            raise CheckpointError("; ".join(errors))
        if self.rank == 0 and tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
        good = [s for s in self.steps() if s != step]
        raise CheckpointError(f"saving step {step} to {self.dir} failed ({'; '.join(errors)}); nothing was published"
                              + (f" and the previous checkpoint, step {good[-1]}, is intact" if good else ""))

    # -- loading --
    def manifest(self, step: int) -> dict:
        """The verified manifest of a published checkpoint; CheckpointError when it is damaged."""
        return ckdir.read_manifest(self.path(step))

    def verify(self, step: int) -> list[str]:
        """Problems found in checkpoint ``step`` (empty when every file matches its manifest)."""
        return loading.verify(self.path(step), self.rank, self.world, self._gather)

    def load_latest(self, template: dict | None = None, check: Callable[[dict], bool | None] | None = None,
                    if_unusable: str = "raise") -> tuple[int, dict] | None:
        """The newest checkpoint that verifies and loads safely, as ``(step, state)``; None if there is none.

        With ``template`` (a state like the one saved, e.g. from a freshly built model), tensors load in
        place into the template's tensors, resharded by DCP to this world size; a DeepSpeed engine in
        the template loads itself. Without it, every tensor loads whole on the CPU. ``check`` sees the
        plain values (tensors not yet read) and may raise to refuse a checkpoint of another run: a
        damaged checkpoint is skipped, a mismatched one is an error, not a reason to start over; it
        returns True when the run's layout differs from the saver's (each rank then reads what its
        template needs of every rank's part, and no rank's own values such as RNG states). When
        checkpoints exist and none is usable, a CheckpointError lists each and why; with
        ``if_unusable="start_over"`` None is returned instead (a deliberate restart from step 0).
        """
        one_of("if_unusable", if_unusable, IF_UNUSABLE, "choices")
        self.wait()
        t0 = time.perf_counter()
        skipped = self.last_skipped = []
        steps = self._listed()  # rank 0's listing, on every rank
        while steps:
            step, state = steps.pop(0), None
            path = Path(self._gather(str(self.path(step)))[0])  # a reader's may be the .old- copy
            try:
                problems = loading.verify(path, self.rank, self.world, self._gather)
                if not problems:
                    saved = loading.open_plain(path, self.rank, self.world, self._gather)
                    moved = bool(check(saved["skeleton"])) if check is not None else False
                    saved_world = ckdir.read_manifest(path)["world_size"]
                    state = self._read(step, path, saved, template, saved_world == self.world, moved)
            except (CheckpointError, dcp.CheckpointException, FileNotFoundError) as e:  # DCP's is a BaseException
                problems = [f"refused to load: {describe(e)}"]
            if problems and self.readonly and any(self._gather(not path.exists())) and len(skipped) < 100:
                damaged = {s for s, why in skipped if not why.startswith("retired")}
                steps = [s for s in self._listed() if s not in damaged]  # retired or re-saved: look again
                skipped.append((step, "retired by the writer while it was read"))
                continue
            if problems:
                skipped.append((step, "; ".join(problems)))
                warnings.warn(f"checkpoint {path} is unusable ({'; '.join(problems)}); "
                              "trying an older one", stacklevel=2)
                continue
            self.last_load = LoadInfo(step, str(path), saved_world, time.perf_counter() - t0, skipped)
            return step, state
        self.last_load = None
        if skipped and if_unusable == "raise":
            raise CheckpointError(f"{self.dir} holds {len(skipped)} checkpoint(s) and none is usable: "
                                  + "; ".join(f"step {s}: {why}" for s, why in skipped)
                                  + ". Nothing was deleted; to start over from step 0 deliberately, pass "
                                  "if_unusable='start_over' (labkit.train: --restart-if-unusable)")
        return None

    def _read(self, step: int, path: Path, saved: dict, template: dict | None, same_world: bool, moved: bool) -> dict:
        # every rank agrees on what it reads before any enters DCP's collective load
        planned = loading.agreed(lambda: loading.plan_read(path, step, saved, template, self.rank, same_world, moved),
                                 self.rank, self._gather)
        return loading.agreed(lambda: loading.read_planned(path, planned, saved["engines"], template, self.pg,
                                                           self.dist),
                              self.rank, self._gather)

    def close(self) -> None:
        """Finish an async save in flight; release the directory's lock and the checkpoint process group."""
        try:
            self.wait()
        finally:
            if self.lock is not None:
                self.lock.release()
            if self.pg is not None:
                dist.destroy_process_group(self.pg)
                self.pg = None

