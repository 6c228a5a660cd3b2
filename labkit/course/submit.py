"""nbgrader's ``submit``, of whole notebooks only.

jupyter_server saves a notebook in place: ``atomic_writing`` (``jupyter_server/services/contents/
fileio.py``) copies the old file to ``.~name``, rewrites the notebook and then removes the copy.
nbgrader's submit copies the assignment's folder as it finds it (``nbgrader/exchange/default/
submit.py``). A Submit pressed during a save (an autosave, or a save on a busy server: one took
555 ms in this course's CI) files a notebook cut short, and the instructor's ``autograde`` then fails
on it. :class:`WholeSubmit` waits for a save under way to end, and checks that every notebook reads
whole, in the student's folder before the copy and in the exchange after it. A notebook cut short is
refused in one line that says what to do, and no partial submission is left in the exchange. So is
anything else that is not a notebook (``{}``, ``null``, JSON nested too deeply), and a FIFO or a
device under the folder, which the copy would wait on for ever.
"""
from __future__ import annotations

import os
import shutil
import stat
import time

import nbformat
from nbgrader.exchange.default.submit import ExchangeSubmit
from nbgrader.utils import find_all_notebooks
from traitlets import Float

from labkit.core.files import read_regular


def _graded(folder: str) -> list[str]:
    """The notebooks under ``folder`` a grader reads: none hidden or in a hidden folder (checkpoints,
    a save's backup)."""
    return [nb for nb in find_all_notebooks(folder) if not any(p.startswith(".") for p in nb.split(os.sep))]


def _whole(path: str) -> bool:
    """Whether ``path`` reads as a notebook. Anything else is data, not an error: a file cut short,
    ``{}``, ``[]``, ``null``, ``"cells": "x"`` (nbformat raises AttributeError, jsonschema's errors),
    JSON nested past the parser's recursion, a FIFO (never opened to wait), or a file gone."""
    try:
        nbformat.reads(read_regular(path).decode(), as_version=4)
    except Exception:  # noqa: BLE001 - whatever nbformat raises on a bad notebook means "not whole"
        return False
    return True


def _saving(path: str) -> bool:
    folder, name = os.path.split(path)
    return os.path.exists(os.path.join(folder, f".~{name}"))


class WholeSubmit(ExchangeSubmit):
    """Submit only notebooks that read whole; wait for a save under way first."""

    save_wait_s = Float(10.0, help="Seconds to wait for a save under way to end; a backup (.~name) "
                                   "still there after that is a crashed save's leftover").tag(config=True)

    def cut_short(self, folder: str, wait: bool = True) -> list[str]:
        """The notebooks under ``folder`` that do not read as notebooks, once the saves under way
        have ended (``wait``: up to ``save_wait_s``)."""
        notebooks = [os.path.join(folder, nb) for nb in _graded(folder)]
        if wait and any(map(_saving, notebooks)):
            self.log.info("Waiting for a save under way in %s to end", folder)
            deadline = time.monotonic() + self.save_wait_s
            while any(map(_saving, notebooks)) and time.monotonic() < deadline:
                time.sleep(0.1)
        return [os.path.relpath(path, folder) for path in notebooks if not _whole(path)]

    def special(self, folder: str) -> list[str]:
        """What under ``folder`` the copy could not take as a file: a FIFO (read, it waits for a writer
        for ever), a device, a socket, a link to one or to nowhere. Links to folders are not followed."""
        out = []
        for root, dirs, files in os.walk(folder):
            for name in files + [d for d in dirs if os.path.islink(os.path.join(root, d))]:
                path = os.path.join(root, name)
                try:
                    mode = os.stat(path).st_mode
                except OSError:  # a link loop, a dangling link
                    mode = 0
                if not (stat.S_ISREG(mode) or stat.S_ISDIR(mode)):
                    out.append(os.path.relpath(path, folder))
        return sorted(out)

    def do_copy(self, src: str, dest: str, log=None) -> None:
        odd = self.special(src)
        if odd:
            self.fail(f"Not submitted: {', '.join(odd)} is not a regular file (a FIFO, a device or a broken "
                      "link). Remove it, then submit again.")
        self._refuse(self.cut_short(src))
        super().do_copy(src, dest, log)
        bad = self.cut_short(dest, wait=False)  # a save that began during the copy
        if bad:  # this copy and the exchange's: the student's cache is copied second
            for copy in {dest, os.path.join(self.inbound_path, self.assignment_filename)}:
                shutil.rmtree(copy, ignore_errors=True)
            self._refuse(bad)

    def _refuse(self, bad: list[str]) -> None:
        if bad:
            self.fail(f"Not submitted: {', '.join(bad)} is not a whole notebook (was it being saved?). "
                      "Save it, then submit again.")
