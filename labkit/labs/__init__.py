"""Running the labs: profiles, the papermill lab runner, what a lab records, comparing runs.

* :mod:`labkit.labs.profiles`: every lab's ``cpu``, ``ci`` and ``gpu`` parameters.
* :mod:`labkit.labs.parameters`: a profile made concrete (:func:`resolve`), a ``gpu`` one fitted to N GPUs.
* :mod:`labkit.labs.runner`: execute a lab notebook under a profile (skipped when nothing changed).
* :mod:`labkit.labs.record`: a lab's numbers, glued for the book and written to its metrics file.
* :mod:`labkit.labs.compare`: a run's metrics against the recorded baselines.
* :mod:`labkit.labs.cli`: ``python -m labkit``.

The course around the labs (the JupyterHub, nbgrader's assignments and grading, the GPU node check)
is :mod:`labkit.course`, a layer above.
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
