"""The course tooling: lab profiles, the papermill lab runner, graded exercises.

* :mod:`labkit.labs.profiles`: every lab's ``cpu``, ``ci`` and ``gpu`` parameters.
* :mod:`labkit.labs.parameters`: a profile made concrete (:func:`resolve`), a ``gpu`` one fitted to N GPUs.
* :mod:`labkit.labs.runner`: execute a lab notebook under a profile (skipped when nothing changed).
* :mod:`labkit.labs.assignments`: nbgrader assignments from the labs' exercise cells.
* :mod:`labkit.labs.grading`: what the autograder cells use to run a student's code.
* :mod:`labkit.labs.cli`: ``python -m labkit``.
"""
from labkit.labs.profiles import PROFILES
from labkit.labs.parameters import can_run, fit_to_gpus, require, resolve, train_flags
from labkit.labs.runner import LABS_DIR, OUT_DIR, ROOT, list_labs, run_lab

__all__ = ["LABS_DIR", "OUT_DIR", "PROFILES", "ROOT", "can_run", "fit_to_gpus", "list_labs", "main", "require",
           "resolve", "run_lab", "train_flags"]


def main(argv: list[str] | None = None) -> int:
    """``python -m labkit`` (:func:`labkit.labs.cli.main`)."""
    from labkit.labs.cli import main as cli_main

    return cli_main(argv)
