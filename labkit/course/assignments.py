"""Graded exercises: nbgrader assignments built from the exercise cells at the end of every lab.

Each lab ends with cells tagged ``exercise`` and marked up for nbgrader (nbgrader docs, "Developing
assignments with the assignment toolbar"): a *solution* cell holds the instructor's answer between
``### BEGIN SOLUTION`` and ``### END SOLUTION``; *autograder test* cells are locked, carry points,
and may hide tests between ``### BEGIN HIDDEN TESTS`` and ``### END HIDDEN TESTS``. The lab as
committed is therefore the instructor's version, and its exercises run, and pass, inside every
papermill run of the lab; they are self-contained and take seconds.

``python -m labkit.course.assignments`` (``make assignments``) copies those cells, behind a header that
names the lab, into nbgrader *source* notebooks ``course/source/<lab>/<lab>.ipynb`` and runs
``nbgrader generate_assignment`` into ``course/release/``: the student notebooks, solutions replaced
by stubs, hidden tests stripped. ``course/nbgrader_config.py`` makes ``course/`` a course directory
an instructor can use on JupyterHub as it is; ``book/instructors.md`` has the commands.

The book wraps the exercise in sphinx-exercise's gated directives (``exercise-start`` ...
``exercise-end``, ``solution-start`` ... ``solution-end``), in markdown cells tagged ``book-only``.
Jupyter would show those as raw MyST text, so they never reach an assignment: cells tagged
``book-only`` are dropped even when tagged ``exercise`` too, and an exercise cell that holds such a
directive is an error.
"""
from __future__ import annotations

import copy
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from labkit.core.checks import output_dir
from labkit.core.cli import ArgumentParser
from labkit.labs.runner import LABS_DIR, ROOT, list_labs

if TYPE_CHECKING:
    from nbformat import NotebookNode

COURSE_DIR = ROOT / "course"
TAG = "exercise"
# Cells for the book alone: the gated directives that frame the exercise and collapse its solution.
BOOK_ONLY = "book-only"
# The book collapses these cells; in a student's notebook the tag would only be noise.
DISPLAY_TAGS = {"hide-input", "hide-output", "hide-cell", "remove-input"}
# sphinx-exercise's directives, as a MyST fence opens them (``` or ~~~ or :::, any length).
_DIRECTIVE = re.compile(r"^\s*(`{3,}|~{3,}|:{3,})\s*\{(exercise|solution)(-start|-end)?\}", re.M)
# The course kernel (`make venv` and the hub image install it), which the labs name too.
KERNELSPEC = {"name": "labkit", "display_name": "Python (labkit)", "language": "python"}


def exercise_cells(lab: str, labs_dir: Path = LABS_DIR) -> list[NotebookNode]:
    """The lab's cells tagged ``exercise``, checked to make a gradable nbgrader assignment."""
    import jupytext

    src = labs_dir / f"{lab}.md"
    if not src.is_file():
        raise ValueError(f"lab={lab!r} does not exist; valid labs: {list_labs(labs_dir)}")
    cells = [c for c in jupytext.read(src).cells
             if TAG in c.metadata.get("tags", []) and BOOK_ONLY not in c.metadata.get("tags", [])]
    where = f"labs/{lab}.md" if labs_dir == LABS_DIR else str(src)
    if not cells:
        raise ValueError(f"{where} has no cells tagged {TAG!r}: every lab needs a graded exercise")
    for c in cells:  # in a student's notebook the directive would show as raw MyST source
        if c.cell_type == "markdown" and _DIRECTIVE.search(c.source):
            raise ValueError(f"{where}: a markdown cell tagged {TAG!r} holds a sphinx-exercise directive "
                             f"({c.source.strip()[:60]!r}); put it in a cell of its own, tagged {BOOK_ONLY!r}")
    meta = [c.metadata.get("nbgrader") for c in cells if c.cell_type == "code"]
    if any(m is None for m in meta):
        raise ValueError(f"{where}: every code cell tagged {TAG!r} needs nbgrader metadata "
                         "(a solution cell or an autograder test cell)")
    ids = [m["grade_id"] for m in meta]
    if len(set(ids)) != len(ids):
        raise ValueError(f"{where}: nbgrader grade_id values must be unique, got {ids}")
    if not any(m.get("solution") for m in meta):
        raise ValueError(f"{where}: the exercise has no solution cell (nbgrader solution: true)")
    if not any(m.get("grade") and m.get("points", 0) > 0 for m in meta):
        raise ValueError(f"{where}: the exercise has no autograder test cell with points")
    for c in cells:  # without markers nbgrader blanks the whole cell, signature and docstring included
        if c.cell_type == "code" and c.metadata["nbgrader"].get("solution") and "### BEGIN SOLUTION" not in c.source:
            raise ValueError(f"{where}: solution cell {c.metadata['nbgrader']['grade_id']!r} has no "
                             "### BEGIN SOLUTION / ### END SOLUTION region")
    return cells


def lab_title(lab: str, labs_dir: Path = LABS_DIR) -> str:
    """The lab's first-level heading without the "Lab: " prefix."""
    for line in (labs_dir / f"{lab}.md").read_text().splitlines():
        if line.startswith("# "):
            return line[2:].removeprefix("Lab: ").strip()
    return lab


def source_notebook(lab: str, labs_dir: Path = LABS_DIR) -> NotebookNode:
    """The nbgrader source notebook of ``lab``: a header cell, then the lab's exercise cells."""
    import nbformat

    cells = [copy.deepcopy(c) for c in exercise_cells(lab, labs_dir)]
    for c in cells:
        c.metadata["tags"] = [t for t in c.metadata.get("tags", []) if t not in DISPLAY_TAGS]
        if c.cell_type == "code":
            c.outputs, c.execution_count = [], None
    points = sum(c.metadata["nbgrader"].get("points", 0) for c in cells if c.cell_type == "code")
    header = nbformat.v4.new_markdown_cell(
        f"# Graded exercise: {lab_title(lab, labs_dir)}\n\n"
        f"From the lab `labs/{lab}.md` of *Training at Scale* "
        f"([open it](../training-at-scale/labs/{lab}.md) where nbgitpuller put the course, or read "
        f"the lab's page in the book); work through the lab first. Fill in every cell that says "
        f"`YOUR CODE HERE` and run the tests under it. The autograder re-runs them, and hidden "
        f"tests with inputs you have not seen, for {points:g} points in all.")
    nb = nbformat.v4.new_notebook(cells=[header, *cells])
    nb.metadata["kernelspec"] = dict(KERNELSPEC)
    nb.metadata["language_info"] = {"name": "python"}
    return nb


def write_sources(labs: list[str] | None = None, course_dir: Path = COURSE_DIR,
                  labs_dir: Path = LABS_DIR) -> list[Path]:
    """Write ``course_dir/source/<lab>/<lab>.ipynb`` for each lab (default: all); return the paths."""
    import nbformat

    paths = []
    for lab in labs or list_labs(labs_dir):
        nb = source_notebook(lab, labs_dir)
        path = course_dir / "source" / lab / f"{lab}.ipynb"
        path.parent.mkdir(parents=True, exist_ok=True)
        nbformat.write(nb, path)
        paths.append(path)
    return paths


def nbgrader(course_dir: Path, *args: str, timeout: float = 1800.0) -> str:
    """Run ``nbgrader ARGS`` in ``course_dir`` (its ``nbgrader_config.py`` applies); return the log.

    The venv's ``bin`` goes first on PATH: nbgrader runs ``alembic`` from there to set up its
    gradebook, and a bare ``.venv/bin/python`` does not put it on PATH.
    """
    if not (Path(course_dir) / "nbgrader_config.py").is_file():
        raise ValueError(f"course_dir={str(course_dir)!r} has no nbgrader_config.py; use {COURSE_DIR}")
    env = {**os.environ, "PATH": os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")])}
    proc = subprocess.run([sys.executable, "-m", "nbgrader", *args], cwd=course_dir, env=env,
                          capture_output=True, text=True, timeout=timeout)
    log = proc.stdout + proc.stderr
    if proc.returncode != 0:
        # nbgrader names the failed submission at the end and prints its traceback where it happened
        lines = log.splitlines()
        first = next((i for i, ln in enumerate(lines) if "Traceback" in ln or "| ERROR]" in ln), len(lines))
        cause = "\n".join(lines[first:first + 60])
        raise RuntimeError(f"nbgrader {' '.join(args)} failed (exit {proc.returncode}):\n{cause}\n...\n{log[-1500:]}")
    return log


def generate(labs: list[str] | None = None, course_dir: Path = COURSE_DIR, labs_dir: Path = LABS_DIR) -> list[Path]:
    """Source notebooks for ``labs``, then the student versions in ``course_dir/release``."""
    labs = labs or list_labs(labs_dir)
    write_sources(labs, course_dir, labs_dir)
    sources = {p.name for p in (course_dir / "source").iterdir() if p.is_dir()}
    # One nbgrader process for all: its start-up and gradebook check cost seconds each. "*" would
    # also release any other assignment found in source/, so then go lab by lab.
    for pattern in (["*"] if sources == set(labs) else labs):
        nbgrader(course_dir, "generate_assignment", pattern, "--force")
    released = [course_dir / "release" / lab / f"{lab}.ipynb" for lab in labs]
    missing = [str(p) for p in released if not p.is_file()]
    if missing:
        raise RuntimeError(f"nbgrader generate_assignment wrote no student notebook for {missing}")
    return released


def main(argv: list[str] | None = None) -> int:
    ap = ArgumentParser(prog="python -m labkit.course.assignments", description=__doc__.splitlines()[0])
    ap.add_argument("labs", nargs="*", help="lab names (default: all)")
    ap.add_argument("--course", default=str(COURSE_DIR), help="the nbgrader course directory")
    ap.add_argument("--source-only", action="store_true", help="write the source notebooks, skip nbgrader")
    args = ap.parse_args(argv)
    try:  # what was asked for, before anything is written
        labs = args.labs or list_labs()
        unknown = sorted(set(labs) - set(list_labs()))
        if unknown:
            raise ValueError(f"no such lab(s) {unknown}; valid labs: {list_labs()}")
        args.course = output_dir("--course", args.course)
    except ValueError as e:
        ap.error(str(e))
    try:
        if args.source_only:
            paths = write_sources(labs, args.course)
        else:
            paths = generate(labs, args.course)
    except (ValueError, RuntimeError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    for lab, path in zip(labs, paths):
        cells = source_notebook(lab).cells
        points = sum(c.metadata["nbgrader"].get("points", 0) for c in cells if c.cell_type == "code")
        print(f"{lab:26} {points:4g} points  {os.path.relpath(path)}")
    print(f"course directory: {args.course} (its nbgrader_config.py applies; see book/instructors.md)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
