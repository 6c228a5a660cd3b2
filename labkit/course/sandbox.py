"""Autograde's kernels in a sandbox: a student's code runs where it can harm nothing but its own copy.

nbgrader runs each submission in a kernel of the grader's own user, and its FAQ says plainly that it
does not protect against unsafe code ("Does nbgrader protect against unsafe code? Not yet",
jupyter/nbgrader#483). A submitted cell graded that way can read the sources and hidden tests, rewrite the
course's ``nbgrader_config.py`` (which every later nbgrader command runs), leave a process behind that
edits the gradebook, and read the grader's server token from its environment.

:class:`SandboxedKernelManager` (autograde's, by :mod:`labkit.course.grading_config`) starts each kernel in
bubblewrap (``bwrap``, the sandbox Flatpak uses; bwrap(1)) with new user, pid, network, IPC and UTS
namespaces:

* the file system is the machine's, read-only, with the grader's home, the course directory, the
  exchange, ``/root``, ``/run``, ``/srv``, ``/mnt`` and ``/media`` hidden behind empty read-only
  folders, and ``/tmp`` an empty scratch space in memory; the course's code and Python are bound
  back, read-only;
* the notebook's folder is a copy of that one submission, in memory, capped in size, gone afterwards;
* no network (a loopback of its own, so the labs' ranks still meet), no host processes in view;
* the environment is a short list of harmless variables: no token, no ``JUPYTERHUB_*``;
* the kernel is pid 1's only child in its pid namespace: when it ends (or nbgrader kills it), the
  kernel of Linux kills every process it left (pid_namespaces(7));
* the kernel talks to nbgrader over unix sockets in a private folder (ZeroMQ ``ipc``), the only
  place on disk it can write, each file there capped at ``file_size_limit``.

Where bwrap is missing or the machine refuses user namespaces, the kernel does not start and the
grader is told why in one line: a submission is never run unconfined by accident.
"""
from __future__ import annotations

import glob
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from jupyter_client.manager import AsyncKernelManager
from traitlets import Integer, List, Unicode

ROOT = Path(__file__).resolve().parent.parent.parent
HIDDEN = ("/home", "/root", "/tmp", "/var/tmp", "/run", "/srv", "/mnt", "/media")
SCRATCH = ("/tmp", "/var/tmp")
# what a kernel may see of the grader's environment: nothing that names or authenticates anyone
KEPT_ENV = ("PATH", "LANG", "LANGUAGE", "TZ", "TERM", "LD_LIBRARY_PATH", "OMP_NUM_THREADS", "MKL_NUM_THREADS",
            "CUDA_VISIBLE_DEVICES", "PYTHONWARNINGS", "PYTHONHASHSEED", "MPLBACKEND")
KEPT_PREFIXES = ("LC_", "LABKIT_", "NBGRADER_CELL", "TORCH_", "CUBLAS_", "NCCL_")


def _read(path: str) -> str:
    try:
        return Path(path).read_text()
    except OSError:
        return ""


def _ignore_sigint() -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)


class SandboxRefused(RuntimeError):
    """bwrap cannot start a sandbox here; the message says why and what would fix it."""


def sandbox_env(env: dict[str, str], home: str) -> dict[str, str]:
    """The grader's environment cut to :data:`KEPT_ENV` and :data:`KEPT_PREFIXES`, with ``HOME`` the
    sandbox's own folder. ``JPY_PARENT_PID`` goes too: inside the pid namespace the kernel's parent
    is bwrap's pid 1, and ipykernel would take the parent it was told of for dead."""
    kept = {k: v for k, v in env.items() if k in KEPT_ENV or k.startswith(KEPT_PREFIXES)}
    return {**kept, "HOME": home, "USER": "grader", "PYTHONDONTWRITEBYTECODE": "1"}


def _readable_roots(kernel_cmd: list[str]) -> list[str]:
    """Folders a kernel needs to read even where they lie under a hidden one: the course's checkout
    and the Python prefixes of the grader and of the kernel's interpreter."""
    python = os.path.realpath(shutil.which(kernel_cmd[0]) or kernel_cmd[0])
    roots = {str(ROOT), sys.prefix, sys.base_prefix, os.path.realpath(sys.prefix), str(Path(python).parent.parent)}
    return sorted(r for r in roots if os.path.isdir(r))


def check_bwrap(bwrap: str) -> None:
    """Start an empty sandbox once, so a machine that cannot is named before any kernel is."""
    if not shutil.which(bwrap):
        raise SandboxRefused(f"autograde runs students' code in a sandbox and {bwrap!r} is not installed "
                             "(apt install bubblewrap); see book/instructors.md, 'What the hub guarantees'")
    out = subprocess.run([bwrap, "--ro-bind", "/", "/", "--unshare-all", "--dev", "/dev", "--proc", "/proc",
                          "true"], capture_output=True, text=True)
    if out.returncode:
        reason = (out.stderr.strip().splitlines() or ["no reason given"])[-1]
        raise SandboxRefused(f"autograde's sandbox cannot start here ({reason}): this machine or container "
                             "refuses unprivileged user namespaces; see book/instructors.md")


class SandboxedKernelManager(AsyncKernelManager):
    """An :class:`jupyter_client.manager.AsyncKernelManager` (nbclient's own: a blocking one would stall
    its event loop, and a cell's timeout with it) whose kernels run in bubblewrap (see the module)."""

    bwrap = Unicode("bwrap", help="the bubblewrap executable").tag(config=True)
    hide = List(Unicode(), help="more folders to hide from the kernel, beside the grader's home, the "
                                "course directory and the exchange").tag(config=True)
    size_limit = Integer(512 << 20, help="bytes the kernel may write in its notebook's folder, and in /tmp").tag(
        config=True)
    file_size_limit = Integer(64 << 20, help="bytes of any one file the kernel writes (RLIMIT_FSIZE)").tag(
        config=True)

    _box: str | None = None

    async def _async_pre_start_kernel(self, **kw: Any):
        check_bwrap(self.bwrap)
        self._box = tempfile.mkdtemp(prefix="labkit-grade-")
        os.chmod(self._box, 0o700)
        self.transport = "ipc"  # unix sockets: the kernel has no network to bind a port on
        self.ip = os.path.join(self._box, "kernel")
        self.connection_file = os.path.join(self._box, "kernel.json")
        return await super()._async_pre_start_kernel(**kw)

    def _configured(self, section: str, key: str) -> str | None:
        return self.config[section].get(key) if section in self.config else None

    def _hidden(self) -> list[str]:
        course = self._configured("CourseDirectory", "root") or os.getcwd()  # nbgrader's default: where it runs
        exchange = self._configured("Exchange", "root") or os.environ.get("NBGRADER_EXCHANGE")
        paths = [*HIDDEN, os.path.expanduser("~"), course, exchange, os.environ.get("LABKIT_HUB_STATE"), *self.hide]
        return sorted({os.path.realpath(p) for p in paths if p and os.path.isdir(p) and os.path.realpath(p) != "/"})

    def sandbox_command(self, kernel_cmd: list[str], cwd: str) -> tuple[list[str], list[int]]:
        """bwrap's arguments around ``kernel_cmd``, with the notebook's folder ``cwd`` copied in as the
        kernel's own, and the descriptors of the files copied (bwrap reads them: ``--file FD DEST``)."""
        cwd = os.path.realpath(cwd)
        size = str(self.size_limit)
        args = ["prlimit", f"--fsize={self.file_size_limit}", "--", self.bwrap, "--unshare-all", "--die-with-parent",
                "--ro-bind", "/", "/"]
        for path in self._hidden():
            args += ["--size", size, "--tmpfs", path]
        for path in _readable_roots(kernel_cmd):
            args += ["--ro-bind", path, path]
        args += ["--dev", "/dev", "--size", size, "--tmpfs", "/dev/shm", "--proc", "/proc"]
        for dev in sorted(glob.glob("/dev/nvidia*")) + sorted(glob.glob("/dev/dri")):  # the GPUs the grader has
            args += ["--dev-bind-try", dev, dev]
        args += ["--size", size, "--tmpfs", cwd]  # the notebook's folder, in memory
        fds = []
        for folder, dirs, files in os.walk(cwd):  # nbgrader's copy of the submission (collected as data)
            for d in dirs:
                args += ["--dir", os.path.join(folder, d)]
            for f in files:
                try:
                    fd = os.open(os.path.join(folder, f), os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
                except OSError:  # a link or a file gone: not part of what is graded
                    continue
                fds.append(fd)
                args += ["--file", str(fd), os.path.join(folder, f)]
        # empty and read-only where the grader's files were: a write there fails as it would on a disk
        # it may not touch, rather than vanish with the sandbox; /tmp stays the kernel's scratch
        args += [a for path in self._hidden() if path not in SCRATCH for a in ("--remount-ro", path)]
        # no network, so no DNS: names are the hosts file's alone. Asked over DNS, glibc reports a peer's
        # name (torch.distributed's store asks for ::ffff:127.0.0.1) as a temporary failure, torch warns
        # on stderr, and nbgrader grades a test cell that wrote to stderr as failed
        hosts, nsswitch = os.path.join(self._box, "hosts"), os.path.join(self._box, "nsswitch.conf")
        with open(hosts, "w") as f:
            f.write(_read("/etc/hosts") + f"\n127.0.0.1 localhost {socket.gethostname()}\n::1 localhost ip6-localhost\n")
        with open(nsswitch, "w") as f:
            lines = [x for x in _read("/etc/nsswitch.conf").splitlines() if not x.startswith("hosts:")]
            f.write("\n".join([*lines, "hosts: files", ""]))
        args += ["--ro-bind", hosts, "/etc/hosts", "--ro-bind", nsswitch, "/etc/nsswitch.conf"]
        args += ["--bind", self._box, self._box, "--chdir", cwd, "--", *kernel_cmd]
        return args, fds

    async def _async_launch_kernel(self, kernel_cmd: list[str], **kw: Any) -> None:
        cwd = kw.get("cwd") or os.getcwd()
        kw["env"] = sandbox_env(kw.get("env") or dict(os.environ), cwd)
        kw["independent"] = True  # no JPY_PARENT_PID: in its pid namespace the kernel's parent is pid 1
        # bwrap must outlive an interrupt: nbgrader interrupts a cell by SIGINT to the kernel's process
        # group, and bwrap would die of it (and take the kernel along). An ignored SIGINT survives exec;
        # ipykernel installs its own handler while a cell runs.
        kw["preexec_fn"] = _ignore_sigint
        cmd, kw["pass_fds"] = self.sandbox_command(kernel_cmd, cwd)
        try:
            await super()._async_launch_kernel(cmd, **kw)
        finally:
            for fd in kw["pass_fds"]:
                os.close(fd)

    async def _async_cleanup_resources(self, restart: bool = False) -> None:
        await super()._async_cleanup_resources(restart=restart)
        if self._box and not restart:
            shutil.rmtree(self._box, ignore_errors=True)
            self._box = None
