"""Naming a lab's results for the book and for its metrics file, in one call.

The book cites every measured number through myst-nb's ``glue`` (a value stored in the executed
notebook under a name the chapter refers to), and the tests read the lab's metrics JSON. A lab calls
:func:`record` for each number, figure or table, or once for many as keywords: each value is glued
for the text (where myst-nb runs the notebook) and kept in :data:`GLUED`, and :func:`write_metrics`
writes every recorded plain value into the metrics file under ``"recorded"``, so that the text and
the file cannot disagree. Where myst-nb is not installed (a GPU image, a lab run as a plain script)
the lab runs unchanged.

Cells that only record are tagged ``remove-input`` in the labs: the book shows the code a reader
came to read, not the bookkeeping.
"""
from __future__ import annotations

import json
import math
import numbers
from pathlib import Path
from typing import Any

GLUED: dict[str, Any] = {}

try:
    from myst_nb import glue as _myst_glue
except ImportError:  # no myst-nb: record only
    _myst_glue = None


def glue(name: str, value: Any, display: bool = True) -> Any:
    """Store ``value`` under ``name`` for the book (myst-nb's ``glue``) and in :data:`GLUED`; return it.

    A NumPy scalar is glued as the Python number it holds: NumPy 2 writes its repr as
    ``np.float64(1.5)``, which the book's ``{glue:text}`key:.1f``` formats cannot read."""
    if type(value).__module__ == "numpy" and hasattr(value, "item") and getattr(value, "ndim", None) == 0:
        value = value.item()
    GLUED[name] = value
    if _myst_glue is not None:
        _myst_glue(name, value, display=display)
    return value


class Verbatim(str):
    """A string that a chapter pastes as a block of text, not as a Python literal: its ``repr`` (the
    text/plain that myst-nb pastes from another page, as a literal block) is the text itself, without
    quotes. For a command a lab ran, shown in the chapter exactly as run."""

    def __repr__(self) -> str:
        return str(self)


def sharp_figures() -> None:
    """Inside a notebook, show matplotlib figures (and glue them) as PNG at twice the pixels they are shown
    at ("retina"), so that a figure stays sharp on a high-density screen and when zoomed. Not SVG: a
    chapter pastes a lab's figure from the image file the lab's page wrote, and myst-nb pastes only PNG
    across pages (a lab page that rendered SVG would leave the chapter a broken image). Outside IPython (a
    lab run as a script) it does nothing."""
    try:
        from IPython import get_ipython
    except ImportError:
        return
    if get_ipython() is None:
        return
    from matplotlib_inline.backend_inline import set_matplotlib_formats

    set_matplotlib_formats("retina")


_NONE = object()


def record(name: str | None = None, value: Any = _NONE, /, **named: Any) -> Any:
    """Record ``value`` under ``name`` for the text (glued, not displayed) and the metrics file; return it.

    Many at once: ``record(zf_world=4, zf_steps=20)`` records each value under its keyword (in order)."""
    if (value is _NONE or bool(named)) if name is not None else (value is not _NONE or not named):
        raise TypeError("record(name, value) or record(name1=value1, ...): one value under one name, or "
                        "keywords")
    for key, v in named.items():
        glue(key, v, display=False)
    return None if name is None else glue(name, value, display=False)


_SKIP = object()  # what JSON cannot hold


def _plain(value: Any) -> Any:
    """``value`` as JSON holds it (a non-finite float as null), or ``_SKIP`` for what JSON cannot
    hold (figures, styled tables)."""
    if isinstance(value, bool) or value is None or isinstance(value, str):
        return value
    if isinstance(value, numbers.Integral):
        return int(value)
    if isinstance(value, numbers.Real):
        v = float(value)
        return v if math.isfinite(v) else None
    if isinstance(value, (list, tuple)):
        items = [_plain(v) for v in value]
        return _SKIP if any(i is _SKIP for i in items) else items
    if isinstance(value, dict) and all(isinstance(k, str) for k in value):
        items = {k: _plain(v) for k, v in value.items()}
        return _SKIP if any(i is _SKIP for i in items.values()) else items
    return _SKIP


def recorded() -> dict[str, Any]:
    """Every recorded value that JSON can hold (numbers, strings, lists and dicts of them), by name."""
    return {name: plain for name, plain in ((n, _plain(v)) for n, v in GLUED.items()) if plain is not _SKIP}


def cpu_isa() -> str | None:
    """The CPU's vector and matrix extensions that pick oneDNN's and MKL's kernels (AVX-512's parts, AMX),
    from ``/proc/cpuinfo``: two hosts torch calls both "AVX512" (with and without AMX) sum a seeded
    run's floats in other orders (seen: every lab's losses 1 ulp apart). None off Linux."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return None
    flags = next((line.split(":", 1)[1].split() for line in text.splitlines() if line.startswith("flags")), [])
    return " ".join(sorted(f for f in flags if f.startswith(("avx512", "amx", "avx2", "fma")))) or None


def environment() -> dict[str, Any]:
    """What a regression run compares besides the numbers (:mod:`labkit.labs.compare`): versions, and
    what makes the same program's floats differ in their last bits (instruction set, threads)."""
    import platform
    import sys

    import torch

    env = {"torch": torch.__version__, "python": platform.python_version(), "machine": platform.machine(),
           "cpu_capability": torch.backends.cpu.get_cpu_capability(), "cpu_isa": cpu_isa(),
           "threads": torch.get_num_threads()}
    if "deepspeed" in sys.modules:
        env["deepspeed"] = sys.modules["deepspeed"].__version__
    if torch.cuda.is_available():
        env["gpu"] = torch.cuda.get_device_name()
    from labkit.labs.script import LEFT_OUT

    if LEFT_OUT:  # a lab run as a script on a bare machine: its figures, an exercise's grading
        env["left_out"] = list(LEFT_OUT)
    return env


def write_metrics(path: str | Path, **fields: Any) -> Path:
    """Write the lab's metrics JSON: ``fields`` (profile, parameters, per-run figures...) and, under
    ``"recorded"``, every value the lab recorded for the text."""
    path = Path(path)
    fields.setdefault("environment", environment())
    for name, value in list(fields.items()):  # a lab's parameters (labkit.labs.parameters.Params)
        if callable(getattr(value, "unread", None)):
            fields["params_unread"] = value.unread()
            fields[name] = dict.copy(value)  # written as data, not counted as read
    path.write_text(json.dumps({**fields, "recorded": recorded()}, indent=1, default=str))
    print(f"wrote {path}")
    return path
