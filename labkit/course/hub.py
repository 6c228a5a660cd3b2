"""A JupyterHub for a class on one machine: ``make hub`` (book/instructors.md walks a term through it).

Everything the hub keeps lives in one state folder (``--state``, default ``/srv/labkit-hub``):
``roster.json`` (who is a student, who an instructor), JupyterHub's database and cookie secret,
nbgrader's exchange (``exchange/``, sticky and writable by all: nbgrader gives each submission and
feedback its owner's permissions) and the course directory (``course/``: sources, releases,
submissions and the gradebook, readable and writable by the instructors' group only). People are the
machine's own unix users with their own passwords and homes (PAM), so the filesystem keeps each
student's work their own; stopping and starting the hub loses nothing.

    python -m labkit.course.hub add --role instructor teach        (as root; --password-stdin reads one)
    python -m labkit.course.hub add --role student alice bob
    python -m labkit.course.hub serve --port 8000 --gpus all       (make hub HUB_OPTS="--gpus all")

The state folder and the roster: :mod:`labkit.course.hub_state`; who may log in and what each server
gets: :mod:`labkit.course.hub_spawner`; the proxy and the
users' Python: :mod:`labkit.course.hub_install`.
"""
from __future__ import annotations

import ipaddress
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

from labkit.core.checks import brief, output_dir
from labkit.core.cli import ArgumentParser
from labkit.core.ports import is_free, listen_port
from labkit.course.hub_install import PROXY, install, readable_by_all, server_paths, users_python
from labkit.course.hub_state import ROLES, _root_only, _save_settings, _settings, add_users, prepare_state
from labkit.labs.runner import LABS_DIR, ROOT

CONFIG_FILE = ROOT / "cluster" / "hub" / "jupyterhub_config.py"


def terminal_env(state: Path, user: str) -> dict[str, str]:
    """The environment the hub gives ``user``'s server, and so their terminals and kernels."""
    import pwd

    from labkit.course.hub_spawner import role_of, server_env

    home = Path(pwd.getpwnam(user).pw_dir)
    paths = server_paths(users_python())
    return {"HOME": str(home), "USER": user, **server_env(Path(state), role_of(Path(state), user) or "student", home,
                                                         **{k: v for k, v in paths.items() if k != "python"})}


def _running_hub(state: Path) -> int | None:
    """The pid of a JupyterHub still running on ``state`` (its pid file names a live one), if any."""
    try:
        pid = int((state / "jupyterhub.pid").read_text())
        alive = b"jupyterhub" in Path(f"/proc/{pid}/cmdline").read_bytes()
    except (OSError, ValueError):
        return None
    return pid if alive and pid != os.getpid() else None


def _hub_port(state: Path, taken: tuple[int, ...]) -> int:
    """The hub's API port: a free one, chosen once and kept in hub.json. A server that a restarted hub
    finds running (``cleanup_servers=False``) calls the API address it was started with; on a new
    port it would lose the hub once its token cache expires (5 minutes)."""
    s = _settings(state)
    kept = s.get("hub_port")
    valid = isinstance(kept, int) and not isinstance(kept, bool) and 1024 <= kept < 65536
    for _ in range(30 if valid else 0):  # the hub being replaced may still hold it for a moment
        if is_free(kept) and kept not in taken:
            return kept
        time.sleep(0.5)
    if valid and (pid := _running_hub(state)):
        sys.exit(f"hub: a hub is still running on {state} (pid {pid}); stop it before starting another")
    if kept is not None:
        why = "taken" if valid else "not a port from 1024 to 65535"
        print(f"hub: hub.json's hub_port {kept!r} is {why}; a new one is kept, and servers still running must be "
              "restarted", file=sys.stderr)
    port = listen_port(avoid=taken)
    _save_settings(state, {**s, "hub_port": port})
    return port


def configure(c, state: Path) -> None:
    """JupyterHub's configuration (``cluster/hub/jupyterhub_config.py`` calls this)."""
    state = Path(state)
    s = _settings(state)
    c.JupyterHub.bind_url = f"http://{s['ip']}:{s['port']}"
    c.JupyterHub.hub_ip = "127.0.0.1"
    c.JupyterHub.hub_port = _hub_port(state, taken=(s["port"],))
    # only the hub calls the proxy's API: a new port at each start is harmless
    proxy_api = listen_port(avoid=(s["port"], c.JupyterHub.hub_port))
    c.ConfigurableHTTPProxy.api_url = f"http://127.0.0.1:{proxy_api}"
    c.JupyterHub.db_url = f"sqlite:///{state / 'jupyterhub.sqlite'}"
    c.JupyterHub.cookie_secret_file = str(state / "jupyterhub_cookie_secret")
    c.JupyterHub.pid_file = str(state / "jupyterhub.pid")
    c.ConfigurableHTTPProxy.command = [str(PROXY)]
    c.ConfigurableHTTPProxy.pid_file = str(state / "proxy.pid")
    c.JupyterHub.authenticator_class = "labkit.course.hub_spawner.CourseAuthenticator"
    c.CourseAuthenticator.state = str(state)
    c.Authenticator.any_allow_config = True  # the roster is the allow list (CourseAuthenticator)
    c.JupyterHub.spawner_class = "labkit.course.hub_spawner.CourseSpawner"
    c.CourseSpawner.state = str(state)
    for trait, value in server_paths(users_python()).items():  # serve() installed them
        setattr(c.CourseSpawner, trait, value)
    c.CourseSpawner.source_labs = str(LABS_DIR)
    c.CourseSpawner.gpus = s["gpus"]
    c.CourseSpawner.server_cpus = s["cpus"]
    c.CourseSpawner.server_memory = s["memory"]
    c.CourseSpawner.server_pids = s.get("pids", 2048)
    c.JupyterHub.cleanup_servers = False  # a restarted hub finds the servers running, kernels and all
    c.Spawner.default_url = "/lab"
    c.Spawner.notebook_dir = "~"
    c.Spawner.http_timeout = c.Spawner.start_timeout = 120  # a loaded machine starts JupyterLab slowly


# A MIG slice under this holds none of the labs' gpu profiles, which are sized for a whole GPU (GPT-2
# small with batch 8 x 1024; the inside_device lab's 262,144 x 4,096 bf16 tensors are 2 GiB each)
MIG_GPU_PROFILE_GB = 40


def _gpu_pool(value: str) -> list[str]:
    if value == "none":
        return []
    if value == "all":
        return _visible_gpus()
    pool = [g.strip() for g in value.split(",")]
    index = lambda g: g.isascii() and g.isdigit() and int(g) < 1024  # noqa: E731 ('²'.isdigit() is True)
    if not all(index(g) or g.startswith(("GPU-", "MIG-")) for g in pool) or len(set(pool)) != len(pool):
        raise ValueError(f"--gpus={brief(value)}: give all, none, or distinct GPU indices / GPU- or MIG- UUIDs, "
                         "comma-separated")
    return pool


def _visible_gpus() -> list[str]:
    """``--gpus all``: the GPUs this hub may give out, as CUDA_VISIBLE_DEVICES names them to a server.

    The hub's own allocation when it has one (Slurm and Kubernetes set its CUDA_VISIBLE_DEVICES: the
    node's other GPUs are someone else's); else ``nvidia-smi -L``'s GPUs by UUID, and a GPU in MIG mode
    as its slices (a parent's index would give every server the whole GPU, or none). UUIDs, not
    indices: nvidia-smi numbers GPUs in PCI order, CUDA by default fastest first."""
    given = os.environ.get("CUDA_VISIBLE_DEVICES")
    if given is not None:
        return [g.strip() for g in given.split(",") if g.strip() not in ("", "-1", "NoDevFiles")]
    try:
        out = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=60) \
            if shutil.which("nvidia-smi") else None
    except subprocess.TimeoutExpired:
        out = None
    pool: list[str] = []
    for line in out.stdout.splitlines() if out and out.returncode == 0 else []:
        found = re.search(r"\(UUID: ((GPU|MIG)-[^)\s]+)\)", line)
        if found and found.group(2) == "MIG" and pool and pool[-1].startswith("GPU-"):
            pool.pop()  # the slices listed under their GPU replace it
        pool += [found.group(1)] if found else []
    small = sorted({float(m) for m in re.findall(r"MIG \d+g\.(\d+)gb", out.stdout if out else "")
                    if float(m) < MIG_GPU_PROFILE_GB})
    if small:
        print(f"hub: MIG slices of {', '.join(f'{g:g}' for g in small)} GB in the pool: the labs' gpu profiles need "
              f"a whole GPU (about {MIG_GPU_PROFILE_GB} GB); on a slice, run the ci or cpu profile", file=sys.stderr)
    return pool


def _memory(value: str) -> int:
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}
    try:
        n = float(value[:-1]) * units[value[-1].upper()] if value[-1:].upper() in units else float(value)
    except ValueError:
        n = float("nan")
    if not 64 << 20 <= n <= 1 << 50:
        raise ValueError(f"--memory={brief(value)}: give bytes per server between 64M and 1024T, e.g. 8G")
    return int(n)


def main(argv: list[str] | None = None) -> int:
    ap = ArgumentParser(prog="python -m labkit.course.hub", description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="command", required=True)
    for p in (add := sub.add_parser("add", help="enrol unix users (made if missing)")), \
             (srv := sub.add_parser("serve", help="run the hub (stop with Ctrl-C; state is kept)")):
        p.add_argument("--state", default=os.environ.get("HUB_STATE") or "/srv/labkit-hub",
                       help="the folder the hub keeps everything in (default: $HUB_STATE, else /srv/labkit-hub)")
    add.add_argument("--role", choices=ROLES, required=True)
    add.add_argument("--password-stdin", action="store_true", help="set the users' password from standard input")
    add.add_argument("names", nargs="+")
    srv.add_argument("--ip", default="127.0.0.1", help="address to listen on (0.0.0.0: every interface)")
    srv.add_argument("--port", type=int, default=8000)
    srv.add_argument("--gpus", default="all", help="the pool, one per server: all, none, or 0,1,... / MIG-UUIDs")
    srv.add_argument("--cpus", type=float, default=2.0, help="cores per server")
    srv.add_argument("--memory", default="8G", help="memory per server, e.g. 8G")
    srv.add_argument("--pids", type=int, default=2048, help="processes and threads per server")
    args = ap.parse_args(argv)
    try:
        if os.geteuid() != 0:
            raise ValueError("the hub makes unix users and starts servers as them: run it as root")
        if not readable_by_all(ROOT):
            raise ValueError(f"the checkout {ROOT} is not readable by other users, whose servers run the course "
                             "from it: clone it under /opt or /srv")
        state = output_dir("--state", args.state)
        _root_only(state)
        if args.command == "add":
            bad = [n for n in args.names if not re.fullmatch(r"[a-z_][a-z0-9_-]{0,31}", n)]
            if bad:
                raise ValueError(f"names={brief(bad)}: a unix user name (a lower-case letter, then letters, "
                                 "digits, - or _; at most 32)")
            add_users(state, args.role, args.names, sys.stdin.readline().rstrip("\n") if args.password_stdin else None)
            return 0
        try:
            ipaddress.ip_address(args.ip)
        except ValueError:
            raise ValueError(f"--ip={brief(args.ip)}: give an IP address, e.g. 127.0.0.1 or 0.0.0.0") from None
        if not 0 < args.port < 65536:
            raise ValueError(f"--port={args.port}: give 1 to 65535")
        if not 0.1 <= args.cpus <= 4096:
            raise ValueError(f"--cpus={args.cpus}: give 0.1 to 4096 cores per server")
        if not 64 <= args.pids <= 1 << 22:
            raise ValueError(f"--pids={args.pids}: give 64 to 4194304 processes and threads per server")
        settings = {"ip": args.ip, "port": args.port, "gpus": _gpu_pool(args.gpus), "cpus": args.cpus,
                    "memory": _memory(args.memory), "pids": args.pids}
    except ValueError as e:
        ap.error(str(e))
    serve(state, settings)
    return 0


def serve(state: Path, settings: dict) -> None:
    """Start JupyterHub (this process becomes it) on ``state`` with the checked ``settings``."""
    prepare_state(state)
    _save_settings(state, {**_settings(state), **settings})
    install()
    env = {**os.environ, "LABKIT_HUB_STATE": str(state.resolve())}
    os.umask(0o077)  # what JupyterHub creates in the state folder (its database) is root's alone
    print(f"hub: http://{settings['ip']}:{settings['port']}/ state: {state} GPUs: {settings['gpus'] or 'none (CPU)'}",
          flush=True)
    os.chdir(state)
    os.execve(sys.executable, [sys.executable, "-m", "jupyterhub", "-f", str(CONFIG_FILE)], env)


if __name__ == "__main__":
    sys.exit(main())
