"""What a hub server may use, held by the kernel of Linux rather than by a variable a student can reset.

Each server runs in a cgroup of its own (``labkit-hub/<user>``), made by the hub as root before the
server starts, and everything the server starts (terminals, kernels, a lab's ranks) stays in it:

* CPU (``cpu.max`` / CFS quota) and memory (``memory.max`` / ``memory.limit_in_bytes``);
* processes and threads (``pids.max``): a fork bomb stops at the limit, not at the machine's;
* devices (cgroup v1 ``devices.deny``; the kernel's "Device Whitelist Controller" document): every
  NVIDIA GPU but the server's own is refused at ``open()``, whatever ``CUDA_VISIBLE_DEVICES`` says.
  Under cgroup v2 the device controller is an eBPF program (systemd's ``DeviceAllow=``), which this
  hub does not load: there the GPU pool is ``CUDA_VISIBLE_DEVICES`` only, and the hub says so.

Where no cgroup can be written (a container without a writable /sys/fs/cgroup) the hub says so once
and runs without limits, as systemd would refuse to.
"""
from __future__ import annotations

import glob
import os
import re
import shutil
import subprocess
from pathlib import Path

CGROUP = Path("/sys/fs/cgroup")
NVIDIA_MAJOR = 195  # the NVIDIA driver's character devices (/dev/nvidiaN; nvidiactl is 255)
V1 = ("cpu", "memory", "pids", "devices")


def cgroup_v2() -> bool:
    return (CGROUP / "cgroup.controllers").is_file()


def cgroup_paths(user: str) -> list[Path]:
    """The folders of ``user``'s cgroup: one under cgroup v2, one per controller under v1."""
    if cgroup_v2():
        return [CGROUP / "labkit-hub" / user]
    return [CGROUP / c / "labkit-hub" / user for c in V1 if (CGROUP / c).is_dir()]


def gpu_minor(gpu: str) -> int | None:
    """The device minor of GPU ``gpu`` (an index): the driver's own record of it where the driver is
    loaded (``/proc/driver/nvidia/gpus/<bus>/information``), else the index itself (the driver's
    numbering on a machine without one; MIG devices have none of their own: None)."""
    if not gpu.isdigit():
        return None
    if shutil.which("nvidia-smi"):
        out = subprocess.run(["nvidia-smi", "--query-gpu=index,pci.bus_id", "--format=csv,noheader"],
                             capture_output=True, text=True)
        for line in out.stdout.splitlines():
            index, bus = (x.strip() for x in line.split(",", 1))
            info = Path("/proc/driver/nvidia/gpus") / bus.lower().removeprefix("0000") / "information"
            for path in (info, Path("/proc/driver/nvidia/gpus") / bus.lower() / "information"):
                if index == gpu and path.is_file():
                    m = re.search(r"Device Minor:\s*(\d+)", path.read_text())
                    if m:
                        return int(m.group(1))
    return int(gpu)


def other_gpus(pool: list[str], own: str) -> list[int]:
    """Minors of every GPU this server must not open: the pool's others and any /dev/nvidiaN."""
    minors = {m for g in pool if g != own and (m := gpu_minor(g)) is not None}
    minors |= {int(p.removeprefix("/dev/nvidia")) for p in glob.glob("/dev/nvidia[0-9]*")
               if p.removeprefix("/dev/nvidia").isdigit()}
    return sorted(minors - {gpu_minor(own) if own else None})


def limit_server(user: str, cpus: float, memory: int, pids: int, pool: list[str], gpu: str) -> list[Path]:
    """Make ``user``'s cgroup with ``cpus`` cores, ``memory`` bytes, ``pids`` tasks and, under v1,
    only GPU ``gpu`` of ``pool`` openable; [] when none can be made."""
    paths = cgroup_paths(user)
    try:
        if cgroup_v2():  # the parent hands its children the controllers
            paths[0].mkdir(parents=True, exist_ok=True)
            (paths[0].parent / "cgroup.subtree_control").write_text("+cpu +memory +pids")
            (paths[0] / "cpu.max").write_text(f"{int(cpus * 100_000)} 100000")
            (paths[0] / "memory.max").write_text(str(memory))
            (paths[0] / "pids.max").write_text(str(pids))
            return paths
        by = {p.parent.parent.name: p for p in paths}
        for p in paths:
            p.mkdir(parents=True, exist_ok=True)
        (by["cpu"] / "cpu.cfs_period_us").write_text("100000")
        (by["cpu"] / "cpu.cfs_quota_us").write_text(str(int(cpus * 100_000)))
        (by["memory"] / "memory.limit_in_bytes").write_text(str(memory))
        if "pids" in by:
            (by["pids"] / "pids.max").write_text(str(pids))
        if "devices" in by:
            # a new cgroup allows every device (its parent's list); each other GPU becomes an exception
            for minor in other_gpus(pool, gpu):
                (by["devices"] / "devices.deny").write_text(f"c {NVIDIA_MAJOR}:{minor} rwm")
    except (OSError, KeyError):
        return []
    return paths


def limits_held(paths: list[Path]) -> list[str]:
    """What a cgroup made by :func:`limit_server` holds, for the hub's log: the missing ones named."""
    names = {p.parent.parent.name for p in paths} if not cgroup_v2() else {"cpu", "memory", "pids"}
    held = [c for c in ("cpu", "memory", "pids") if c in names]
    held.append("devices" if "devices" in names else "devices: CUDA_VISIBLE_DEVICES only (cgroup v2 needs eBPF)")
    return held


def remove_cgroup(user: str) -> None:
    for p in cgroup_paths(user):  # empty once the server's processes are gone
        try:
            p.rmdir()
        except OSError:
            pass


def join_cgroup(paths: list[Path], pid: int | None = None) -> None:
    """Put ``pid`` (this process) into each of ``paths``: what it starts later stays there too."""
    for p in paths:
        (p / "cgroup.procs").write_text(str(pid or os.getpid()))


def exchange_on_its_own_disk(exchange: Path, size: int) -> str | None:
    """Mount a file system of ``size`` bytes at ``exchange`` (an ext4 image beside it, loop-mounted
    ``nosuid,nodev``), so that what students write there fills it and not the disk the hub's
    database is on. What the folder held before is moved in. None when it is mounted (now or
    before); else the reason, for the hub to say once."""
    if os.path.ismount(exchange):
        return None
    image = exchange.with_name("exchange.img")
    if not all(shutil.which(t) for t in ("mkfs.ext4", "mount", "umount")):
        return "mkfs.ext4 or mount is missing"
    fresh = not image.exists()
    staging = exchange.with_name(".exchange-mount")
    try:
        if fresh:
            fd = os.open(image, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
            os.ftruncate(fd, size)  # sparse: the disk is taken as the exchange fills
            os.close(fd)
            _run(["mkfs.ext4", "-q", "-F", "-m", "0", str(image)])
        staging.mkdir(exist_ok=True)
        _run(["mount", "-o", "loop,nosuid,nodev", str(image), str(staging)])
        if fresh:  # the folder's files, owners, modes and links as they are (cp -a follows no link)
            shutil.rmtree(staging / "lost+found", ignore_errors=True)
            _run(["cp", "-a", f"{exchange}/.", str(staging)])
            os.chmod(staging, os.stat(exchange).st_mode & 0o7777)
        _run(["umount", str(staging)])
        _run(["mount", "-o", "loop,nosuid,nodev", str(image), str(exchange)])
    except (OSError, subprocess.CalledProcessError) as e:
        subprocess.run(["umount", str(staging)], capture_output=True)
        if fresh:  # a half-made image would be taken for a made one next time
            image.unlink(missing_ok=True)
        reason = e.stderr.strip().splitlines()[-1] if getattr(e, "stderr", None) else str(e)
        return f"the exchange could not be mounted on its own file system ({reason})"
    finally:
        try:
            staging.rmdir()
        except OSError:
            pass
    return None


def _run(cmd: list[str]) -> None:
    subprocess.run(cmd, check=True, capture_output=True, text=True)
