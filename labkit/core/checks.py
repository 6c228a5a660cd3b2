"""Argument checks with one wording everywhere: the parameter's name, what it got, what would do.

Every public function of labkit checks its inputs with these before any work starts, so a bad
value is one ``ValueError`` line that names the parameter, and the command lines turn that line
into ``error: ...`` and exit status 2.
"""
from __future__ import annotations

import math
import numbers
from typing import Any, Iterable


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
