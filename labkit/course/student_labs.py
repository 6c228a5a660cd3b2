"""The labs in their student form: the notebooks a hub puts in each student's home.

A committed lab is the instructor's version: its graded exercise holds the solution between
``### BEGIN SOLUTION`` and ``### END SOLUTION`` and hidden tests between ``### BEGIN HIDDEN TESTS``
and ``### END HIDDEN TESTS``. A student's copy runs nbgrader's own two preprocessors over the whole
lab (``ClearSolutions`` and ``ClearHiddenTests``, what ``nbgrader generate_assignment`` runs; nbgrader
docs, "Developing assignments"), drops the cells tagged ``book-only`` (the book's gated directives,
which frame the solution) and checks that no delimiter is left. Everything before the exercise is
unchanged, so the lab runs as in the book; the exercise cells answer ``YOUR CODE HERE``.

The one-machine hub (:mod:`labkit.course.hub`) and the Kubernetes image (``cluster/jupyterhub``) both
write them with ``python -m labkit.course.student_labs OUT``.
"""
from __future__ import annotations

import copy
import sys
from pathlib import Path

from labkit.core.cli import ArgumentParser
from labkit.course.assignments import BOOK_ONLY, KERNELSPEC
from labkit.labs.runner import LABS_DIR, list_labs

# What a student sees where a solution was; course/nbgrader_config.py gives nbgrader the same stubs.
CODE_STUB = "# YOUR CODE HERE\nraise NotImplementedError()"
TEXT_STUB = "YOUR ANSWER HERE"
# Nothing of these may reach a student.
DELIMITERS = ("BEGIN SOLUTION", "END SOLUTION", "BEGIN HIDDEN TESTS", "END HIDDEN TESTS")


def launch_url(hub: str, lab: str) -> str:
    """Where a lab's page in the book sends a student: the lab's student form in their home on the
    course's hub (JupyterHub's ``user-redirect`` finds the student's own server, starting it)."""
    return f"{hub.rstrip('/')}/hub/user-redirect/lab/tree/labs/{lab}.ipynb"


def student_notebook(lab: str, labs_dir: Path = LABS_DIR):
    """``labs/<lab>.md`` as a notebook without solutions, hidden tests or book-only cells."""
    import jupytext
    from nbgrader.preprocessors import ClearHiddenTests, ClearSolutions

    nb = jupytext.read(labs_dir / f"{lab}.md")
    nb.cells = [copy.deepcopy(c) for c in nb.cells if BOOK_ONLY not in c.metadata.get("tags", [])]
    resources = {"nbgrader": {"notebook": lab, "assignment": lab}}
    nb, _ = ClearSolutions(code_stub={"python": CODE_STUB}, text_stub=TEXT_STUB).preprocess(nb, resources)
    nb, _ = ClearHiddenTests().preprocess(nb, resources)
    left = [d for c in nb.cells for d in DELIMITERS if d in c.source]
    if left:
        raise ValueError(f"labs/{lab}.md: {left[0]!r} is left in its student form; a solution or hidden "
                         "test outside an nbgrader cell would reach students")
    nb.metadata["kernelspec"] = dict(KERNELSPEC)
    nb.metadata.pop("jupytext", None)  # a plain notebook in the student's home, not a paired file
    return nb


def write_student_labs(out: Path, labs: list[str] | None = None, labs_dir: Path = LABS_DIR) -> list[Path]:
    """Write ``out/<lab>.ipynb`` for each lab (default: all); return the paths."""
    import nbformat

    out.mkdir(parents=True, exist_ok=True)
    paths = []
    for lab in labs or list_labs(labs_dir):
        path = out / f"{lab}.ipynb"
        tmp = path.with_suffix(".tmp")
        nbformat.write(student_notebook(lab, labs_dir), tmp)
        tmp.replace(path)  # a server copying from here never sees half a notebook
        paths.append(path)
    return paths


def main(argv: list[str] | None = None) -> int:
    from labkit.core.checks import output_dir

    ap = ArgumentParser(prog="python -m labkit.course.student_labs", description=__doc__.splitlines()[0])
    ap.add_argument("out", help="folder to write <lab>.ipynb into")
    ap.add_argument("labs", nargs="*", help="lab names (default: all)")
    args = ap.parse_args(argv)
    try:
        unknown = sorted(set(args.labs) - set(list_labs()))
        if unknown:
            raise ValueError(f"no such lab(s) {unknown}; valid labs: {list_labs()}")
        out = output_dir("out", args.out)
    except ValueError as e:
        ap.error(str(e))
    for path in write_student_labs(out, args.labs or None):
        print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
