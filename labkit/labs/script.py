"""Run a lab without Jupyter: its code cells in order, in one namespace, the profile's parameters injected.

Where no Jupyter kernel, papermill or jupytext exists (many GPU images: CUDA PyTorch and little
else), ``python -m labkit run LAB --profile gpu --as-script`` still executes a lab: the MyST
notebook's ``{code-cell}`` blocks are read directly, the ``parameters`` cell runs first and then the
injected values (as papermill would), figures go to matplotlib's non-interactive backend (or, where
matplotlib is missing, are not drawn: :mod:`labkit.labs.no_plots`), and the lab writes its metrics
JSON as it does in a notebook. A package a lab needs and the machine lacks
stops it with one line that names the package.
"""
from __future__ import annotations

import os
import re
import sys
import time
from contextlib import contextmanager, redirect_stdout
from pathlib import Path
from typing import IO, Iterator

from labkit.labs import no_plots

CELL = re.compile(r"^```\{code-cell\}[^\n]*\n(.*?)^```[ \t]*$", re.S | re.M)


class LabSkipped(RuntimeError):
    """The lab needs a package this machine does not have."""


def missing(e: ModuleNotFoundError) -> str:
    """What a ModuleNotFoundError says this machine lacks: a package, or, where it names no module, the
    tools in its words (:func:`labkit.device.fusion.require_compiler`: a compiler, Python.h)."""
    said = str(e)
    if e.name and (not said or said.startswith(("No module named", "this lab needs"))):
        return f"the package {e.name!r}, which is not installed"
    return said or "a package that is not installed"


def cells(path: Path) -> list[tuple[str, set[str]]]:
    """The code cells of a MyST-markdown notebook: ``(source, tags)``, front matter removed."""
    out = []
    for m in CELL.finditer(path.read_text()):
        body, tags = m.group(1), set()
        if body.startswith("---\n"):  # YAML options: ---\n...\n---
            head, _, body = body[4:].partition("\n---\n")
            tags |= set(re.findall(r"[\w-]+", (re.search(r"tags:\s*\[([^\]]*)\]", head) or [None, ""])[1]))
        while body.startswith(":"):  # short options: ":tags: [parameters]"
            line, _, body = body.partition("\n")
            if line.startswith(":tags:"):
                tags |= set(re.findall(r"[\w-]+", line.split(":", 2)[2]))
        out.append((body, tags))
    return out


@contextmanager
def _in(directory: Path) -> Iterator[None]:
    cwd = os.getcwd()
    os.chdir(directory)
    try:
        yield
    finally:
        os.chdir(cwd)


class _Tee:
    """What the lab prints, to the terminal (unless ``quiet``) and to its log file."""

    def __init__(self, log: IO[str], quiet: bool) -> None:
        self.log, self.out = log, None if quiet else sys.stdout

    def write(self, text: str) -> int:
        self.log.write(text)
        if self.out is not None:
            self.out.write(text)
        return len(text)

    def flush(self) -> None:
        self.log.flush()
        if self.out is not None:
            self.out.flush()


def run_script(lab_path: Path, out_dir: Path, parameters: dict, quiet: bool = False) -> dict:
    """Execute the lab at ``lab_path`` in ``out_dir`` with ``parameters``; its namespace afterwards.

    What the lab prints also goes to ``out_dir/<lab>.log``; ``quiet`` keeps it off the terminal."""
    # Figures are drawn, never shown: for this run only (a Jupyter server this process starts later
    # would hand Agg to its kernels, whose inline figures would then never appear; seen in CI)
    backend = os.environ.get("MPLBACKEND")
    os.environ["MPLBACKEND"] = backend or "Agg"
    try:
        return _run(lab_path, out_dir, parameters, quiet)
    finally:
        if backend is None:
            os.environ.pop("MPLBACKEND", None)


# What this run left out and why, for the lab's metrics (labkit.labs.record.environment): figures
# without matplotlib, an exercise's grading without a package it needs.
LEFT_OUT: list[str] = []


def _run(lab_path: Path, out_dir: Path, parameters: dict, quiet: bool) -> dict:
    out_dir.mkdir(parents=True, exist_ok=True)
    ns: dict = {"__name__": f"labkit_lab_{lab_path.stem}"}
    injected = "\n".join(f"{k} = {v!r}" for k, v in parameters.items())
    t0 = time.perf_counter()
    with open(out_dir / f"{lab_path.stem}.log", "w") as log, redirect_stdout(_Tee(log, quiet)), _in(out_dir):
        stood_in = no_plots.install()  # a bare GPU image: the measurements still run (labkit.labs.no_plots)
        if "matplotlib" in stood_in:
            LEFT_OUT.append(f"figures: {no_plots.WHY}")
            print(f"[figures] {no_plots.WHY}: the lab's cells run and record their measurements, no figure "
                  "is drawn")
        grading_lacks = None
        for i, (source, tags) in enumerate(cells(lab_path)):
            if grading_lacks and "exercise" in tags:
                continue  # the rest of an exercise whose grading could not start
            grading_lacks = None
            try:
                exec(compile(source, f"{lab_path.name}, cell {i}", "exec"), ns)  # noqa: S102 - the lab's own code
                if "parameters" in tags:
                    exec(injected, ns)  # noqa: S102 - papermill's injected-parameters cell
            except ModuleNotFoundError as e:
                if (e.name or "").split(".")[0] == "labkit":
                    raise
                if "exercise" not in tags:
                    raise LabSkipped(f"lab {lab_path.stem!r} needs {missing(e)} (cell {i})") from None
                # An autograder cell (cloudpickle ships a notebook's function to ranks): no measurement
                # depends on it, so the lab goes on and says what it did not grade
                grading_lacks = missing(e)
                LEFT_OUT.append(f"exercise at cell {i}: not graded, needs {grading_lacks}")
                print(f"[exercise] cell {i} not graded here: needs {grading_lacks}")
            except Exception as e:  # noqa: BLE001 - one line naming the cell
                raise RuntimeError(f"lab {lab_path.stem!r} failed in cell {i} ({type(e).__name__}: {e})") from e
    ns["_seconds"] = time.perf_counter() - t0
    return ns
