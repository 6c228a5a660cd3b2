"""What JupyterHub runs for `make hub`: who may log in, and each person's server.

* :class:`CourseAuthenticator` is JupyterHub's PAM authenticator (the machine's own accounts and
  passwords, as The Littlest JupyterHub does) that lets in the state folder's roster only, re-read at
  every login, so a person added while the hub runs can log in at once.
* :class:`CourseSpawner` is JupyterHub's ``LocalProcessSpawner`` (each server a process of its
  person's unix user) that also, before a server starts: puts the labs in the home (students get
  their student form, :mod:`labkit.course.student_labs`; instructors the source and a link to the course
  directory), copying only what is missing so nobody's work is overwritten; gives the server one
  device of the GPU pool (``CUDA_VISIBLE_DEVICES``: an index or a MIG UUID) and takes it back when
  the server stops; and puts the server in a cgroup of its own with its CPU, memory, process and GPU
  limits (:mod:`labkit.course.hub_limits`). The home is filled as its person, never as root
  (:mod:`labkit.course.hub_home`). Students' servers load nbgrader's assignment list and not the
  formgrader.
"""
from __future__ import annotations

import json
import os
import pwd
import time
from pathlib import Path

from jupyterhub.auth import PAMAuthenticator
from jupyterhub.spawner import LocalProcessSpawner
from traitlets import Dict, Float, Integer, List, Unicode

from labkit.course.hub_home import home_for
from labkit.course.hub_limits import join_cgroup, limit_server, limits_held, remove_cgroup

_IN_USE: dict[str, str] = {}  # GPU -> user whose server holds it (rebuilt from servers' state on restart)


def roster(state: Path) -> dict[str, list[str]]:
    """Who is enrolled. ``hub add`` replaces the file whole (one rename); a file being written by
    hand may still read half, so a read that fails is tried again for a moment."""
    path = Path(state) / "roster.json"
    for attempt in range(20):
        try:
            return json.loads(path.read_text()) if path.is_file() else {"students": [], "instructors": []}
        except (json.JSONDecodeError, FileNotFoundError):
            if attempt == 19:
                raise
            time.sleep(0.05)
    raise AssertionError("unreachable")


def role_of(state: Path, user: str) -> str | None:
    r = roster(state)
    return "instructor" if user in r["instructors"] else "student" if user in r["students"] else None


class CourseAuthenticator(PAMAuthenticator):
    state = Unicode(help="the hub's state folder (roster.json)").tag(config=True)

    def check_allowed(self, username, authentication=None):
        return role_of(Path(self.state), username) is not None


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
    server_pids = Integer(2048, help="processes and threads per server").tag(config=True)
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
        cgroups = self._cgroups
        umask = 0o002 if self.role == "instructor" else 0o022  # the course folder is the instructors' group's

        def preexec():
            join_cgroup(cgroups)  # while still root: the server and all it starts live in its cgroup
            os.umask(umask)
            become_user()

        return preexec

    async def start(self):
        self.cmd = [self.python, "-m", "jupyterhub.singleuser"]
        self._take_gpu()
        try:
            home_for(self.user.name, self.role, Path(self.state), Path(self.source_labs))
            self._cgroups = limit_server(self.user.name, self.server_cpus, self.server_memory, self.server_pids,
                                         list(self.gpus), self.gpu)
            if not self._cgroups:
                self.log.warning("no writable cgroup: %s's server runs without CPU and memory limits", self.user.name)
            else:
                self.log.info("%s's server limits: %s", self.user.name, ", ".join(limits_held(self._cgroups)))
            return await super().start()
        except Exception:
            self._release_gpu()
            raise

    async def stop(self, now=False):
        await super().stop(now=now)
        self._release_gpu()
        remove_cgroup(self.user.name)


def server_env(state: Path, role: str, home: Path, tools: str, library_path: dict, jupyter_path: list[str],
               jupyter_config: str, jupyterlab_dir: str) -> dict[str, str]:
    """The environment of a server, and of what its terminals and kernels run."""
    return {
        **library_path,
        "PATH": f"{tools}:/usr/local/bin:/usr/bin:/bin",
        "LABKIT_HUB_TOOLS": tools,  # a terminal's rc file puts them first again (labkit/course/hub_state.py)
        "JUPYTER_PATH": os.pathsep.join(jupyter_path),
        # the role's own settings first (nbgrader's exchange and course, which extensions load)
        "JUPYTER_CONFIG_PATH": os.pathsep.join([str(state / "jupyter" / role), jupyter_config]),
        "JUPYTERLAB_DIR": jupyterlab_dir,
        "NBGRADER_EXCHANGE": str(state / "exchange"),
        "TORCH_EXTENSIONS_DIR": str(home / ".cache" / "torch_extensions"),
        "PYTHONWARNINGS": "ignore::FutureWarning",
    }
