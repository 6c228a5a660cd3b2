"""The hub image runs the course: its file set, built as the Dockerfile builds it (without Docker),
lists the labs and runs one; without labs/ every entry point says so instead of skipping them.

On Kubernetes each person's server runs as their own uid, as on ``make hub``: the hub gives it
(values.yaml's extraConfig, run here on a real KubeSpawner over a real hub database) and the image's
first process, ``labkit-start``, becomes it. Its pods are played here by mount namespaces, each with
a copy of this machine's /etc of its own, sharing one exchange folder as the pods share a
volume; no Kubernetes runs (none can here)."""
from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import nbformat
import pytest

ROOT = Path(__file__).resolve().parent.parent
DOCKERFILE = ROOT / "cluster" / "jupyterhub" / "Dockerfile"


def _instructions() -> list[tuple[str, str]]:
    text = DOCKERFILE.read_text().replace("\\\n", " ")
    return [(m[1].upper(), m[2].strip()) for m in re.finditer(r"^\s*([A-Za-z]+)\s+(.*)$", text, re.M)
            if not m[0].lstrip().startswith("#")]


def build_file_set(root: Path, skip: tuple[str, ...] = ()) -> Path:
    """The files the Dockerfile's COPY instructions put in the image, under ``root`` (absolute paths
    in the image become paths under it); returns the image's copy of the project (its WORKDIR)."""
    workdir = Path("/")
    project = None
    for op, arg in _instructions():
        if op == "WORKDIR":
            workdir = workdir / arg
        elif op == "COPY":
            *sources, dest = shlex.split(arg)
            target = root / (workdir / dest).relative_to("/")
            for src in sources:
                if src in skip:
                    continue
                path = ROOT / src
                out = target / path.name if dest.endswith("/") and not path.is_dir() else target
                if path.is_dir():
                    shutil.copytree(path, out, dirs_exist_ok=True, ignore=shutil.ignore_patterns("__pycache__"))
                else:
                    out.parent.mkdir(parents=True, exist_ok=True)
                    shutil.copy(path, out)
            if (workdir / dest).as_posix().startswith("/opt/"):
                project = root / workdir.relative_to("/")
    assert project is not None, "the Dockerfile copies nothing into /opt"
    return project


def _env(project: Path) -> dict[str, str]:
    # pip install -e . in the image: the project on the path, from any folder; the image's Python
    env = {**os.environ, "PYTHONPATH": str(project), "LABKIT_PYTHON": "python",
           "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}
    env.pop("MPLBACKEND", None)
    return env


def test_the_image_has_what_the_chapters_commands_need():
    steps = dict(_instructions())
    assert re.search(r"apt-get install .*\bmake\b", " ".join(a for o, a in _instructions() if o == "RUN"))
    assert "LABKIT_PYTHON=python3" in steps["ENV"]


@pytest.fixture(scope="module")
def image(tmp_path_factory) -> Path:
    return build_file_set(tmp_path_factory.mktemp("image"))


def test_the_image_lists_every_lab_and_runs_one_from_a_home_folder(image, tmp_path):
    home = tmp_path / "home"
    home.mkdir()
    proc = subprocess.run([sys.executable, "-m", "labkit", "list"], cwd=home, env=_env(image),
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and proc.stdout.split() == sorted(p.stem for p in (ROOT / "labs").glob("*.md"))
    # the packing lab runs bench/ from the image's copy (the lab the issue found failing)
    proc = subprocess.run([sys.executable, "-m", "labkit", "run", "packing", "--profile", "ci", "--as-script",
                           "--out", str(tmp_path / "out")], cwd=home, env=_env(image), capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert (tmp_path / "out" / "packing.metrics.json").is_file()
    # make runs with the image's Python: no .venv is made
    proc = subprocess.run(["make", "-n", "--no-print-directory", "assignments"], cwd=image, env=_env(image),
                          capture_output=True, text=True)
    assert proc.returncode == 0 and proc.stdout.strip() == "python -m labkit.course.assignments", proc.stdout


def test_without_labs_every_entry_point_says_so(tmp_path):
    image = build_file_set(tmp_path, skip=("labs",))
    env = _env(image)
    for argv in (["-m", "labkit", "list"], ["-m", "labkit", "run", "--profile", "ci"],
                 ["-m", "labkit.gpu_check", "--device", "cpu", "--only", "labs"]):
        proc = subprocess.run([sys.executable, *argv], cwd=tmp_path, env=env, capture_output=True, text=True,
                              timeout=120)
        assert proc.returncode != 0 and "no labs in" in proc.stderr and "Traceback" not in proc.stderr, \
            (argv, proc.returncode, proc.stderr[-2000:])


def _servers(profiles: dict[str, str]) -> dict[str, tuple[dict, object]]:
    """Each person's server environment and pod as the hub makes them: values.yaml's settings as the
    chart hands them to KubeSpawner, then its extraConfig; ``profiles`` maps names to profile slugs."""
    import asyncio
    import types

    import yaml
    from jupyterhub import orm
    from kubespawner import KubeSpawner
    from traitlets.config import Config

    values = yaml.safe_load((ROOT / "cluster" / "jupyterhub" / "values.yaml").read_text())
    single, c = values["singleuser"], Config()
    c.KubeSpawner.update(environment=dict(single["extraEnv"]), uid=single["uid"], fs_gid=single["fsGid"],
                         cmd=single["cmd"], profile_list=single["profileList"],
                         volumes=single["storage"]["extraVolumes"], volume_mounts=single["storage"]["extraVolumeMounts"])
    exec(values["hub"]["extraConfig"]["labkit-people"], {"c": c})
    db = orm.new_session_factory("sqlite://")()
    users = [orm.User(name=name) for name in profiles]
    # the instructors, as secrets.yaml's JupyterHub.load_groups names them: here those starting their profile
    db.add_all([*users, orm.Group(name="instructors", users=[u for u in users if profiles[u.name] == "instructor"])])
    db.commit()

    async def server(name: str, slug: str):
        row = db.query(orm.User).filter_by(name=name).one()
        user = types.SimpleNamespace(name=name, id=row.id, url=f"/user/{name}/", escaped_name=name, db=db, groups=row.groups)
        spawner = KubeSpawner(_mock=True, user=user, config=c)
        spawner.user_options = {"profile": slug}
        await spawner.load_user_options()  # a profile not offered to this person: ValueError
        return spawner.get_env(), await spawner.get_pod_manifest()

    # a student asking for the instructors' profile (by the API: the form does not offer it) is refused
    for name in (n for n, slug in profiles.items() if slug != "instructor"):
        with pytest.raises(ValueError):
            asyncio.run(server(name, "instructor"))
    return {name: asyncio.run(server(name, slug)) for name, slug in profiles.items()}


@pytest.fixture(scope="module")
def servers() -> dict[str, tuple[dict, object]]:
    import kubespawner.spawner

    with pytest.MonkeyPatch.context() as patch:  # no cluster to read the address of: none is contacted
        patch.setattr(kubespawner.spawner, "load_config", lambda **kwargs: None)
        return _servers({"ines": "instructor", "alice": "cpu", "bob": "gpu"})


def test_each_server_is_its_persons_own_uid_and_only_an_instructors_knows_everyone(servers):
    uids = {name: int(env["NB_UID"]) for name, (env, _) in servers.items()}
    assert len(set(uids.values())) == 3 and min(uids.values()) > 10000
    for name, (env, pod) in servers.items():
        assert env["NB_USER"] == name
        expected = ",".join(f"{n}:{u}" for n, u in uids.items()) if name == "ines" else f"{name}:{uids[name]}"
        assert env["LABKIT_PEOPLE"] == expected and env["LABKIT_INSTRUCTOR"] == str(int(name == "ines"))
        container = pod.spec.containers[0]
        # root for labkit-start only; no fsGroup: the kubelet would re-own the shared exchange's files
        assert container.args == ["labkit-start", "jupyterhub-singleuser"] and not container.lifecycle
        assert container.security_context["runAsUser"] == 0 and not (pod.spec.security_context or {}).get("fsGroup")
        assert "/srv/nbgrader/exchange" in {m.mount_path for m in container.volume_mounts}


@pytest.mark.skipif(os.geteuid() != 0 or shutil.which("unshare") is None,
                    reason="the pods are mount namespaces whose first process runs as root (CI runs as root)")
def test_pods_become_their_person_and_the_exchange_keeps_them_apart(image, servers):
    """A term through the exchange: Ines releases, Alice and Bob fetch and submit, then Bob submits
    again under Alice's name; Ines's collect takes each student's own, and says what it left out."""
    from labkit.course.hub_install import BUILD, library_path, users_tools

    python = users_tools()  # in the image, its own Python; here, one every user may run
    root = image.parents[1]  # the image's /
    base = Path(tempfile.mkdtemp(prefix="labkit-pods-", dir="/tmp"))  # the people reach /tmp, not pytest's folder
    try:
        base.chmod(0o755)
        shutil.copytree(root / "etc", base / "etc")
        # each pod's /etc is a copy of this machine's, bound over the folder: a bind over /etc/passwd
        # itself is detached when the host replaces that file by rename, as useradd does (test_hub,
        # on the other worker), and the pod's user would vanish mid-run
        for attempt in range(5):  # a lock or temporary file of theirs may vanish while it is copied
            shutil.rmtree(base / "host-etc", ignore_errors=True)
            try:
                shutil.copytree("/etc", base / "host-etc", symlinks=True, ignore=shutil.ignore_patterns("*.lock", "*+"))
                break
            except shutil.Error:
                if attempt == 4:
                    raise
        exchange, labs = base / "exchange", base / "student-labs"
        exchange.mkdir()  # a new volume: root's, 755
        subprocess.run([sys.executable, "-m", "labkit.course.student_labs", str(labs)], check=True, capture_output=True)
        (base / "home-alice" / "labs").mkdir(parents=True)
        (base / "home-alice" / "labs" / "memory.ipynb").write_text("Alice's work")
        # (root's here: hers from an earlier start, under the uid of an earlier hub database)

        def pod(name: str, *cmd: str, **env: str) -> subprocess.CompletedProcess:
            hub_env, _ = servers[name]
            config = [hub_env["JUPYTER_CONFIG_PATH"]] if "JUPYTER_CONFIG_PATH" in hub_env else []
            shutil.copy("/etc/passwd", base / "host-etc" / "passwd")  # a fresh one at each start, as a pod's
            pod_env = {"PATH": f"{BUILD / 'bin'}:/usr/bin:/bin", "PYTHONWARNINGS": "ignore", **library_path(python),
                       **{k: hub_env[k] for k in ("NB_USER", "NB_UID", "LABKIT_PEOPLE", "LABKIT_INSTRUCTOR")},
                       "NB_HOME": str(base / f"home-{name}"), "NBGRADER_EXCHANGE": str(exchange),
                       "LABKIT_STUDENT_LABS": str(labs),
                       "JUPYTER_CONFIG_PATH": ":".join(str(base / p.removeprefix("/")) for p in [*config, "/etc/jupyter"])}
            return subprocess.run(
                ["unshare", "-m", "sh", "-c", 'mount --bind "$0" /etc && exec "$@"', str(base / "host-etc"),
                 str(root / "usr/local/bin/labkit-start"), "env", *(f"{k}={v}" for k, v in env.items()),
                 "sh", "-c", 'cd "$HOME" && exec "$@"', "sh", *cmd],
                env=pod_env, capture_output=True, text=True, timeout=300)

        def ok(proc: subprocess.CompletedProcess) -> str:
            assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
            return proc.stdout + proc.stderr

        nbgrader = (str(python), "-m", "nbgrader")
        ok(pod("ines", "true"))  # her server's first start: the course's folder in the exchange is hers
        shared = (exchange / "training-at-scale").stat()
        assert (shared.st_uid, shared.st_mode & 0o7777) == (int(servers["ines"][0]["NB_UID"]), 0o755)
        # a one-cell assignment: what crosses the exchange matters here, not how it was made (test_hub)
        nbformat.write(nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell("answer = 42")]), base / "memory.ipynb")
        ok(pod("ines", "sh", "-c", f"mkdir -p course/release/memory && cp {ROOT}/course/nbgrader_config.py course/ && "
                                   f'cp {base}/memory.ipynb course/release/memory/ && cd course && exec "$@"',
               "sh", *nbgrader, "release_assignment", "memory"))
        for name in ("alice", "bob"):
            out = ok(pod(name, "sh", "-c", 'id -un && grep -E "^(CapEff|NoNewPrivs)" /proc/self/status && '
                                           '"$@" fetch_assignment memory && id -un > memory/who && "$@" submit memory',
                         "sh", *nbgrader))
            assert out.splitlines()[:3] == [name, "CapEff:\t0000000000000000", "NoNewPrivs:\t1"], out
        # Bob, later, under Alice's name: the newest submission filed under it
        ok(pod("bob", "sh", "-c", 'echo bob > memory/who && "$@" submit memory --student=alice', "sh", *nbgrader))
        inbound = exchange / "training-at-scale" / "inbound"
        assert "Permission denied" in pod("bob", "ls", str(inbound)).stderr
        log = ok(pod("ines", "sh", "-c", 'cd course && exec "$@"', "sh", *nbgrader, "collect", "memory"))
        submitted = base / "home-ines" / "course" / "submitted"
        assert {p.name: (p / "memory" / "who").read_text().strip() for p in submitted.iterdir()} == \
            {"alice": "alice", "bob": "bob"}
        assert re.findall(r"filed under (\w+) but owned by (\w+)", log) == [("alice", "bob")], log
        assert "cheating" not in log, log
        assert exchange.stat().st_mode & 0o7777 == 0o1777
        for name, (env, _) in servers.items():  # each home its person's and private
            home = (base / f"home-{name}").stat()
            assert (home.st_uid, home.st_mode & 0o777) == (int(env["NB_UID"]), 0o700)
        # the labs in their student form, the image's (its RUN step writes where labkit-start reads),
        # and Alice's own copy kept
        (run,) = [a for o, a in _instructions() if o == "RUN" and "labkit.course.student_labs" in a]
        folder = re.search(r"python -m labkit\.course\.student_labs (\S+)", run)[1]
        assert f"LABKIT_STUDENT_LABS:-{folder}}}" in (root / "usr/local/bin/labkit-start").read_text()
        copied = sorted((base / "home-alice" / "labs").glob("*.ipynb"))
        assert [p.stem for p in copied] == sorted(p.stem for p in (ROOT / "labs").glob("*.md"))
        kept = base / "home-alice" / "labs" / "memory.ipynb"
        assert kept.read_text() == "Alice's work" and kept.stat().st_uid == int(servers["alice"][0]["NB_UID"])
        for p in (p for p in copied if p.stem != "memory"):
            text = p.read_text()
            assert "YOUR CODE HERE" in text and "BEGIN SOLUTION" not in text and "HIDDEN TESTS" not in text, p.name
        assert (root / "etc/labkit/jupyter/student/labconfig/page_config.json").is_file()
    finally:
        shutil.rmtree(base, ignore_errors=True)


def uses_the_courses_exchange(*folders: Path) -> bool:
    """Whether nbgrader, given each folder's nbgrader_config.py, collects and submits with the
    course's collect and submit (asked in a fresh interpreter: nbgrader imports setuptools, which fails
    in a process that has imported the standard library's distutils first)."""
    code = """if 1:
        import sys
        from nbgrader.exchange import ExchangeFactory
        from traitlets.config.loader import PyFileConfigLoader
        from labkit.course.collect import OwnedCollect
        from labkit.course.submit import WholeSubmit
        factories = [ExchangeFactory(config=PyFileConfigLoader("nbgrader_config.py", f).load_config())
                     for f in sys.argv[1:]]
        print([x.collect is OwnedCollect and x.submit is WholeSubmit for x in factories])
    """
    proc = subprocess.run([sys.executable, "-c", code, *map(str, folders)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return proc.stdout.strip() == str([True] * len(folders))


def grades_in_the_sandbox(*folders: Path, env: dict | None = None) -> list[bool]:
    """For each folder's nbgrader_config.py: whether autograde would run submissions in the course's
    sandbox and restore locked cells with the course's OverwriteCellsAsReleased."""
    code = """if 1:
        import sys
        from nbgrader.converters import Autograde
        from traitlets.config.loader import PyFileConfigLoader
        from labkit.course.overwrite import OverwriteCellsAsReleased
        from labkit.course.sandbox import SandboxedKernelManager
        out = []
        for f in sys.argv[1:]:
            grader = Autograde(config=PyFileConfigLoader("nbgrader_config.py", f).load_config())
            kernels = [p(parent=grader).kernel_manager_class for p in grader.autograde_preprocessors
                       if hasattr(p, "kernel_manager_class")]
            out.append(kernels == [SandboxedKernelManager]
                       and OverwriteCellsAsReleased in grader.sanitize_preprocessors)
        print(out)
    """
    proc = subprocess.run([sys.executable, "-c", code, *map(str, folders)], capture_output=True, text=True,
                          timeout=120, env={**os.environ, **(env or {})})
    assert proc.returncode == 0, proc.stderr[-2000:]
    return [x == "True" for x in proc.stdout.strip().strip("[]").split(", ")]


def test_every_instructors_settings_grade_in_the_sandbox():
    # the course directory's, and the image's for an instructor's server (the formgrader's Autograde
    # button); a student's server validates their own work as themselves, without one
    assert grades_in_the_sandbox(ROOT / "course", ROOT / "cluster" / "jupyterhub",
                                 env={"LABKIT_INSTRUCTOR": "1"}) == [True, True]
    assert grades_in_the_sandbox(ROOT / "cluster" / "jupyterhub", env={"LABKIT_INSTRUCTOR": "0"}) == [False]


def test_the_course_and_the_image_collect_each_students_own_and_submit_whole_notebooks():
    # the course directory's settings (nbgrader collect there) and every server's (the formgrader's
    # Collect button, the Assignments panel's Submit, from the home folder); make hub's are held in test_hub
    assert uses_the_courses_exchange(ROOT / "course", ROOT / "cluster" / "jupyterhub")
