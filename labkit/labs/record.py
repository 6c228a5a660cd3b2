"""Naming a lab's results for the book: ``glue`` where myst-nb runs the notebook, a plain record elsewhere.

The book cites every measured number through myst-nb's ``glue`` (a value stored in the executed
notebook under a name the chapter refers to). Where myst-nb is not installed (a GPU image, a lab run
as a plain script), :func:`glue` keeps the values in :data:`GLUED` instead, so the lab runs unchanged.
"""
from __future__ import annotations

from typing import Any

GLUED: dict[str, Any] = {}

try:
    from myst_nb import glue as _myst_glue
except ImportError:  # no myst-nb: record only
    _myst_glue = None


def glue(name: str, value: Any, display: bool = True) -> Any:
    """Store ``value`` under ``name`` for the book (myst-nb's ``glue``) and in :data:`GLUED`; return it."""
    GLUED[name] = value
    if _myst_glue is not None:
        _myst_glue(name, value, display=display)
    return value
