"""Devices and process groups: which device a rank computes on, which backend its collectives use.

CPU ranks talk over gloo; ``device="cuda"`` puts one GPU under each rank and talks over NCCL
(PyTorch docs, "Distributed communication package", backends). A CUDA group is started as
``"cpu:gloo,cuda:nccl"``: NCCL carries the GPU tensors and gloo whatever lives in host memory
(CPU-offloaded FSDP shards, object collectives), so no collective ever finds "no backend for
device type cpu". Nothing here assumes CUDA exists.
"""
from __future__ import annotations

import os
from typing import Any

import torch
import torch.distributed as dist

from labkit.core.checks import one_of, positive_int

DEVICE_TYPES = ("cpu", "cuda")


def cuda_count() -> int:
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def check_device(device: str, world_size: int = 1) -> None:
    """Clear errors for an unknown device type or more CUDA ranks than GPUs."""
    one_of("device", device, DEVICE_TYPES, "devices")
    positive_int("world_size", world_size)
    if device == "cuda" and cuda_count() < world_size:
        n = cuda_count()
        raise ValueError(f"device='cuda' with world_size={world_size} needs {world_size} GPUs, found {n}; "
                         f"use world_size<={n}" + ("" if n else " or device='cpu'"))


def backend_for(device: str) -> str:
    """The process-group backend string for ranks on ``device``."""
    return "cpu:gloo,cuda:nccl" if device == "cuda" else "gloo"


def rank_device(device: str, local_rank: int = 0) -> torch.device:
    """The device this rank computes on (and, on CUDA, makes current)."""
    if device == "cuda":
        torch.cuda.set_device(local_rank)
        return torch.device("cuda", local_rank)
    return torch.device("cpu")


def current_device(device: str) -> torch.device:
    """The ``torch.device`` of a rank that already chose its GPU (``rank_device``)."""
    return torch.device("cuda", torch.cuda.current_device()) if device == "cuda" else torch.device("cpu")


def comm_device() -> torch.device:
    """Where a tensor must live to go through the default group: the rank's GPU under NCCL."""
    if dist.is_available() and dist.is_initialized() and "nccl" in str(dist.get_backend()):
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def synchronize(device: torch.device) -> None:
    """Wait for the device's queued kernels: CUDA runs them asynchronously, so timings must wait."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def rank_and_world() -> tuple[int, int]:
    """``(rank, world_size)`` of the default group, ``(0, 1)`` without one."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def side_group(timeout_s: float | None = None) -> dist.ProcessGroup:
    """A second gloo group over every rank, for traffic that must not interleave with training's
    collectives: an async checkpoint's, a debugging wrapper's. Every rank must call it, in the same
    order (the parallelisms' groups come from :class:`labkit.parallel.layout.mesh.ParallelDims`)."""
    import datetime

    timeout = datetime.timedelta(seconds=timeout_s) if timeout_s else None
    return dist.new_group(backend="gloo", **({"timeout": timeout} if timeout else {}))


def gather_objects(obj: Any, group: dist.ProcessGroup | None = None) -> list[Any]:
    """Every rank's ``obj``, indexed by rank (``[obj]`` without a process group); a collective."""
    if not (dist.is_available() and dist.is_initialized()):
        return [obj]
    out = [None] * dist.get_world_size(group)
    dist.all_gather_object(out, obj, group=group)
    return out


THREADS_ENV = "LABKIT_THREADS"  # the ci profile sets 1: its sums then add in the same order on any host


def share_cores(local_ranks: int) -> None:
    """N ranks on one host, each defaulting to every core, oversubscribe the CPU badly: each gets its
    share, or ``$LABKIT_THREADS`` threads where that is set."""
    fixed = os.environ.get(THREADS_ENV, "")  # empty: unset (a job script's unset variable)
    torch.set_num_threads(env_int(THREADS_ENV, low=1, high=4096) if fixed
                          else max(1, (os.cpu_count() or 1) // local_ranks))


def env_int(name: str, default: int | None = None, low: int = 0, high: int = 2**31 - 1) -> int:
    """The whole number in environment variable ``name`` (``default`` when unset), at least ``low``;
    a ValueError naming the variable otherwise."""
    text = os.environ.get(name)
    if text is None:
        if default is None:
            raise ValueError(f"{name} is not set but RANK is: torchrun sets both; set {name} to the number of ranks")
        return default
    try:
        value = int(text)
    except ValueError:
        raise ValueError(f"{name}={text!r} must be a whole number") from None
    if not low <= value <= high:
        raise ValueError(f"{name}={value if abs(value) < 10**20 else text[:12] + '...'} must be at least {low}"
                         + (f" and at most {high}" if value > high else ""))
    return value


def torchrun_env() -> tuple[int, int, int, int]:
    """``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``LOCAL_WORLD_SIZE`` (0 when unset) as torchrun sets
    them, checked: a ValueError naming the variable (a rank outside the world would wait for ever)."""
    rank, world = env_int("RANK"), env_int("WORLD_SIZE", low=1)
    if rank >= world:
        raise ValueError(f"RANK={rank} is outside WORLD_SIZE={world}: ranks are 0..{world - 1}")
    local_rank = env_int("LOCAL_RANK", 0)
    # DeepSpeed's launcher sets no LOCAL_WORLD_SIZE: then this node's ranks are unknown, the world at most
    local_world = env_int("LOCAL_WORLD_SIZE", 0, low=1) if "LOCAL_WORLD_SIZE" in os.environ else 0
    if local_world and local_rank >= local_world:
        raise ValueError(f"LOCAL_RANK={local_rank} is outside LOCAL_WORLD_SIZE={local_world}")
    return rank, world, local_rank, local_world


def available_bytes(device: str, index: int = 0) -> int | None:
    """What one rank may allocate: GPU ``index``'s memory on ``cuda``, the machine's ``MemAvailable``
    on ``cpu`` (shared by the ranks on the node); None where it cannot be read."""
    if device == "cuda":
        ok = torch.cuda.is_available() and index < torch.cuda.device_count()
        return torch.cuda.get_device_properties(index).total_memory if ok else None
    try:
        with open("/proc/meminfo") as f:
            line = next(ln for ln in f if ln.startswith("MemAvailable:"))
        return int(line.split()[1]) * 1024
    except (OSError, StopIteration, ValueError):
        return None
