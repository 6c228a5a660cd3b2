"""A hub user's home, filled by that user: root never acts through a path a user controls.

The hub runs as root and prepares each home at ``hub add`` and at every server start. Done as root,
every existence check, copy and ``chown`` follows whatever links the person left there: ``~/labs``
pointing at a root-owned folder had root fill it, and a dangling ``~/labs/memory.ipynb`` had root
create a file wherever it pointed. So :func:`home_for` checks the account (a person's, not a system
one, with a home under the machine's home root) and then runs this file as a child process with the
user's own uid, gid and groups (``subprocess`` ``user=``/``group=``/``extra_groups=``), which makes
the folders and copies what is missing, exactly as the person could by hand. The Kubernetes start
script does the same copy as the person (``cluster/jupyterhub/labkit-start.sh``).

Standard library only: it runs as ``python -I hub_home.py`` and imports nothing of the course.
"""
from __future__ import annotations

import json
import os
import pwd
import shutil
import stat
import subprocess
import sys
from pathlib import Path


def _login_defs(key: str, default: int) -> int:
    try:
        for line in Path("/etc/login.defs").read_text().splitlines():
            parts = line.split()
            if len(parts) == 2 and parts[0] == key and parts[1].isdigit():
                return int(parts[1])
    except OSError:
        pass
    return default


def home_root() -> Path:
    """Where ``useradd`` makes homes (``useradd -D``'s HOME, /home by default)."""
    try:
        out = subprocess.run(["useradd", "-D"], capture_output=True, text=True).stdout
        for line in out.splitlines():
            if line.startswith("HOME="):
                return Path(line.removeprefix("HOME=").strip() or "/home")
    except OSError:
        pass
    return Path("/home")


def check_account(name: str) -> pwd.struct_passwd:
    """The account of a person the hub may enrol: a uid in login.defs' UID_MIN..UID_MAX (not root,
    ``bin``, ``daemon``, ``www-data`` or ``nobody``) and a real home folder of theirs directly under
    the home root. A ValueError naming the account and the rule otherwise."""
    pw = pwd.getpwnam(name)
    lo, hi = _login_defs("UID_MIN", 1000), _login_defs("UID_MAX", 60000)
    if not lo <= pw.pw_uid <= hi:
        raise ValueError(f"{name}: uid {pw.pw_uid} is a system account's (people have {lo} to {hi} in "
                         "/etc/login.defs); the hub enrols people only")
    home, root = Path(pw.pw_dir), home_root()
    if home.parent != root or home.name in ("", ".", ".."):
        raise ValueError(f"{name}: home {pw.pw_dir} is not a folder directly under {root}, where the hub keeps homes")
    try:
        st = os.lstat(home)
    except FileNotFoundError:
        raise ValueError(f"{name}: home {pw.pw_dir} does not exist (useradd --create-home makes it)") from None
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != pw.pw_uid:
        raise ValueError(f"{name}: home {pw.pw_dir} is not a folder owned by {name}")
    return pw


def home_for(user: str, role: str, state: Path, source_labs: Path) -> None:
    """The labs in ``user``'s home (what is there already stays), the home private to them, an
    instructor's ``~/course`` and the course's folder in the exchange: all done as ``user``."""
    from labkit.course.hub_install import library_path, users_python, users_tools

    pw = check_account(user)
    groups = os.getgrouplist(user, pw.pw_gid)
    # an interpreter every user may run (root's own may lie under /root): made by `hub add` before the
    # hub first serves, and only looked up at a server's start (the hub runs with umask 077)
    python = users_python() if users_python().is_file() else users_tools()
    env = {"HOME": pw.pw_dir, "USER": user, "PATH": "/usr/bin:/bin", "LANG": "C.UTF-8", **library_path(python)}
    course = json.loads((state / "hub.json").read_text())["course"]  # read by root: the hub's files are its own
    out = subprocess.run([str(python), "-I", __file__, role, str(state), str(source_labs), course], user=pw.pw_uid,
                         group=pw.pw_gid, extra_groups=groups, env=env, cwd="/", umask=0o022,
                         capture_output=True, text=True)
    if out.returncode:
        raise RuntimeError(f"{user}'s home: {(out.stderr.strip().splitlines() or ['failed'])[-1]}")
    if out.stderr.strip():
        print(out.stderr.strip(), file=sys.stderr)


def _copy_missing(src: Path, dest_dir: Path) -> None:
    """``src`` into ``dest_dir`` unless a file of that name (or a link, even a dangling one) is there."""
    try:
        fd = os.open(dest_dir / src.name, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o644)
    except FileExistsError:
        return
    with os.fdopen(fd, "wb") as out, open(src, "rb") as f:
        shutil.copyfileobj(f, out)


def _fill(role: str, state: Path, source_labs: Path, course: str) -> None:
    home = Path(os.environ["HOME"])
    os.chmod(home, 0o700)  # Debian's useradd makes homes readable by everyone
    labs = home / "labs"
    try:
        os.mkdir(labs)
    except FileExistsError:
        pass
    if not stat.S_ISDIR(os.lstat(labs).st_mode):
        print(f"hub: {labs} is not a folder; the labs were not copied", file=sys.stderr)
        return
    if role == "instructor":
        try:
            os.symlink(state / "course", home / "course")
        except FileExistsError:
            pass
        # the course's folder in the exchange, an instructor's before any student can make it theirs
        # (the exchange is writable by all; nbgrader releases only into a folder the releaser owns)
        shared = state / "exchange" / course
        try:
            os.mkdir(shared, 0o755)
        except FileExistsError:
            st = os.lstat(shared)
            if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid():
                print(f"hub: {shared} was made by uid {st.st_uid}, not this instructor: remove it (as root) so an "
                      "instructor's releases cannot be redirected", file=sys.stderr)
        files = sorted(source_labs.glob("*.md"))
    else:
        files = sorted((state / "student-labs").glob("*.ipynb"))
    for f in files:
        _copy_missing(f, labs)


if __name__ == "__main__":
    _fill(sys.argv[1], Path(sys.argv[2]), Path(sys.argv[3]), sys.argv[4])
