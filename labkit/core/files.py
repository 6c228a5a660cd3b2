"""Small files other processes read while they are rewritten (settings, launch scripts, a port), and
files read from folders anyone may have written to (a run's metrics, a student's notebooks)."""
from __future__ import annotations

import os
import stat
from pathlib import Path

from labkit.core.checks import brief_path

# What a name that is not a regular file turns out to be, for a message.
_KINDS = ((stat.S_ISDIR, "a folder"), (stat.S_ISFIFO, "a FIFO"), (stat.S_ISSOCK, "a socket"),
          (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"))


def _kind(mode: int) -> str:
    return next((name for test, name in _KINDS if test(mode)), "not a regular file")


def write_whole(path: Path, text: str | bytes, mode: int | None = None) -> None:
    """Write ``text`` to ``path`` through a file beside it and one rename (POSIX ``rename(2)`` is
    atomic): a process reading meanwhile sees the old file or the new one, never half of it, and a
    crash leaves the old one. The rename replaces a symbolic link at ``path`` rather than writing
    where it points, and the file beside it is made new (``O_EXCL | O_NOFOLLOW``), so nothing is
    written through a link someone planted. Its name carries the pid: two writers never share it."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}")
    tmp.unlink(missing_ok=True)  # a crashed write's leftover, or a planted link: removed, not followed
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o666)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(text.encode() if isinstance(text, str) else text)
        if mode is not None:
            tmp.chmod(mode)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def read_regular(path: Path) -> bytes:
    """The bytes of ``path`` when it is a regular file (a link to one too); a ValueError saying what
    it is otherwise. Never blocks: a FIFO opened for reading waits for a writer for ever, and a
    device may never end, so the name is looked at before it is opened, and what was opened is
    looked at again (``O_NONBLOCK``, ``fstat``) in case it was swapped in between."""
    try:
        before = os.stat(path)
        if not stat.S_ISREG(before.st_mode):
            raise ValueError(f"{brief_path(path)} is {_kind(before.st_mode)}, not a regular file")
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as e:  # a link loop, a dangling link, a name too long, no permission
        raise ValueError(f"{brief_path(path)} cannot be read ({e.strerror or e})") from None
    with os.fdopen(fd, "rb") as f:
        now = os.fstat(f.fileno())
        if not stat.S_ISREG(now.st_mode):
            raise ValueError(f"{brief_path(path)} is {_kind(now.st_mode)}, not a regular file")
        return f.read()
