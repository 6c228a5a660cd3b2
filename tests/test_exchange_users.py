"""nbgrader's exchange on one machine with a unix user per person, as book/instructors.md sets it up:
an instructor releases, collects, grades and returns feedback; one student fetches and submits;
another tries to alter the release, to read or replace the first one's submission and feedback,
and to read the instructors' sources, and is refused by the filesystem each time (issue 29, item 2:
with one shared unix user all of this succeeded). Needs root to create the users, as CI runs.
"""
from __future__ import annotations

import os
import pwd
import secrets
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from labkit.labs.assignments import COURSE_DIR, generate, nbgrader

_RUN = secrets.token_hex(3)  # user names of this run only
INSTRUCTOR, ALICE, BOB = f"lt{_RUN}teach", f"lt{_RUN}alice", f"lt{_RUN}bob"
COURSE = "training-at-scale"
LAB = "memory"  # the quickest lab to grade


# The users run a world-readable interpreter of this one's minor version with this suite's packages
# (a pyenv interpreter under /root is not theirs to run; on a class server Python is installed for all).
SYSTEM_PYTHON = Path(f"/usr/bin/python{sys.version_info.major}.{sys.version_info.minor}")
TOOLS: dict[str, Path] = {}


def _run(user: str, *cmd: str, cwd: Path, ok: bool = True) -> subprocess.CompletedProcess:
    env = {"PATH": f"{TOOLS['bin']}:/usr/bin:/bin", "PYTHONPATH": str(TOOLS["site"]), "HOME": str(_home(user)),
           "USER": user, "LABKIT_THREADS": "1", "JUPYTER_PATH": str(Path(sys.prefix) / "share" / "jupyter")}
    proc = subprocess.run([shutil.which("runuser"), "-u", user, "--", *cmd], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=600)
    if ok:
        assert proc.returncode == 0, (cmd, proc.stdout[-2000:], proc.stderr[-3000:])
    return proc


def _nbgrader(user: str, *args: str, cwd: Path, exchange: Path) -> str:
    proc = _run(user, "python", "-m", "nbgrader", *args, f"--Exchange.root={exchange}", cwd=cwd)
    return proc.stdout + proc.stderr


def _refused(user: str, code: str, cwd: Path) -> str:
    """Run ``code`` as ``user``; it must fail with PermissionError. Returns its message."""
    proc = _run(user, "python", "-c", code, cwd=cwd, ok=False)
    assert proc.returncode != 0 and "PermissionError" in proc.stderr, (user, code, proc.stdout, proc.stderr[-1500:])
    return proc.stderr.strip().splitlines()[-1]


def _chown_to(folder: Path, user: str) -> None:
    pw = pwd.getpwnam(user)
    for d, _, files in os.walk(folder):
        for p in [d, *(os.path.join(d, f) for f in files)]:
            os.chown(p, pw.pw_uid, pw.pw_gid)


def _home(user: str) -> Path:
    return Path(pwd.getpwnam(user).pw_dir)


@pytest.fixture(scope="module")
def term():
    if os.geteuid() != 0 or shutil.which("useradd") is None or shutil.which("runuser") is None:
        pytest.skip("creating unix users needs root and useradd/runuser (CI runs as root)")
    if not SYSTEM_PYTHON.is_file():
        pytest.skip(f"the users need a Python they may run: {SYSTEM_PYTHON} is missing")
    root = Path(tempfile.mkdtemp(prefix="labkit-term-", dir="/tmp"))
    made: list[str] = []
    try:
        for user in (INSTRUCTOR, ALICE, BOB):  # names of this run only: no existing account is touched
            subprocess.run(["useradd", "-m", "-c", "labkit test user", user], check=True, capture_output=True)
            made.append(user)
            _home(user).chmod(0o700)  # the chapter's step: Debian's useradd makes homes readable by all
        root.chmod(0o755)
        TOOLS.update(bin=root / "bin", site=root / "site")
        TOOLS["bin"].mkdir(), TOOLS["site"].mkdir()
        site_packages = next(p for p in sys.path if p.endswith("site-packages") and p.startswith(sys.prefix))
        (TOOLS["site"] / "sitecustomize.py").write_text(  # ahead of the system's dist-packages (Debian's bs4)
            f"import site, sys\nbefore = list(sys.path)\nsite.addsitedir({site_packages!r})\n"
            "sys.path[:] = [p for p in sys.path if p not in before] + before\n")
        for name, line in (("python", f'exec {SYSTEM_PYTHON} "$@"'),
                           ("alembic", f'exec {SYSTEM_PYTHON} -m alembic "$@"')):
            (TOOLS["bin"] / name).write_text(f"#!/bin/sh\n{line}\n")
            (TOOLS["bin"] / name).chmod(0o755)
        exchange = root / "exchange"  # the chapter's: writable by all, sticky; nbgrader sets the rest
        exchange.mkdir()
        exchange.chmod(0o1777)
        course = _home(INSTRUCTOR) / "course"
        course.mkdir()
        shutil.copy(COURSE_DIR / "nbgrader_config.py", course)
        generate([LAB], course)
        _chown_to(course, INSTRUCTOR)
        yield dict(root=root, exchange=exchange, course=course)
    finally:
        for user in made:
            subprocess.run(["pkill", "-KILL", "-u", user], capture_output=True)  # a kernel left running
            gone = subprocess.run(["userdel", "-r", user], capture_output=True, text=True)
            assert gone.returncode in (0, 12), gone.stderr  # 12: the home was already removed
        shutil.rmtree(root, ignore_errors=True)


def test_a_term_with_a_user_per_person_keeps_each_students_work_their_own(term):
    ex, course = term["exchange"], term["course"]
    alice, bob = _home(ALICE), _home(BOB)
    course_flag = f"--course={COURSE}"
    _nbgrader(INSTRUCTOR, "release_assignment", LAB, "--force", cwd=course, exchange=ex)
    _nbgrader(ALICE, "fetch_assignment", LAB, course_flag, cwd=alice, exchange=ex)
    _nbgrader(BOB, "fetch_assignment", LAB, course_flag, cwd=bob, exchange=ex)
    assert (alice / LAB / f"{LAB}.ipynb").is_file()
    _nbgrader(ALICE, "submit", LAB, course_flag, cwd=alice, exchange=ex)

    released = ex / COURSE / "outbound" / LAB / f"{LAB}.ipynb"
    attempts = {
        "alter the release": f"open({str(released)!r}, 'a').write('x')",
        "replace the release": f"import os; os.rename({str(released.parent)!r}, {str(released.parent)!r} + '.x')",
        "list the submissions": f"import os; print(os.listdir({str(ex / COURSE / 'inbound')!r}))",
        "read the sources": f"open({str(course / 'source' / LAB / f'{LAB}.ipynb')!r}).read()",
        "read the gradebook": f"open({str(course / 'gradebook.db')!r}, 'rb').read()",
        "replace the course's exchange folder": f"import os; os.rename({str(ex / COURSE)!r}, {str(ex / 'x')!r})",
        "read the other's notebook at home": f"open({str(alice / LAB / f'{LAB}.ipynb')!r}).read()",
    }
    refused = {what: _refused(BOB, code, bob) for what, code in attempts.items()}
    (submitted,) = [p for p in (ex / COURSE / "inbound").iterdir() if p.name.startswith(ALICE)]
    refused["alter a submission whose name was guessed"] = _refused(
        BOB, f"open({str(submitted / f'{LAB}.ipynb')!r}, 'a').write('x')", bob)

    log = _nbgrader(INSTRUCTOR, "collect", LAB, cwd=course, exchange=ex)
    assert "cheating" not in log.lower(), log[-2000:]  # the owner check passes: alice's file is alice's
    # the kernel is the users' Python (the course's kernel spec names this suite's interpreter)
    _run(INSTRUCTOR, "python", "-m", "nbgrader", "autograde", LAB, "--student", ALICE,
         "--ExecutePreprocessor.kernel_name=python3", cwd=course)
    # the HTML report runs as root with this suite's interpreter: soupsieve 4.1, which nbconvert's HTML
    # exporter calls, cannot parse its own selectors on Debian's Python 3.11.2 (it can on 3.11.7)
    nbgrader(course, "generate_feedback", LAB, "--student", ALICE)
    _chown_to(course / "feedback", INSTRUCTOR)
    _nbgrader(INSTRUCTOR, "release_feedback", LAB, "--student", ALICE, cwd=course, exchange=ex)
    feedback = ex / COURSE / "feedback"
    (returned,) = list(feedback.iterdir())  # <hash of the submission>.html, unguessable
    assert returned.suffix == ".html"
    refused["list the feedback"] = _refused(BOB, f"import os; print(os.listdir({str(feedback)!r}))", bob)
    refused["replace feedback whose name was guessed"] = _refused(
        BOB, f"open({str(returned)!r}, 'w').write('x')", bob)
    _nbgrader(ALICE, "fetch_feedback", LAB, course_flag, cwd=alice, exchange=ex)
    page = next((alice / LAB / "feedback").rglob("*.html")).read_text()
    assert "HIDDEN TESTS" not in page and "Score" in page
    assert len(refused) == 10, refused
