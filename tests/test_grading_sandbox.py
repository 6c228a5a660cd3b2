"""Autograde runs a hostile submission in its sandbox (labkit/course/sandbox.py), and nothing leaks.

The payload is the one an adversarial pass ran on the hub (issue 43, item 1): its answer cell copies
the assignment's source where a student could read it, appends a line to the course's
``nbgrader_config.py``, leaves a detached process behind to rewrite the gradebook, reads the grader's
server token from its environment, and calls the network. Graded with the committed course config,
every one of those fails inside the sandbox, the cell's output says so, and afterwards the sources,
the config and the gradebook are as they were, no process of the payload is alive, and the token is
nowhere in the graded notebook. A right answer graded the same way still scores full marks.
"""
from __future__ import annotations

import hashlib
import shutil
import socket
import subprocess
import threading
import time
from pathlib import Path

import nbformat
import pytest

from labkit.course.assignments import COURSE_DIR, generate, nbgrader
from labkit.course.sandbox import SandboxedKernelManager, SandboxRefused, check_bwrap

LAB = "memory"
TOKEN = "s3cr3t-grader-token-0451"
MARK = "labkit-payload-7c1e"

PAYLOAD = '''
import os, shutil, socket, subprocess, sys
COURSE = {course!r}
report = {{}}
def attempt(what, fn):
    try:
        fn()
        report[what] = "DONE"
    except Exception as e:
        report[what] = type(e).__name__
attempt("copy the source", lambda: shutil.copy(COURSE + "/source/{lab}/{lab}.ipynb", {leak!r}))
attempt("append to the config", lambda: open(COURSE + "/nbgrader_config.py", "a").write("\\nc.X = 1\\n"))
attempt("write the gradebook", lambda: open(COURSE + "/gradebook.db", "r+b").write(b"x"))
attempt("call the network", lambda: socket.create_connection(("127.0.0.1", {port}), timeout=2).sendall(b"hi"))
report["token"] = os.environ.get("JUPYTERHUB_API_TOKEN", "none")
# a process that outlives the kernel: double fork, its own session, rewrites the gradebook later
subprocess.Popen([sys.executable, "-c", "import time, sys; sys.argv.append({mark!r}); time.sleep(600); "
                  "open(" + repr(COURSE + "/gradebook.db") + ", 'wb').write(b'')"], start_new_session=True,
                 stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
print("PAYLOAD", sorted(report.items()))
def zero_bytes_per_device(n_params, world_size, stage, k=12):
    return 0
'''


def _digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_a_hostile_submission_changes_nothing_and_leaves_nothing(grading_sandbox, tmp_path, monkeypatch):
    course = tmp_path / "course"
    course.mkdir()
    shutil.copy(COURSE_DIR / "nbgrader_config.py", course)
    generate([LAB], course)
    release = nbformat.read(course / "release" / LAB / f"{LAB}.ipynb", as_version=4)
    listener = socket.create_server(("127.0.0.1", 0))  # what the payload calls: nothing may arrive
    calls: list[bytes] = []
    threading.Thread(target=lambda: calls.append(listener.accept()[0].recv(10)), daemon=True).start()
    leak = tmp_path / "leaked.ipynb"
    payload = PAYLOAD.format(course=str(course), lab=LAB, leak=str(leak), port=listener.getsockname()[1],
                             mark=MARK)
    for cell in release.cells:
        if cell.metadata.get("nbgrader", {}).get("solution"):
            cell.source = payload
    (course / "submitted" / "mallory" / LAB).mkdir(parents=True)
    nbformat.write(release, course / "submitted" / "mallory" / LAB / f"{LAB}.ipynb")
    nbgrader(course, "db", "student", "add", "mallory")  # the gradebook exists before the payload runs
    watched = [course / "source" / LAB / f"{LAB}.ipynb", course / "nbgrader_config.py"]
    before = {p: _digest(p) for p in watched}

    monkeypatch.setenv("JUPYTERHUB_API_TOKEN", TOKEN)  # as in an instructor's server on the hub
    (tmp_path / "tmp").mkdir()
    monkeypatch.setenv("TMPDIR", str(tmp_path / "tmp"))  # where the sandbox keeps its sockets
    nbgrader(course, "autograde", LAB)

    graded = nbformat.read(course / "autograded" / "mallory" / LAB / f"{LAB}.ipynb", as_version=4)
    out = "\n".join(o.get("text", "") for c in graded.cells if c.cell_type == "code" for o in c.get("outputs", []))
    line = next(x for x in out.splitlines() if x.startswith("PAYLOAD"))
    assert "DONE" not in line and "none" in line, line  # every attempt refused, no token in its environment
    assert TOKEN not in (course / "autograded" / "mallory" / LAB / f"{LAB}.ipynb").read_text()
    assert {p: _digest(p) for p in watched} == before
    assert not leak.exists() and not calls
    # The kernel of Linux kills what the sandbox's pid namespace left when its pid 1 ends: a SIGKILL
    # each, delivered and reaped asynchronously (once seen still running right after autograde, on
    # cores shared by three workers). Dead within 30 s is dead; alive after it, it outlived its kernel.
    deadline = time.monotonic() + 30
    while (left := subprocess.run(["pgrep", "-f", MARK], capture_output=True, text=True)).returncode == 0 \
            and time.monotonic() < deadline:
        time.sleep(0.1)
    assert left.returncode == 1, f"the payload's process outlived its kernel: {left.stdout}"
    from nbgrader.api import Gradebook

    with Gradebook(f"sqlite:///{course / 'gradebook.db'}") as gb:  # the gradebook reads, with the payload's grade
        assert gb.find_submission(LAB, "mallory").score == 0
    assert not list((tmp_path / "tmp").iterdir()), "a sandbox's socket folder was left behind"


def test_without_bubblewrap_autograde_refuses_in_one_line(tmp_path):
    km = SandboxedKernelManager(bwrap=str(tmp_path / "no-bwrap"))
    with pytest.raises(SandboxRefused, match="apt install bubblewrap"):
        check_bwrap(km.bwrap)
