"""What JupyterHub runs for `make hub`: who may log in, and each person's server.

* :class:`CourseAuthenticator` is JupyterHub's PAM authenticator (the machine's own accounts and
  passwords, as The Littlest JupyterHub does) that lets in the state folder's roster only, re-read at
  every login, so a person added while the hub runs can log in at once.
* :class:`CourseSpawner` is JupyterHub's ``LocalProcessSpawner`` (each server a process of its
  person's unix user) that also, before a server starts: puts the labs in the home (students get
  their student form, :mod:`labkit.labs.student_labs`; instructors the source and a link to the course
  directory), copying only what is missing so nobody's work is overwritten; gives the server one
  device of the GPU pool (``CUDA_VISIBLE_DEVICES``: an index or a MIG UUID) and takes it back when
  the server stops; and puts the server in a cgroup of its own with the CPU and memory limits (the
  kernel's cgroup v2 or v1 controllers, as systemd's do; where none is writable the hub says so once
  and runs without). Students' servers load nbgrader's assignment list and not the formgrader.
"""
from __future__ import annotations

import json
import os
import pwd
import shutil
from pathlib import Path

from jupyterhub.auth import PAMAuthenticator
from jupyterhub.spawner import LocalProcessSpawner
from traitlets import Dict, Float, Integer, List, Unicode

CGROUP = Path("/sys/fs/cgroup")
_IN_USE: dict[str, str] = {}  # GPU -> user whose server holds it (rebuilt from servers' state on restart)


def roster(state: Path) -> dict[str, list[str]]:
    path = Path(state) / "roster.json"
    return json.loads(path.read_text()) if path.is_file() else {"students": [], "instructors": []}


def role_of(state: Path, user: str) -> str | None:
    r = roster(state)
    return "instructor" if user in r["instructors"] else "student" if user in r["students"] else None


class CourseAuthenticator(PAMAuthenticator):
    state = Unicode(help="the hub's state folder (roster.json)").tag(config=True)

    def check_allowed(self, username, authentication=None):
        return role_of(Path(self.state), username) is not None


def cgroup_paths(user: str) -> list[Path]:
    """The folders of ``user``'s cgroup: one under cgroup v2, one per controller under v1."""
    if (CGROUP / "cgroup.controllers").is_file():
        return [CGROUP / "labkit-hub" / user]
    return [CGROUP / c / "labkit-hub" / user for c in ("cpu", "memory")]


def limit_server(user: str, cpus: float, memory: int) -> list[Path]:
    """Make ``user``'s cgroup with ``cpus`` cores and ``memory`` bytes; [] when none can be made."""
    paths = cgroup_paths(user)
    try:
        if len(paths) == 1:  # v2: the parent hands its children the cpu and memory controllers
            paths[0].mkdir(parents=True, exist_ok=True)
            (paths[0].parent / "cgroup.subtree_control").write_text("+cpu +memory")
            (paths[0] / "cpu.max").write_text(f"{int(cpus * 100_000)} 100000")
            (paths[0] / "memory.max").write_text(str(memory))
        else:
            for p in paths:
                p.mkdir(parents=True, exist_ok=True)
            (paths[0] / "cpu.cfs_period_us").write_text("100000")
            (paths[0] / "cpu.cfs_quota_us").write_text(str(int(cpus * 100_000)))
            (paths[1] / "memory.limit_in_bytes").write_text(str(memory))
    except OSError:
        return []
    return paths


class CourseSpawner(LocalProcessSpawner):
    state = Unicode(help="the hub's state folder").tag(config=True)
    python = Unicode(help="the interpreter every user may run, with the course installed").tag(config=True)
    tools = Unicode(help="folder of python, jupyter and nbgrader commands for the users").tag(config=True)
    library_path = Dict(help="LD_LIBRARY_PATH, where the interpreter needs it").tag(config=True)
    jupyter_path = List(Unicode(), help="JUPYTER_PATH of every server").tag(config=True)
    jupyter_config = Unicode(help="the course's Jupyter config folder (etc/jupyter)").tag(config=True)
    jupyterlab_dir = Unicode(help="JupyterLab's application folder").tag(config=True)
    source_labs = Unicode(help="the labs as committed (instructors)").tag(config=True)
    gpus = List(Unicode(), help="the GPU pool: indices or MIG UUIDs; empty: CPU only").tag(config=True)
    server_cpus = Float(2.0, help="cores per server").tag(config=True)
    server_memory = Integer(8 << 30, help="bytes of memory per server").tag(config=True)
    gpu = Unicode("")

    def load_state(self, state):
        super().load_state(state)
        self.gpu = state.get("gpu", "")
        if self.gpu:
            _IN_USE[self.gpu] = self.user.name

    def get_state(self):
        return {**super().get_state(), **({"gpu": self.gpu} if self.gpu else {})}

    def clear_state(self):
        super().clear_state()
        self._release_gpu()

    def _release_gpu(self) -> None:
        if self.gpu and _IN_USE.get(self.gpu) == self.user.name:
            del _IN_USE[self.gpu]
        self.gpu = ""

    def _take_gpu(self) -> None:
        if not self.gpus or self.gpu:
            return
        free = [g for g in self.gpus if g not in _IN_USE]
        if not free:
            raise RuntimeError(f"all {len(self.gpus)} GPUs of this hub are in use (by {sorted(set(_IN_USE.values()))}): "
                               "ask an instructor to stop an idle server")
        self.gpu = free[0]
        _IN_USE[self.gpu] = self.user.name

    @property
    def role(self) -> str:
        return role_of(Path(self.state), self.user.name) or "student"

    def get_env(self):
        env = super().get_env()
        home = Path(pwd.getpwnam(self.user.name).pw_dir)
        env.update(server_env(Path(self.state), self.role, home, self.tools, self.library_path, self.jupyter_path,
                              self.jupyter_config, self.jupyterlab_dir))
        env["CUDA_VISIBLE_DEVICES"] = self.gpu  # "" hides every GPU from a server without one
        env["LABKIT_THREADS"] = str(max(1, int(self.server_cpus)))
        return env

    def make_preexec_fn(self, name):
        become_user = super().make_preexec_fn(name)
        procs = [p / "cgroup.procs" for p in self._cgroups]
        umask = 0o002 if self.role == "instructor" else 0o022  # the course folder is the instructors' group's

        def preexec():
            for p in procs:  # while still root: the server and all it starts live in its cgroup
                p.write_text(str(os.getpid()))
            os.umask(umask)
            become_user()

        return preexec

    async def start(self):
        self.cmd = [self.python, "-m", "jupyterhub.singleuser"]
        self._take_gpu()
        try:
            home_for(self.user.name, self.role, Path(self.state), Path(self.source_labs))
            self._cgroups = limit_server(self.user.name, self.server_cpus, self.server_memory)
            if not self._cgroups:
                self.log.warning("no writable cgroup: %s's server runs without CPU and memory limits", self.user.name)
            return await super().start()
        except Exception:
            self._release_gpu()
            raise

    async def stop(self, now=False):
        await super().stop(now=now)
        self._release_gpu()
        for p in cgroup_paths(self.user.name):  # empty once the server's processes are gone
            try:
                p.rmdir()
            except OSError:
                pass


def server_env(state: Path, role: str, home: Path, tools: str, library_path: dict, jupyter_path: list[str],
               jupyter_config: str, jupyterlab_dir: str) -> dict[str, str]:
    """The environment of a server, and of what its terminals and kernels run."""
    return {
        **library_path,
        "PATH": f"{tools}:/usr/local/bin:/usr/bin:/bin",
        "JUPYTER_PATH": os.pathsep.join(jupyter_path),
        # the role's own settings first (nbgrader's exchange and course, which extensions load)
        "JUPYTER_CONFIG_PATH": os.pathsep.join([str(state / "jupyter" / role), jupyter_config]),
        "JUPYTERLAB_DIR": jupyterlab_dir,
        "NBGRADER_EXCHANGE": str(state / "exchange"),
        "TORCH_EXTENSIONS_DIR": str(home / ".cache" / "torch_extensions"),
        "PYTHONWARNINGS": "ignore::FutureWarning",
    }


def home_for(user: str, role: str, state: Path, source_labs: Path) -> None:
    """The labs in ``user``'s home (what is there already stays), and the home private to them."""
    pw = pwd.getpwnam(user)
    home = Path(pw.pw_dir)
    home.chmod(0o700)  # Debian's useradd makes homes readable by everyone
    labs = home / "labs"
    made = [] if labs.exists() else [labs]
    labs.mkdir(exist_ok=True)
    if role == "instructor":
        course = home / "course"
        if not course.is_symlink() and not course.exists():
            course.symlink_to(state / "course")
            made.append(course)
        # the course's folder in the exchange, an instructor's before any student can make it theirs
        # (the exchange is writable by all; nbgrader releases only into a folder the releaser owns)
        shared = state / "exchange" / json.loads((state / "hub.json").read_text())["course"]
        if not shared.exists():
            shared.mkdir(mode=0o755)
            made.append(shared)
        files = sorted(source_labs.glob("*.md"))
    else:
        files = sorted((state / "student-labs").glob("*.ipynb"))
    for f in files:
        if not (labs / f.name).exists():
            shutil.copyfile(f, labs / f.name)
            made.append(labs / f.name)
    for p in made:
        os.chown(p, pw.pw_uid, pw.pw_gid, follow_symlinks=False)
