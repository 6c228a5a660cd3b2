"""The course's nbgrader submit (``labkit/course/submit.py``) files whole notebooks only.

Each case runs ``nbgrader submit`` as a student would, in a fresh interpreter (nbgrader imports
setuptools, which fails where the standard library's distutils was imported first), against an
exchange of its own, with the settings the hub and the image give every server.
"""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import nbformat
import pytest

LAB = "memory"


@pytest.fixture
def course(tmp_path) -> dict:
    exchange, home = tmp_path / "exchange", tmp_path / "home"
    release = exchange / "c" / "outbound" / LAB
    release.mkdir(parents=True)
    (exchange / "c" / "inbound").mkdir()
    exchange.chmod(0o1777)
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell("answer = 42\n" * 40)])
    nbformat.write(nb, release / f"{LAB}.ipynb")
    (home / LAB).mkdir(parents=True)
    (home / "nbgrader_config.py").write_text(
        "c = get_config()  # noqa: F821\n"
        "c.CourseDirectory.course_id = 'c'\n"
        f"c.Exchange.root = {str(exchange)!r}\n"
        f"c.Exchange.cache = {str(tmp_path / 'cache')!r}\n"
        "c.ExchangeFactory.submit = 'labkit.course.submit.WholeSubmit'\n")
    whole = nbformat.writes(nb)
    return {"home": home, "inbound": exchange / "c" / "inbound", "cache": tmp_path / "cache",
            "notebook": home / LAB / f"{LAB}.ipynb", "whole": whole, "cut": whole[: len(whole) // 2],
            "env": {"HOME": str(home), "JUPYTER_CONFIG_DIR": str(tmp_path / "jupyter"), "PATH": "/usr/bin:/bin"}}


def _submitted(course: dict) -> list[Path]:
    return sorted(course["inbound"].glob(f"*/{LAB}.ipynb"))


def _submit(course: dict, code: str = "", *args: str) -> subprocess.Popen:
    main = f"{code}\nimport sys\nfrom nbgrader.apps.nbgraderapp import main\nsys.argv = ['nbgrader', 'submit', {LAB!r}, *{list(args)!r}]\nmain()"
    return subprocess.Popen([sys.executable, "-c", main], cwd=course["home"], env=course["env"],
                            stderr=subprocess.PIPE, text=True)


def test_a_whole_notebook_is_submitted(course):
    course["notebook"].write_text(course["whole"])
    proc = _submit(course)
    assert proc.wait(timeout=120) == 0, proc.stderr.read()[-2000:]
    (copy,) = _submitted(course)
    assert copy.read_text() == course["whole"]


def test_a_submit_during_a_save_waits_for_the_save_to_end(course):
    # as jupyter_server saves: the old file copied to .~name, the notebook rewritten in place
    backup = course["notebook"].parent / f".~{LAB}.ipynb"
    backup.write_text(course["whole"])
    course["notebook"].write_text(course["cut"])
    proc = _submit(course)
    seen = []
    for line in proc.stderr:  # the save ends only once the submit is waiting for it
        seen.append(line)
        if "Waiting for a save under way" in line:
            course["notebook"].write_text(course["whole"])
            backup.unlink()
            break
    assert proc.wait(timeout=120) == 0, "".join(seen) + proc.stderr.read()[-2000:]
    (copy,) = _submitted(course)
    assert copy.read_text() == course["whole"]


def test_a_notebook_cut_short_is_refused_in_one_line_and_nothing_is_filed(course):
    course["notebook"].write_text(course["cut"])
    proc = _submit(course)
    err = proc.stderr.read()
    assert proc.wait(timeout=120) != 0
    assert f"Not submitted: {LAB}.ipynb is not a whole notebook (was it being saved?). Save it, then submit again." in err, err
    assert not list(course["inbound"].iterdir()) and not course["cache"].exists()


def test_a_save_that_began_during_the_copy_leaves_no_submission(course):
    course["notebook"].write_text(course["whole"])
    # the copy is cut short as it would be by a save beginning mid-copy
    code = f"""if 1:
        from pathlib import Path
        from nbgrader.exchange.default.exchange import Exchange
        copy = Exchange.do_copy
        def cut(self, src, dest, log=None):
            copy(self, src, dest, log)
            nb = Path(dest) / {LAB + '.ipynb'!r}
            nb.write_text(nb.read_text()[:100])
        Exchange.do_copy = cut
    """
    proc = _submit(course, code)
    err = proc.stderr.read()
    assert proc.wait(timeout=120) != 0
    assert "Not submitted" in err, err
    assert not list(course["inbound"].iterdir()), list(course["inbound"].iterdir())


def test_a_backup_left_by_a_crashed_save_delays_the_submit_but_does_not_stop_it(course):
    # a server killed mid-save leaves .~name beside a whole notebook: waited on, then submitted
    (course["notebook"].parent / f".~{LAB}.ipynb").write_text(course["cut"])
    course["notebook"].write_text(course["whole"])
    proc = _submit(course, "", "--WholeSubmit.save_wait_s=0.5")
    err = proc.stderr.read()
    assert proc.wait(timeout=120) == 0, err[-2000:]
    assert "Waiting for a save under way" in err, err
    assert _submitted(course)[0].read_text() == course["whole"]


# What a student's folder may hold besides a notebook (issue 43, item 10): refused in the same one
# line, not a traceback, and a FIFO is never opened to wait on.
# (each row is a submit of its own, ~5 s: one row per way nbformat fails, those of the report first)
NOT_A_NOTEBOOK = {"{}": "{}", "[]": "[]", "null": "null", "cells a string": '{"cells": "x"}',
                  "deep JSON": "[" * 100_000 + "]" * 100_000}
WHOLE_LINE = f"Not submitted: {LAB}.ipynb is not a whole notebook (was it being saved?). Save it, then submit again."
ODD_LINE = "is not a regular file (a FIFO, a device or a broken link). Remove it, then submit again."


def _refused(course: dict) -> str:
    proc = _submit(course)
    try:
        err = proc.communicate(timeout=60)[1]  # a hang fails here rather than holding the suite
    finally:
        proc.kill()
    assert proc.returncode not in (0, None) and "Traceback" not in err, err[-2000:]
    assert not list(course["inbound"].iterdir()) and not course["cache"].exists()
    return err


@pytest.mark.parametrize("text", NOT_A_NOTEBOOK.values(), ids=NOT_A_NOTEBOOK.keys())
def test_json_that_is_not_a_notebook_is_refused_in_one_line(course, text):
    course["notebook"].write_text(text)
    assert WHOLE_LINE in _refused(course)


@pytest.mark.parametrize("name, plant", [
    ("pipe.ipynb", os.mkfifo),  # opened by the check of notebooks, it waited for a writer for ever
    ("null.bin", lambda p: p.symlink_to(os.devnull)),  # /dev/zero there: the copy never ends
], ids=["a FIFO", "a link to a device"])
def test_a_fifo_or_a_device_is_refused_in_one_line(course, name, plant):
    course["notebook"].write_text(course["whole"])
    plant(course["notebook"].parent / name)
    assert f"Not submitted: {name} {ODD_LINE}" in _refused(course)
