"""One writer per checkpoint directory: an exclusive lock held for as long as the writer lives.

Two writers on one directory replace each other's saves and delete each other's files in flight
(measured: a second ``Checkpointer`` removed the first one's ``.tmp-*`` directory, and retention
emptied a step that had just been published). :class:`DirectoryLock` takes ``flock(2)`` on
``DIR/.lock`` without waiting; the kernel releases it when the process dies, so a killed run never
leaves a stale lock behind. The file names its holder (host, pid, since when) for the error a second
writer gets. ``flock`` is per open file, so it refuses a second writer in the same process too; on NFS,
Linux maps it to a POSIX byte-range lock on the server, which still refuses writers on other hosts.

The lock goes with its holder: :meth:`release` (``Checkpointer.close``, or leaving a ``with`` block),
the lock object being garbage-collected (a dropped Checkpointer), or the process ending. A child
forked while it is held closes its copy at once, so an orphaned child never keeps a dead writer's
directory locked. A filesystem without ``flock`` (Lustre mounted without ``-o flock``) is named in
one line; ``LABKIT_CHECKPOINT_LOCK=0`` skips the lock where the user vouches for a single writer.
"""
from __future__ import annotations

import errno
import fcntl
import os
import socket
import time
import weakref
from pathlib import Path

from labkit.fault_tolerance.errors import CheckpointError

LOCK = ".lock"
_HELD: set[int] = set()  # descriptors of the locks this process holds, closed in forked children
NO_FLOCK = (errno.ENOSYS, errno.EOPNOTSUPP, errno.ENOLCK, errno.EINVAL)


def _close_in_child() -> None:
    for fd in list(_HELD):  # the parent's lock stays: flock is released when *all* copies are closed
        try:
            os.close(fd)
        except OSError:
            pass
    _HELD.clear()


os.register_at_fork(after_in_child=_close_in_child)


def lock_wanted() -> bool:
    """``LABKIT_CHECKPOINT_LOCK``: 1 (the default) or 0; a ValueError naming it otherwise."""
    value = os.environ.get("LABKIT_CHECKPOINT_LOCK", "1")
    if value not in ("0", "1"):
        raise ValueError(f"LABKIT_CHECKPOINT_LOCK={value!r} must be 1 (lock the checkpoint directory) or 0 (no "
                         "lock: only where exactly one writer can run)")
    return value == "1"


class Closing:
    """``with X(...) as x:`` for anything with ``close()``."""

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class DirectoryLock:
    """``flock`` on ``directory/.lock``; CheckpointError naming the holder when another writer has it."""

    def __init__(self, directory: Path) -> None:
        self.path = directory / LOCK
        # O_NOFOLLOW: a link planted as .lock would make us write where it points
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
        err: OSError | None = None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            err = e
        if err is not None and not isinstance(err, BlockingIOError):
            os.close(fd)
            if err.errno not in NO_FLOCK:
                raise err
            raise CheckpointError(f"the filesystem of {directory} does not support flock ({os.strerror(err.errno)}), "
                                  "which keeps a second writer out: mount it with flock (Lustre: -o flock), or set "
                                  "LABKIT_CHECKPOINT_LOCK=0 if only one writer can ever run") from None
        if err is not None:
            holder = os.pread(fd, 200, 0).decode(errors="replace").strip() or "another process"
            os.close(fd)
            mine = holder.startswith(f"pid {os.getpid()} on {socket.gethostname()} ")
            raise CheckpointError(f"checkpoint directory {directory} is in use by another writer ({holder}); "
                                  + ("this process holds it: close() its other Checkpointer first, or pass "
                                     "readonly=True to read" if mine else
                                     "one run writes a directory at a time: stop that run, or use another "
                                     "directory (a reader passes readonly=True)")) from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"pid {os.getpid()} on {socket.gethostname()} since {time.strftime('%Y-%m-%d %H:%M:%S')}"
                  .encode(), 0)
        self.fd: int | None = fd
        _HELD.add(fd)
        self._finalizer = weakref.finalize(self, _drop, fd)  # a dropped holder's lock goes with it

    def release(self) -> None:
        if self.fd is not None:
            self._finalizer()  # closing the file drops the lock
            self.fd = None


def _drop(fd: int) -> None:
    _HELD.discard(fd)
    os.close(fd)
