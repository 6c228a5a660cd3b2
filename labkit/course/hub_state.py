"""The hub's state folder, made and kept by root without following anyone's link, and its roster.

``prepare_state`` makes the folder (root's alone: refused otherwise), the exchange on a file system of
its own (:func:`labkit.course.hub_limits.exchange_on_its_own_disk`), the course directory (the
instructors' group's) with its ``nbgrader_config.py`` created by descriptor, and each role's Jupyter
settings. ``add_users`` enrols people (never a system account) and writes the roster whole.
"""
from __future__ import annotations

import grp
import json
import os
import shutil
import stat
import subprocess
import sys
from pathlib import Path

from labkit.core.files import write_whole
from labkit.course.hub_limits import exchange_on_its_own_disk
from labkit.labs.runner import LABS_DIR, ROOT

COURSE_ID = "training-at-scale"
STUDENT_SETTINGS = ROOT / "cluster" / "jupyterhub" / "student"  # Jupyter settings of a student's server
GROUP = "labkit-instructors"
ROLES = ("student", "instructor")
# what the course's nbgrader_config.py sets for grading: each submission in a sandbox, a warning only
# for a locked cell the student edited (labkit/course/sandbox.py, labkit/course/overwrite.py)
TERMINAL_RC = Path("jupyter") / "terminal.bashrc"  # under the state folder
TERMINAL_RC_TEXT = """\
# A hub terminal's start (labkit/course/hub_state.py): what an interactive bash reads, then the course's
# commands (python, jupyter, nbgrader) first on PATH, as the server has them.
[ -r /etc/bash.bashrc ] && . /etc/bash.bashrc
[ -r "$HOME/.bashrc" ] && . "$HOME/.bashrc"
case ":$PATH:" in *":$LABKIT_HUB_TOOLS:"*) ;; *) PATH="$LABKIT_HUB_TOOLS:$PATH" ;; esac
export PATH
"""
INSTRUCTOR_GRADING = ["from labkit.course.grading_config import sandboxed_grading", "sandboxed_grading(c)"]


def _settings(state: Path) -> dict:
    path = state / "hub.json"
    return json.loads(path.read_text()) if path.is_file() else {}


def _save_settings(state: Path, settings: dict) -> None:
    write_whole(state / "hub.json", json.dumps(settings, indent=1), mode=0o644)  # the hub runs with umask 077


def _root_only(state: Path) -> None:
    """The state folder must be root's alone: the hub writes the roster, the database and the course
    there as root, and a folder another user can write would let them plant links for root to follow."""
    st = os.lstat(state)
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != 0 or st.st_mode & 0o022:
        raise ValueError(f"--state={state}: must be a folder owned by root and writable by root only (it is "
                         f"{'a link' if stat.S_ISLNK(st.st_mode) else oct(st.st_mode & 0o7777)}, uid {st.st_uid})")


def _create(folder: Path, name: str, data: bytes, gid: int, mode: int) -> None:
    """``folder/name`` made new by root (``O_EXCL | O_NOFOLLOW`` relative to the folder, then
    ``fchown``/``fchmod`` on the descriptor): a file, a link or a dangling link there is left alone."""
    dfd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
    try:
        fd = os.open(name, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600, dir_fd=dfd)
    except FileExistsError:
        return
    finally:
        os.close(dfd)
    with os.fdopen(fd, "wb") as f:
        f.write(data)
        os.fchown(fd, 0, gid)
        os.fchmod(fd, mode)


def prepare_state(state: Path, group: str = GROUP, course_id: str = COURSE_ID, exchange_size: int = 2 << 30) -> dict:
    """The state folder, its exchange (on a file system of its own), course directory and each
    role's Jupyter settings."""
    state.mkdir(parents=True, exist_ok=True)
    _root_only(state)
    state.chmod(0o755)
    settings = {"course": course_id, "group": group, **_settings(state)}
    _save_settings(state, settings)
    subprocess.run(["groupadd", "-f", settings["group"]], check=True, capture_output=True)
    gid = grp.getgrnam(settings["group"]).gr_gid
    exchange, course = state / "exchange", state / "course"
    exchange.mkdir(exist_ok=True)
    exchange.chmod(0o1777)  # sticky: nobody renames or removes what another person put there
    why = exchange_on_its_own_disk(exchange, settings.get("exchange_size", exchange_size))
    if why:
        print(f"hub: {why}; students' submissions share the disk of the hub's database", file=sys.stderr)
    exchange.chmod(0o1777)
    course.mkdir(exist_ok=True)
    os.chown(course, 0, gid, follow_symlinks=False)  # in root's own folder: nobody else can make it a link
    course.chmod(0o2770)  # the instructors' group, inherited by what they write (their umask is 002)
    # instructors write in course/: root creates its config there by descriptor, never through a name
    _create(course, "nbgrader_config.py", (ROOT / "course" / "nbgrader_config.py").read_bytes(), gid, 0o664)
    database = state / "jupyterhub.sqlite"
    if database.is_file() and not database.is_symlink():
        database.chmod(0o600)  # every user's name, admin flag and cookie id: the hub's alone
    _terminal_rc(state)
    for role in ROLES:
        folder = state / "jupyter" / role
        folder.mkdir(parents=True, exist_ok=True)
        lines = [f"c.CourseDirectory.course_id = {settings['course']!r}", f"c.Exchange.root = {str(exchange)!r}",
                 'c.ExchangeFactory.collect = "labkit.course.collect.OwnedCollect"',  # the formgrader's collect too
                 'c.ExchangeFactory.submit = "labkit.course.submit.WholeSubmit"']  # the Assignments panel's submit
        if role == "instructor":
            # ~/course, the link to it in every instructor's home: the formgrader wants the course under
            # the server's root (the home), and says "nbgrader will not work correctly" otherwise
            lines.append('c.CourseDirectory.root = os.path.join(os.path.expanduser("~"), "course")')
            lines += INSTRUCTOR_GRADING  # also when autograde runs from elsewhere than ~/course
        (folder / "nbgrader_config.py").write_text("import os\n\nc = get_config()  # noqa: F821\n" + "\n".join(lines)
                                                   + "\n")
        if role == "student":  # no formgrader, no assignment creation: the Kubernetes image's settings too
            shutil.copytree(STUDENT_SETTINGS, folder, dirs_exist_ok=True)
        # a terminal runs bash on the course's rc file: jupyter_server would start `sh -l`, whose
        # /etc/profile puts the system's PATH back, and no course command would be found
        server = folder / "jupyter_server_config.json"
        settings_json = json.loads(server.read_text()) if server.is_file() else {}
        settings_json.setdefault("ServerApp", {})["terminado_settings"] = {
            "shell_command": [shutil.which("bash") or "/bin/bash", "--rcfile", str(state / TERMINAL_RC), "-i"]}
        server.write_text(json.dumps(settings_json, indent=1))
    from labkit.course.student_labs import write_student_labs

    write_student_labs(state / "student-labs")
    return settings


def _terminal_rc(state: Path) -> None:
    (state / TERMINAL_RC).parent.mkdir(parents=True, exist_ok=True)
    write_whole(state / TERMINAL_RC, TERMINAL_RC_TEXT, mode=0o644)


def add_users(state: Path, role: str, names: list[str], password: str | None = None) -> None:
    """Make each name a unix user (if it is not one), give it a private home, and enrol it. An
    existing account must be a person's (:func:`labkit.course.hub_home.check_account`)."""
    settings = prepare_state(state) if not (state / "hub.json").is_file() else _settings(state)
    from labkit.course.hub_home import check_account, home_for
    from labkit.course.hub_spawner import roster

    r = roster(state)
    existing = [n for n in names if subprocess.run(["id", "-u", n], capture_output=True).returncode == 0]
    for name in existing:  # every name checked before anyone is made or enrolled
        check_account(name)
    for name in names:
        if name not in existing:
            subprocess.run(["useradd", "--create-home", "--comment", "labkit hub user", name], check=True,
                           capture_output=True)
        if password is not None:
            subprocess.run(["chpasswd"], input=f"{name}:{password}\n", text=True, check=True, capture_output=True)
        if role == "instructor":
            subprocess.run(["usermod", "-aG", settings["group"], name], check=True, capture_output=True)
        key = f"{role}s"
        r[key] = sorted({*r[key], name})
        write_whole(state / "roster.json", json.dumps(r, indent=1), mode=0o644)  # logins read it meanwhile
        home_for(name, role, state, LABS_DIR)  # the labs (and an instructor's ~/course) from the first day
        made = "a new unix user" if name not in existing else "an existing unix user"
        print(f"hub: enrolled {name} as {role} ({made}{', password set' if password is not None else ''}) "
              f"in {state}", flush=True)
