"""Planted bug, fault_tolerance: temporary file and rename, but no fsync before the rename.

Survives a killed process (the page cache still holds the data) but not a power cut: the rename
can reach the disk before the data, leaving an empty or partial file under the final name.
"""
# -- grade_id: ft_atomic_write --
import os
import tempfile


def atomic_write(path, data):
    path = os.fspath(path)
    directory = os.path.dirname(os.path.abspath(path))
    fd, tmp = tempfile.mkstemp(dir=directory)
    with os.fdopen(fd, "wb") as f:
        f.write(data)
    os.replace(tmp, path)
    dir_fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)
