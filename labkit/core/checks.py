"""Argument checks with one wording everywhere: the parameter's name, what it got, what would do.

Every public function of labkit checks its inputs with these before any work starts, so a bad
value is one ``ValueError`` line that names the parameter, and the command lines turn that line
into ``error: ...`` and exit status 2.
"""
from __future__ import annotations

import math
import numbers
import os
import stat
import tempfile
from pathlib import Path
from typing import Any, Iterable

# The largest count (parameters, tokens, widths, ranks) a model's shape may hold: 1e15 is past any
# model trained yet, and below where the calculators' float arithmetic would overflow.
MAX_COUNT = 10**15


def _whole(value: Any, accept_float: bool) -> bool:
    if isinstance(value, bool):
        return False
    if isinstance(value, numbers.Integral):  # int, and NumPy's integers
        return True
    return (accept_float and isinstance(value, numbers.Real) and math.isfinite(value)
            and value == int(value))


def positive_int(name: str, value: Any, accept_float: bool = False) -> int:
    """``value`` as an int when it is an integer >= 1, else ValueError. ``accept_float`` also takes
    an integral float (``1e9`` parameters, say)."""
    if not _whole(value, accept_float) or value < 1:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")
    return int(value)


def brief(value: Any) -> str:
    """A number as a message shows it: ``1e+30`` for a long one; an int past float's range (a
    400-digit flag) by its digits, where formatting it as a float would raise OverflowError."""
    if isinstance(value, numbers.Integral) and not isinstance(value, bool) and abs(value) >= 10**15:
        digits = len(str(abs(int(value))))
        return f"{str(value)[:4]}... ({digits} digits)" if digits > 300 else f"{float(value):.3g}"
    return f"{value:g}" if isinstance(value, float) else repr(value)


def positive_count(name: str, value: Any, accept_float: bool = False) -> int:
    """:func:`positive_int` for a count in a model's shape, at most :data:`MAX_COUNT`."""
    n = positive_int(name, value, accept_float)
    if n > MAX_COUNT:
        raise ValueError(f"{name} must be at most {MAX_COUNT:.0e}, got {brief(value)}")
    return n


def non_negative_int(name: str, value: Any, accept_float: bool = False) -> int:
    """``value`` as an int when it is an integer >= 0, else ValueError."""
    if not _whole(value, accept_float) or value < 0:
        raise ValueError(f"{name} must be a non-negative integer, got {value!r}")
    return int(value)


def positive_number(name: str, value: Any) -> float:
    """``value`` as a float when it is finite and > 0, else ValueError."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not (math.isfinite(value) and value > 0):
        raise ValueError(f"{name} must be a positive finite number, got {value!r}")
    return float(value)


def non_negative_number(name: str, value: Any) -> float:
    """``value`` as a float when it is finite and >= 0, else ValueError."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not (math.isfinite(value) and value >= 0):
        raise ValueError(f"{name} must be a non-negative finite number, got {value!r}")
    return float(value)


def at_most(name: str, value: float, top: float, why: str) -> float:
    """``value`` when it is at most ``top``, else a ValueError saying ``why`` a larger one is no use."""
    if value > top:
        raise ValueError(f"{name}={brief(value)} is too large ({why}); valid: up to {top:g}")
    return value


def fraction(name: str, value: Any, low_open: bool = False, high_open: bool = False) -> float:
    """``value`` as a float in [0, 1] (ends excluded as asked), else ValueError."""
    ok = (not isinstance(value, bool) and isinstance(value, numbers.Real) and math.isfinite(value)
          and (value > 0 if low_open else value >= 0) and (value < 1 if high_open else value <= 1))
    if not ok:
        interval = ("(" if low_open else "[") + "0, 1" + (")" if high_open else "]")
        raise ValueError(f"{name} must be in {interval}, got {value!r}")
    return float(value)


def one_of(name: str, value: Any, valid: Iterable[Any], kind: str = "values") -> Any:
    """``value`` when it is one of ``valid``, else "name=... is unknown; valid <kind>: [...]"."""
    valid = list(valid)
    if value not in valid:
        raise ValueError(f"{name}={value!r} is unknown; valid {kind}: {valid}")
    return value


def brief_path(path: Any) -> str:
    """A path as a message quotes it; a name too long for the filesystem by its first characters."""
    text = str(path)
    return repr(text) if len(text) <= 200 else repr(text[:60] + "...") + f" ({len(text)} characters)"


def existing_file(name: str, path: Any) -> bool:
    """Whether ``path`` is a regular file; a ValueError naming ``name`` where even asking fails (a
    name too long for the filesystem, a folder that may not be entered)."""
    try:
        return Path(path).is_file()
    except OSError as e:
        raise ValueError(f"{name}={brief_path(path)} cannot be looked at ({e.strerror or e})") from None


def output_file(name: str, path: Any) -> Path:
    """``path`` as a Path, or a ValueError naming ``name`` unless it is a regular file this process can
    create or append to: checked before the work that writes it (found at the end, a bad path loses
    the output). A file that did not exist is not left behind."""
    if path is None or str(path) == "":
        raise ValueError(f"{name}={str(path or '')!r} is empty (an unset variable?): give a path, or leave it out")
    path = Path(path)
    try:
        # One stat, not exists() then is_file(): another rank probing the same name may create and
        # remove it in between (a Slurm job's ranks refused their --metrics path so).
        try:
            st = path.stat()
        except FileNotFoundError:
            st = None
        if st is not None and not stat.S_ISREG(st.st_mode):
            raise ValueError(f"{name}={str(path)!r} is not a regular file (a directory or a device): pass a file path")
        existed = st is not None
        with open(path, "a"):
            pass
    except OSError as e:
        raise ValueError(f"{name}={brief_path(path)} cannot be written ({e.strerror or e}); pass another file "
                         "path") from None
    if not existed:
        path.unlink(missing_ok=True)  # another rank may have probed the same name at the same time
    return path


def output_dir(name: str, path: Any) -> Path:
    """``path`` as a Path, made if missing, or a ValueError naming ``name`` unless this process can
    create a file in it. The probe is a real file (``mkstemp``, a unique name: ranks in different
    containers share PIDs), not ``os.access``, which says yes to root on a read-only mount."""
    if path is None or str(path) == "":
        raise ValueError(f"{name}={str(path or '')!r} is empty (an unset variable?): give a folder")
    path = Path(path)
    try:
        if path.exists() and not path.is_dir():
            raise ValueError(f"{name}={brief_path(path)} is a file, not a folder: pass a folder for the outputs")
        path.mkdir(parents=True, exist_ok=True)
        fd, probe = tempfile.mkstemp(prefix=".probe-", dir=path)
        os.close(fd)
        os.unlink(probe)
    except OSError as e:
        raise ValueError(f"{name}={brief_path(path)} is not a writable directory ({e.strerror or e}); pass a path "
                         "where this process may create files") from None
    return path
