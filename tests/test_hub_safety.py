"""The hub against its own users (issue 43): root never acts through their paths, collect takes data,
the roster reads whole, system accounts stay out, and the limits are the kernel's.

Each case is an attack from the adversarial pass, run with real unix users made for this run (CI runs
as root); none needs the browser or a running hub (tests/test_hub.py drives a whole term).
"""
from __future__ import annotations

import datetime
import json
import os
import pwd
import secrets
import shutil
import subprocess
import sys
import time
from pathlib import Path

import nbformat
import pytest

from labkit.course.hub_limits import cgroup_v2, exchange_on_its_own_disk, limit_server, remove_cgroup
from labkit.labs.runner import LABS_DIR

ROOT = Path(__file__).resolve().parent.parent
_RUN = secrets.token_hex(3)
STU, EVE, TEACH = f"ls{_RUN}stu", f"ls{_RUN}eve", f"ls{_RUN}teach"
GROUP = f"ls{_RUN}grp"
pytestmark = pytest.mark.skipif(os.geteuid() != 0 or not shutil.which("useradd"),
                                reason="real unix users and a root hub: it needs root (CI runs as root)")


def _as(user: str, *cmd: str, **kw) -> subprocess.CompletedProcess:
    return subprocess.run(["runuser", "-u", user, "--", *cmd], capture_output=True, text=True, cwd="/", **kw)


@pytest.fixture(scope="module")
def hub(tmp_path_factory):
    from labkit.course.hub_state import add_users, prepare_state

    state = Path("/tmp") / f"labkit-safety-{_RUN}"  # the users reach /tmp, not pytest's folder under /root
    etc = Path("/etc") / f"labkit-safety-{_RUN}"  # root's own: what an attack would make root write to
    try:
        prepare_state(state, group=GROUP)
        add_users(state, "student", [STU, EVE])
        add_users(state, "instructor", [TEACH])
        yield dict(state=state, etc=etc)
    finally:
        for user in (STU, EVE, TEACH):
            subprocess.run(["pkill", "-KILL", "-u", user], capture_output=True)
            subprocess.run(["userdel", "-r", user], capture_output=True)
        subprocess.run(["groupdel", GROUP], capture_output=True)
        subprocess.run(["umount", str(state / "exchange")], capture_output=True)
        shutil.rmtree(state, ignore_errors=True)
        shutil.rmtree(etc, ignore_errors=True)


def _home(user: str) -> Path:
    return Path(pwd.getpwnam(user).pw_dir)


def test_root_fills_a_home_as_its_person_and_follows_no_link(hub):
    from labkit.course.hub_home import home_for

    state, target = hub["state"], hub["etc"] / "labs-target"
    target.mkdir(parents=True)
    labs = _home(STU) / "labs"
    shutil.rmtree(labs)
    _as(STU, "ln", "-s", str(target), str(labs))  # ~/labs -> a folder of root's
    home_for(STU, "student", state, LABS_DIR)
    assert not list(target.iterdir()), "root filled the folder the student's link pointed at"
    labs.unlink()
    _as(STU, "mkdir", str(labs))
    _as(STU, "ln", "-s", str(hub["etc"] / "planted"), str(labs / "memory.ipynb"))  # dangling, into /etc
    home_for(STU, "student", state, LABS_DIR)
    assert not (hub["etc"] / "planted").exists(), "root created a file where the student's link pointed"
    copied = [p for p in labs.iterdir() if p.name != "memory.ipynb"]
    assert copied and all(p.stat().st_uid == pwd.getpwnam(STU).pw_uid for p in copied)
    assert (_home(STU).stat().st_mode & 0o777) == 0o700


def test_the_state_folder_is_never_written_through_a_link(hub):
    from labkit.course.hub_state import prepare_state

    state, planted, kept = hub["state"], hub["etc"] / "config-planted", hub["etc"] / "config-kept"
    config = state / "course" / "nbgrader_config.py"
    config.unlink()
    _as(TEACH, "ln", "-s", str(planted), str(config))  # an instructor's (or a graded payload's) link
    prepare_state(state, group=GROUP)
    assert not planted.exists()
    kept.parent.mkdir(exist_ok=True)
    kept.write_text("root's own\n")
    kept.chmod(0o600)
    config.unlink()
    _as(TEACH, "ln", "-s", str(kept), str(config))
    prepare_state(state, group=GROUP)
    st = kept.stat()
    assert (st.st_uid, st.st_gid, st.st_mode & 0o777) == (0, 0, 0o600), "root chowned or chmodded through the link"
    config.unlink()
    prepare_state(state, group=GROUP)  # made again, as data
    assert config.read_bytes() == (ROOT / "course" / "nbgrader_config.py").read_bytes()


def test_a_state_folder_others_can_write_is_refused_in_one_line(tmp_path):
    state = Path("/tmp") / f"labkit-safety-{_RUN}-open"
    state.mkdir(mode=0o777)
    state.chmod(0o777)
    try:
        out = subprocess.run([sys.executable, "-m", "labkit.course.hub", "add", "--state", str(state), "--role",
                              "student", "nobodyhere"], capture_output=True, text=True, cwd=ROOT)
        assert out.returncode == 2 and "--state=" in out.stderr and "writable by root only" in out.stderr, out.stderr
        assert len(out.stderr.strip().splitlines()) <= 2, out.stderr  # usage line + the error
    finally:
        shutil.rmtree(state)


@pytest.mark.parametrize("account", ["daemon", "bin", "nobody", "outside"])
def test_add_refuses_system_accounts_and_homes_outside_the_home_root(hub, account):
    name, home = account, Path(pwd.getpwnam(account).pw_dir) if account != "outside" else None
    if account == "outside":
        name, home = f"ls{_RUN}out", Path("/var") / f"ls{_RUN}out"
        subprocess.run(["useradd", "--create-home", "--home-dir", str(home), name], check=True, capture_output=True)
    before = home.lstat().st_mode if home.exists() else None
    try:
        out = subprocess.run([sys.executable, "-m", "labkit.course.hub", "add", "--state", str(hub["state"]), "--role",
                              "student", name], capture_output=True, text=True, cwd=ROOT)
        assert out.returncode == 2 and "Traceback" not in out.stderr, out.stderr
        assert ("system account" if account != "outside" else "not a folder directly under") in out.stderr
        assert name not in json.loads((hub["state"] / "roster.json").read_text())["students"]
        assert (home.lstat().st_mode if home.exists() else None) == before, "the account's home was changed"
    finally:
        if account == "outside":
            subprocess.run(["userdel", "-r", name], capture_output=True)


def test_the_roster_always_reads_whole_while_people_are_added(hub):
    """A login reads roster.json while `hub add` writes it: every read is a whole roster."""
    from labkit.course.hub_state import add_users

    reader = subprocess.Popen(
        [sys.executable, "-c", "import json, sys, time\nbad = n = 0\nend = time.monotonic() + 600\n"
         "while time.monotonic() < end and not __import__('os').path.exists(sys.argv[2]):\n"
         "    n += 1\n    try: json.loads(open(sys.argv[1]).read())\n    except ValueError: bad += 1\n"
         "print(bad, n)", str(hub["state"] / "roster.json"), str(hub["state"] / ".stop-reader")],
        stdout=subprocess.PIPE, text=True)
    try:
        for _ in range(6):
            add_users(hub["state"], "student", [STU, EVE])
    finally:
        (hub["state"] / ".stop-reader").touch()
    bad, reads = map(int, reader.communicate(timeout=60)[0].split())
    (hub["state"] / ".stop-reader").unlink()
    assert reads > 0 and bad == 0, f"{bad} of {reads} reads were not whole"


def _submission(inbound: Path, student: str, stamp: str) -> Path:
    folder = inbound / f"{student}+memory+{stamp}+{secrets.token_hex(4)}"
    _as(student, "mkdir", "-p", str(folder))
    _as(student, "sh", "-c", 'echo "$1" > "$2/timestamp.txt"', "sh", stamp, str(folder))
    return folder


@pytest.fixture
def shared_tmp():
    """A folder the users reach (pytest's own is under /root)."""
    folder = Path("/tmp") / f"labkit-safety-{_RUN}-{secrets.token_hex(2)}"
    folder.mkdir(mode=0o755)
    yield folder
    shutil.rmtree(folder, ignore_errors=True)


def test_collect_takes_each_submission_as_data(hub, shared_tmp, monkeypatch):
    """Links, a FIFO, a file of someone else's and an oversized one are left out of one student's
    submission; the student after them is collected; a submission edited after it was filed is
    dated by its last change."""
    tmp_path = shared_tmp
    exchange = tmp_path / "exchange"
    inbound = exchange / "training-at-scale" / "inbound"
    inbound.mkdir(parents=True)
    for p in (tmp_path, exchange, inbound.parent):
        p.chmod(0o755)
    inbound.chmod(0o1777)
    course = tmp_path / "course"
    (course / "source" / "memory").mkdir(parents=True)
    secret = course / "source" / "memory" / "memory.ipynb"
    nbformat.write(nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell("SOLUTION = 42")]), secret)
    shutil.copy(ROOT / "course" / "nbgrader_config.py", course)
    filed = (datetime.datetime.now(datetime.timezone.utc) - datetime.timedelta(hours=1))
    stamp = filed.strftime("%Y-%m-%d %H:%M:%S.%f UTC")
    bad = _submission(inbound, EVE, stamp)
    _as(EVE, "ln", "-s", str(secret), str(bad / "memory.ipynb"))
    _as(EVE, "ln", "-s", "/dev/zero", str(bad / "zero.bin"))
    _as(EVE, "mkfifo", str(bad / "pipe.ipynb"))
    _as(EVE, "sh", "-c", 'head -c 300000 /dev/zero > "$1/big.bin"', "sh", str(bad))
    (bad / "roots.txt").write_text("root's")  # a file in her folder she does not own
    good = _submission(inbound, STU, stamp)
    _as(STU, "sh", "-c", 'echo \'{"cells": []}\' > "$1/memory.ipynb"', "sh", str(good))  # an hour after it was filed
    from labkit.course.assignments import nbgrader

    monkeypatch.setenv("NBGRADER_EXCHANGE", str(exchange))
    log = nbgrader(course, "collect", "memory", "--CourseDirectory.max_file_size=100")  # raises unless it exits 0
    assert "Traceback" not in log, log[-3000:]
    eves = course / "submitted" / EVE / "memory"
    assert sorted(p.name for p in eves.iterdir()) == ["timestamp.txt"], log[-3000:]
    for what in ("memory.ipynb: a link", "zero.bin: a link", "pipe.ipynb: a FIFO", "roots.txt: owned by root",
                 "big.bin: 300000 bytes, over the 100000-byte cap"):
        assert f"{EVE}'s" in log and what in log, (what, log[-3000:])
    stus = course / "submitted" / STU / "memory"
    assert (stus / "memory.ipynb").read_text().startswith('{"cells"')
    dated = datetime.datetime.strptime((stus / "timestamp.txt").read_text().strip(), "%Y-%m-%d %H:%M:%S.%f %Z")
    assert dated.replace(tzinfo=datetime.timezone.utc) > filed + datetime.timedelta(minutes=30), "dated as written"
    assert "changed after it was filed" in log


@pytest.fixture
def gpu_nodes(tmp_path):
    """Device nodes of three made-up GPUs (the NVIDIA driver's major, minors 0-2), openable by all:
    without a driver, open() says ENXIO; refused by a device cgroup, EPERM."""
    folder = Path("/tmp") / f"labkit-safety-{_RUN}-dev"
    folder.mkdir(mode=0o755)
    for minor in range(3):
        os.mknod(folder / f"nvidia{minor}", 0o20666, os.makedev(195, minor))
        (folder / f"nvidia{minor}").chmod(0o666)
    yield folder
    shutil.rmtree(folder)


def test_a_server_reaches_only_its_gpu_and_its_process_limit(hub, gpu_nodes):
    paths = limit_server(STU, 1.0, 1 << 30, 64, ["0", "1", "2"], "1")
    if not paths:
        pytest.skip("no writable cgroup here: the hub says so and runs without limits (tests/test_hub.py checks)")
    probe = ("import errno, subprocess\nfor m in range(3):\n    try:\n        open(f'{d}/nvidia{m}', 'rb')\n"
             "    except OSError as e:\n        print(m, errno.errorcode[e.errno])\nps = []\ntry:\n"
             "    for _ in range(200): ps.append(subprocess.Popen(['sleep', '30']))\nexcept OSError as e:\n"
             "    print('pids', len(ps), errno.errorcode[e.errno])\nfor p in ps: p.kill()\n").replace("{d}", str(gpu_nodes))
    from labkit.course.hub_install import library_path, users_tools

    python = users_tools()  # the interpreter the hub's users run
    procs = " ".join(str(p / "cgroup.procs") for p in paths)
    try:  # as the server is started: joined while root, then the person
        out = subprocess.run(["sh", "-c", f'for f in {procs}; do echo $$ > "$f"; done; exec runuser -u {STU} -- '
                              f'{python} -c "$0"', probe], capture_output=True, text=True, timeout=120,
                             env={**os.environ, **library_path(python)})
    finally:
        subprocess.run(["pkill", "-KILL", "-u", STU], capture_output=True)
        for _ in range(100):
            remove_cgroup(STU)
            if not any(p.exists() for p in paths):
                break
            time.sleep(0.1)
    lines = dict(line.split(" ", 1) for line in out.stdout.splitlines())
    assert lines.get("pids", "").split()[-1:] == ["EAGAIN"] and int(lines["pids"].split()[0]) < 64, out
    if cgroup_v2():
        pytest.skip("cgroup v2: GPUs are CUDA_VISIBLE_DEVICES only here (the hub logs it; the chapter says so)")
    assert (lines["0"], lines["1"], lines["2"]) == ("EPERM", "ENXIO", "EPERM"), out


def test_the_exchange_fills_its_own_disk(tmp_path):
    exchange = Path("/tmp") / f"labkit-safety-{_RUN}-x" / "exchange"
    exchange.mkdir(parents=True)
    (exchange / "kept.txt").write_text("from before")
    exchange.chmod(0o1777)
    try:
        why = exchange_on_its_own_disk(exchange, 32 << 20)
        if why and not os.environ.get("CI"):
            pytest.skip(f"{why}: the hub says so when it starts")
        assert why is None and os.path.ismount(exchange), why
        assert (exchange / "kept.txt").read_text() == "from before" and exchange.stat().st_mode & 0o7777 == 0o1777
        out = _as(STU, "sh", "-c", f"head -c 64000000 /dev/zero > {exchange}/fill.bin")
        assert out.returncode != 0 and "No space left" in out.stderr, out
        assert exchange_on_its_own_disk(exchange, 32 << 20) is None  # again: already mounted
    finally:
        subprocess.run(["umount", str(exchange)], capture_output=True)
        shutil.rmtree(exchange.parent, ignore_errors=True)


def test_refused_hub_flags_are_one_line(hub):
    out = subprocess.run([sys.executable, "-m", "labkit.course.hub", "serve", "--state", str(hub["state"]), "--pids", "3"],
                         capture_output=True, text=True, cwd=ROOT)
    assert out.returncode == 2 and "--pids=3" in out.stderr and "Traceback" not in out.stderr, out.stderr
