"""A lab without matplotlib: its cells run and record their measurements, its figures are not drawn.

A GPU image may have CUDA torch and numpy and nothing else (no matplotlib, no IPython). Every lab
imports ``matplotlib.pyplot`` in its first cell; without it a lab run as a script stopped there, and
the GPU check reported a skip for every lab while no lab code had run on the GPU. :func:`install`
puts a stand-in for each display-only package (:data:`STAND_INS`, and any of their submodules) in
front of the import system, only where the real one is missing: every call on it does nothing and
returns another stand-in, and ``pyplot.subplots`` returns a figure and axes shaped as matplotlib
shapes them, so that a cell unpacks ``fig, (ax, ax2)`` or indexes ``axes[:, 0]`` as it would with
figures. A number is never made up: comparisons with a stand-in are false, and what a lab records
from one is left out of its metrics (not JSON), which say what was not drawn
(:func:`labkit.labs.record.environment`). pandas is not stood in for: labs compute with its tables.
"""
from __future__ import annotations

import importlib.abc
import importlib.machinery
import importlib.util
import sys
import types

# Packages a lab uses only to show things: matplotlib's figures, IPython's rich display of a recorded text
STAND_INS = ("matplotlib", "IPython")
WHY = "not drawn: matplotlib is not installed"


class Nothing:
    """Whatever a figure, an axis, a line or a formatter would be: every use does nothing."""

    def __getattr__(self, name: str) -> "Nothing":
        if name.startswith("__") and name.endswith("__"):
            raise AttributeError(name)  # copy, pickle and friends ask for protocols it does not have
        return self

    def __call__(self, *args, **kwargs) -> "Nothing":
        return self

    def __getitem__(self, key) -> "Nothing":
        return self

    def __iter__(self):  # ``line, = ax.plot(...)``: one line
        return iter((self,))

    def __len__(self) -> int:
        return 1

    def __enter__(self) -> "Nothing":
        return self

    def __exit__(self, *exc) -> None:
        return None

    def __format__(self, spec: str) -> str:
        return ""

    def __lt__(self, other) -> bool:  # where a figure's layout is decided (labkit.labs.plot_labels): never
        return False

    __le__ = __gt__ = __ge__ = __lt__

    def __repr__(self) -> str:
        return f"<figure {WHY}>"

    __add__ = __radd__ = __sub__ = __rsub__ = __mul__ = __rmul__ = __truediv__ = __rtruediv__ = __call__


NOTHING = Nothing()


def subplots(nrows: int = 1, ncols: int = 1, *, squeeze: bool = True, **kwargs):
    """``(figure, axes)`` with the axes in matplotlib's shape: one, a row, or a grid (numpy object arrays)."""
    import numpy as np

    axes = np.empty((nrows, ncols), dtype=object)
    axes.fill(NOTHING)
    if squeeze and nrows == ncols == 1:
        return NOTHING, NOTHING
    if squeeze and 1 in (nrows, ncols):  # as matplotlib squeezes: only the dimensions of one
        axes = axes.reshape(-1)
    return NOTHING, axes


class _Module(types.ModuleType):
    def __getattr__(self, name: str):
        if name.startswith("__") and name.endswith("__"):
            raise AttributeError(name)
        if name == "get_ipython":  # no kernel here: what IPython itself answers outside one
            return lambda: None
        return subplots if name == "subplots" else NOTHING


class _Finder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Serves each package of ``names`` and its submodules as a stand-in module."""

    def __init__(self, names: tuple[str, ...]) -> None:
        self.names = names

    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in self.names:
            return importlib.machinery.ModuleSpec(name, self, is_package=True)
        return None

    def create_module(self, spec):
        module = _Module(spec.name)
        module.__path__ = []  # a package: its submodules come from here too
        module.labkit_stand_in = True
        return module

    def exec_module(self, module) -> None:
        return None


def installed(package: str = "matplotlib") -> bool:
    """Whether ``package`` here is the stand-in."""
    return getattr(sys.modules.get(package), "labkit_stand_in", False) or any(
        isinstance(f, _Finder) and package in f.names for f in sys.meta_path)


def install() -> list[str]:
    """Put a stand-in in place of each package of :data:`STAND_INS` that is missing; the ones stood in."""
    if any(isinstance(f, _Finder) for f in sys.meta_path):
        return [p for p in STAND_INS if installed(p)]
    missing = []
    for package in STAND_INS:
        blocked = [n for n, m in sys.modules.items() if m is None and n.split(".")[0] == package]
        if blocked or importlib.util.find_spec(package) is None:
            for name in blocked:  # ``sys.modules["matplotlib"] = None``: how a test takes it away
                del sys.modules[name]
            missing.append(package)
    if missing:
        sys.meta_path.insert(0, _Finder(tuple(missing)))
    return missing
