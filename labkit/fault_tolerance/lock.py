"""One writer per checkpoint directory: an exclusive lock held for as long as the writer lives.

Two writers on one directory replace each other's saves and delete each other's files in flight
(measured: a second ``Checkpointer`` removed the first one's ``.tmp-*`` directory, and retention
emptied a step that had just been published). :class:`DirectoryLock` takes ``flock(2)`` on
``DIR/.lock`` without waiting; the kernel releases it when the process dies, so a killed run never
leaves a stale lock behind. The file names its holder (host, pid, since when) for the error a second
writer gets. ``flock`` is per open file, so it refuses a second writer in the same process too; on NFS,
Linux maps it to a POSIX byte-range lock on the server, which still refuses writers on other hosts.
"""
from __future__ import annotations

import fcntl
import os
import socket
import time
from pathlib import Path

from labkit.fault_tolerance.errors import CheckpointError

LOCK = ".lock"


class DirectoryLock:
    """``flock`` on ``directory/.lock``; CheckpointError naming the holder when another writer has it."""

    def __init__(self, directory: Path) -> None:
        self.path = directory / LOCK
        # O_NOFOLLOW: a link planted as .lock would make us write where it points
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
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

    def release(self) -> None:
        if self.fd is not None:
            os.close(self.fd)  # closing the file drops the lock
            self.fd = None
