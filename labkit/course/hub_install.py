"""Where the one-machine hub's programs come from (:mod:`labkit.course.hub`).

* The servers run the course's Python. Where the interpreter behind ``.venv`` is one other users
  may not run (pyenv's under ``/root``), a copy of it goes to ``_build/hub/python`` with ``.venv``'s
  packages on its path, and ``_build/hub/bin`` holds the commands their terminals call.
* The proxy is configurable-http-proxy from the npm registry, pinned, installed into
  ``_build/hub/proxy`` (never globally).
"""
from __future__ import annotations

import json
import os
import shutil
import stat
import subprocess
import sys
import sysconfig
from pathlib import Path

from labkit.core.files import write_whole
from labkit.labs.runner import ROOT

BUILD = ROOT / "_build" / "hub"
PROXY_PACKAGE = "configurable-http-proxy@5.3.0"
PROXY = BUILD / "proxy" / "node_modules" / ".bin" / "configurable-http-proxy"


def readable_by_all(path: Path) -> bool:
    """Whether a user with no group in common may reach ``path`` (every folder above it searchable)."""
    path = Path(path).resolve()
    for p in [*reversed(path.parents), path]:
        mode = p.stat().st_mode
        if not mode & stat.S_IXOTH or (p == path and not mode & stat.S_IROTH):
            return False
    return True


def users_python() -> Path:
    """An interpreter every user may run that imports the course: this one, or its copy (:func:`install`)."""
    if readable_by_all(Path(sys.executable)):
        return Path(sys.executable)
    return BUILD / "python" / "bin" / f"python{sys.version_info.major}.{sys.version_info.minor}"


def _copy_interpreter(exe: Path) -> None:
    """The interpreter behind ``.venv`` copied to ``_build/hub/python``, ``.venv``'s packages on its path."""
    copy = exe.parent.parent
    if not exe.is_file():
        skip = shutil.ignore_patterns("site-packages", "test", "__pycache__", "idlelib", "tkinter", "ensurepip")
        tmp = copy.with_name(f"python.tmp{os.getpid()}")  # two processes copying at once each finish one
        shutil.rmtree(tmp, ignore_errors=True)
        shutil.copytree(Path(sys.base_prefix), tmp, symlinks=True, ignore=skip)
        try:
            tmp.rename(copy)
        except OSError:  # the other one's copy is in place
            shutil.rmtree(tmp)
    site = Path(sysconfig.get_paths(vars={"base": str(copy), "platbase": str(copy)})["purelib"])
    site.mkdir(parents=True, exist_ok=True)
    # addsitedir, not a path line: it also runs .venv's own .pth files (the editable labkit among them)
    # whole: a Python starting meanwhile (the other worker's, a server's) reads all of it or none
    write_whole(site / "labkit-venv.pth", f"import site; site.addsitedir({sysconfig.get_paths()['purelib']!r})\n",
                mode=0o644)  # every user's Python reads it, whatever umask wrote it


def library_path(python: Path) -> dict[str, str]:
    """LD_LIBRARY_PATH for a copied interpreter: its runpath names the original's folder, which other
    users cannot reach, and the loader would find the system's libpython of another patch release."""
    lib = Path(python).parent.parent / "lib"
    return {"LD_LIBRARY_PATH": str(lib)} if Path(python).is_relative_to(BUILD) else {}


def users_tools() -> Path:
    """The users' interpreter (copied first if need be) and ``_build/hub/bin``: python, jupyter,
    nbgrader, alembic (nbgrader's gradebook runs it) and papermill as the users run them. Returns
    the interpreter."""
    python = users_python()
    if python != Path(sys.executable):
        _copy_interpreter(python)
    tools = BUILD / "bin"
    tools.mkdir(parents=True, exist_ok=True)
    env = "".join(f"export {k}={v}; " for k, v in library_path(python).items())
    for name, module in (("python", None), ("python3", None), ("jupyter", "jupyter"), ("nbgrader", "nbgrader"),
                         ("alembic", "alembic"), ("papermill", "papermill")):
        run = f'{env}exec {python} "$@"' if module is None else f'{env}exec {python} -m {module} "$@"'
        write_whole(tools / name, f"#!/bin/sh\n{run}\n", mode=0o755)  # whole, for a server that runs it meanwhile
    return python


def install() -> Path:
    """What the servers run, written once before the hub starts: :func:`users_tools`, the course
    kernel's spec for that interpreter, and the proxy. Returns the interpreter."""
    python = users_tools()
    kernel = BUILD / "share" / "jupyter" / "kernels" / "labkit"
    kernel.mkdir(parents=True, exist_ok=True)
    (kernel / "kernel.json").write_text(json.dumps({
        "argv": [str(python), "-m", "ipykernel_launcher", "-f", "{connection_file}"],
        "display_name": "Python (labkit)", "language": "python", "env": library_path(python),
        "metadata": {"debugger": True}}, indent=1))
    ensure_proxy()
    return python


def server_paths(python: Path) -> dict:
    """Where a server finds what :func:`install` wrote: CourseSpawner's settings."""
    venv_share = Path(sys.prefix) / "share" / "jupyter"
    return {"python": str(python), "tools": str(BUILD / "bin"), "library_path": library_path(python),
            "jupyter_path": [str(BUILD / "share" / "jupyter"), str(venv_share)],
            "jupyter_config": str(Path(sys.prefix) / "etc" / "jupyter"), "jupyterlab_dir": str(venv_share / "lab")}


def ensure_proxy() -> Path:
    if PROXY.is_file():
        return PROXY
    if shutil.which("npm") is None:
        raise SystemExit("error: the hub's proxy comes from npm, which is not installed (apt install nodejs npm)")
    subprocess.run(["npm", "install", "--prefix", str(BUILD / "proxy"), "--no-audit", "--no-fund", "--loglevel=error",
                    PROXY_PACKAGE], check=True)
    return PROXY
