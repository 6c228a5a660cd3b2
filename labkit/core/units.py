"""Sizes and durations in the unit that fits them: 72.0 GB, 2.5 MB, 3.2 s, 410 us.

Decimal units (GB = 10^9 bytes, as the ZeRO paper and the memory calculator count), so a toy model on
a 2.5 MB device reads "1.9 MB of 2.2 MB", not "0.0 GB of 0.0 GB".
"""
from __future__ import annotations

_SIZES = ((1e12, "TB"), (1e9, "GB"), (1e6, "MB"), (1e3, "KB"))
_TIMES = ((3600.0, "h"), (1.0, "s"), (1e-3, "ms"), (1e-6, "us"))


def size(n_bytes: float, digits: int = 1) -> str:
    """``n_bytes`` in the largest decimal unit that leaves at least 1 of it: ``"2.5 MB"``."""
    for scale, unit in _SIZES:
        if abs(n_bytes) >= scale:
            return f"{n_bytes / scale:,.{digits}f} {unit}"
    return f"{n_bytes:,.0f} B"


def duration(seconds: float, digits: int = 2) -> str:
    """``seconds`` in the largest unit that leaves at least 1 of it: ``"3.20 s"``, ``"410 us"``."""
    for scale, unit in _TIMES:
        if abs(seconds) >= scale:
            return f"{seconds / scale:,.{digits if scale >= 1 else 0}f} {unit}"
    return f"{seconds * 1e9:,.0f} ns"
