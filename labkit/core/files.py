"""Small files other processes read while they are rewritten: settings, launch scripts, a port."""
from __future__ import annotations

import os
from pathlib import Path


def write_whole(path: Path, text: str, mode: int | None = None) -> None:
    """Write ``text`` to ``path`` through a file beside it and one rename (POSIX ``rename(2)`` is
    atomic): a process reading meanwhile sees the old file or the new one, never half of it, and a
    crash leaves the old one. The temporary name carries the pid, so two writers never share it."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}")
    tmp.write_text(text)
    if mode is not None:
        tmp.chmod(mode)
    os.replace(tmp, path)
