"""Run a lab function on a Slurm cluster from a notebook, and get every rank's result back.

``launch_slurm(fn, *args, nodes=2, tasks_per_node=2)`` is :func:`labkit.launch.launch_local` for a
cluster: it submits one job through submitit (Facebook Research's ``submitit``, which pickles the
function with cloudpickle, runs it under ``srun`` as one task per rank and pickles each task's
return value back), forms the process group on every task from Slurm's own variables, and returns
the results indexed by rank. The notebook blocks with a progress line until the job ends; a task
that raises makes it raise :class:`labkit.launch.RankError` with that task's traceback.

It needs a JupyterHub (or login node) that can run ``sbatch``, and a filesystem shared with the
compute nodes for ``folder`` and the Python environment (``sys.executable`` runs on the nodes).
"""
from __future__ import annotations

import inspect
import logging
import os
import shlex
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable

import torch.distributed as dist

from labkit.core.checks import one_of, positive_int
from labkit.core.devices import DEVICE_TYPES, backend_for, rank_device
from labkit.core.files import write_whole
from labkit.core.ports import listen_port
from labkit.launch.local import RankError, eager_init, leave_group


def _head_address(nodelist: str) -> str:
    """The first node's address. Its hostname when that resolves, else Slurm's ``NodeAddr``
    (a cluster emulated on one host names its nodes n1, n2 that DNS does not know)."""
    head = subprocess.run(["scontrol", "show", "hostnames", nodelist], capture_output=True, text=True,
                          check=True).stdout.split()[0]
    try:
        socket.getaddrinfo(head, None)
        return head
    except socket.gaierror:
        out = subprocess.run(["scontrol", "show", "node", head, "-o"], capture_output=True, text=True,
                             check=True).stdout
        return next((f.split("=", 1)[1] for f in out.split() if f.startswith("NodeAddr=")), head)


def _rendezvous_port(folder: Path, job_id: str, rank: int, timeout: float = 300.0) -> int:
    """A port rank 0 found free on the head node, published to the other tasks through the job's
    shared folder. (A port derived from the job id, 20000 + id % 20000, is shared by two jobs whose
    ids differ by 20000, and the second job's ranks would join the first job's store.)"""
    path = folder / f"{job_id}_rendezvous_port"
    if rank == 0:
        port = listen_port("")
        write_whole(path, str(port))  # whole or absent: a reader never sees half a number
        return port
    deadline = time.monotonic() + timeout
    while not path.exists():
        if time.monotonic() > deadline:
            raise TimeoutError(f"rank {rank}: rank 0 of job {job_id} published no rendezvous port in {path} "
                               f"within {timeout:.0f} s (is {folder} shared by every node?)")
        time.sleep(0.2)
    return int(path.read_text())


def _task(fn: Callable, args: tuple, kwargs: dict, device: str, folder: str) -> Any:
    """Runs in every Slurm task: join the group from Slurm's variables, call ``fn``, leave."""
    env = os.environ
    rank, world, local = int(env["SLURM_PROCID"]), int(env["SLURM_NTASKS"]), int(env["SLURM_LOCALID"])
    port = _rendezvous_port(Path(folder), env["SLURM_JOB_ID"], rank)
    env.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(local),
               LOCAL_WORLD_SIZE=env.get("SLURM_NTASKS_PER_NODE", "1").split("(")[0],
               MASTER_ADDR=_head_address(env["SLURM_JOB_NODELIST"]), MASTER_PORT=str(port), LABKIT_DEVICE=device)
    rank_device(device, local)
    dist.init_process_group(backend_for(device), **eager_init(device, local))
    try:
        result = fn(*args, **kwargs)
    except BaseException:
        leave_group(clean=False)
        raise
    leave_group()
    return result


def check_slurm_options(slurm: dict, world_size: int) -> dict:
    """``launch``'s ``slurm`` dict, checked, with ``tasks_per_node`` filled in from ``world_size``.

    A misspelt key would otherwise reach :func:`launch_slurm`'s ``**kwargs`` and so the lab
    function, and fail only on the compute nodes, after the job waited in the queue.
    """
    if not isinstance(slurm, dict):
        raise TypeError(f"slurm must be a dict of launch_slurm options, got {type(slurm).__name__}")
    valid = list(SLURM_OPTIONS)
    unknown = sorted(set(slurm) - set(valid))
    if unknown:
        hint = {"device": "pass device= to launch itself", "timeout": "pass timeout= to launch itself"}
        notes = "; ".join(f"{k}: {hint[k]}" for k in unknown if k in hint)
        raise ValueError(f"slurm={{...}} has unknown option(s) {unknown}; valid options: {valid}"
                         + (f" ({notes})" if notes else ""))
    opts = dict(slurm)
    positive_int("nodes", opts.setdefault("nodes", 1))
    positive_int("world_size", world_size)
    opts.setdefault("tasks_per_node", world_size // opts["nodes"])
    if opts["nodes"] * opts["tasks_per_node"] != world_size:
        raise ValueError(f"world_size={world_size} must equal slurm nodes x tasks_per_node "
                         f"({opts['nodes']} x {opts['tasks_per_node']})")
    return opts


RESULT_GRACE_S = 15.0  # how long results may lag behind a job's end on a shared filesystem


def _left_the_queue(job_id: str) -> bool:
    """Whether Slurm no longer lists the job (it ended, whatever its state; ``sacct`` may be off)."""
    out = subprocess.run(["squeue", "--noheader", "--jobs", str(job_id), "--format", "%i"], capture_output=True,
                         text=True)
    return out.returncode == 0 and not out.stdout.strip() or "Invalid job id" in out.stderr


def launch_slurm(fn: Callable, *args: Any, nodes: int = 1, tasks_per_node: int = 2, device: str = "cpu",
                 partition: str | None = None, time_min: int = 30, cpus_per_task: int | None = None,
                 folder: str | os.PathLike = "_build/slurm", timeout: float | None = None,
                 poll_s: float = 1.0, slurm_extra: dict | None = None, **kwargs: Any) -> list[Any]:
    """Run ``fn(*args, **kwargs)`` on ``nodes * tasks_per_node`` ranks of a Slurm job; results by rank.

    ``device="cuda"`` asks for one GPU per task (``--gpus-per-node=tasks_per_node``) and NCCL.
    ``slurm_extra`` passes further sbatch options (e.g. ``{"account": "myproj", "qos": "high"}``).
    """
    for name, v in (("nodes", nodes), ("tasks_per_node", tasks_per_node), ("time_min", time_min)):
        positive_int(name, v)
    one_of("device", device, DEVICE_TYPES, "devices")
    try:
        import submitit
    except ImportError as e:
        raise RuntimeError(f"launch_slurm needs submitit: install the pinned requirements ({e})") from None
    if subprocess.run(["which", "sbatch"], capture_output=True).returncode != 0:
        raise RuntimeError("launch_slurm needs Slurm's sbatch on PATH (a login node or a JupyterHub that "
                           "submits to Slurm); on a single machine use labkit.launch.launch")
    folder = Path(folder).resolve()
    folder.mkdir(parents=True, exist_ok=True)
    # submitit polls sacct and warns on every call where accounting is off (a one-host cluster)
    logging.getLogger("submitit").setLevel(logging.ERROR)
    ex = submitit.SlurmExecutor(folder=folder, python=shlex.quote(sys.executable))  # a command line
    params: dict[str, Any] = dict(nodes=nodes, ntasks_per_node=tasks_per_node, time=time_min,
                                  cpus_per_task=cpus_per_task or max(1, (os.cpu_count() or 2) // tasks_per_node),
                                  setup=[f"cd {shlex.quote(str(Path.cwd()))}"], stderr_to_stdout=True)
    if partition:
        params["partition"] = partition
    if device == "cuda":
        params["gpus_per_node"] = tasks_per_node
    params.update(slurm_extra or {})
    ex.update_parameters(**params)
    job = ex.submit(_task, fn, args, kwargs, device, str(folder))
    start, last, gone = time.monotonic(), None, None
    while not job.done():
        state = job.state
        if state != last:
            print(f"[slurm] job {job.job_id}: {state} ({nodes} node(s) x {tasks_per_node} task(s))", flush=True)
            last = state
        if _left_the_queue(job.job_id):  # ended; its results may take a moment on a shared filesystem
            gone = gone or time.monotonic()
            if time.monotonic() - gone > RESULT_GRACE_S:
                raise RuntimeError(f"Slurm job {job.job_id} ended ({state}) without a result from its tasks; "
                                   f"its log says why: {job.paths.stdout}")
        if timeout is not None and time.monotonic() - start > timeout:
            job.cancel()
            raise TimeoutError(f"Slurm job {job.job_id} did not finish within timeout={timeout} s (last state: "
                               f"{state}; `scontrol show job {job.job_id}` says why a job is pending); cancelled")
        time.sleep(poll_s)
    failures = {}
    results = []
    for rank, sub in enumerate(job.task(i) for i in range(nodes * tasks_per_node)):
        try:
            results.append(sub.result())
        except Exception as e:  # submitit re-raises the task's exception with its traceback text
            failures[rank] = f"{type(e).__name__}: {e}\n(log: {sub.paths.stdout})"
    if failures:
        raise RankError(failures)
    print(f"[slurm] job {job.job_id}: done in {time.monotonic() - start:.0f} s", flush=True)
    return results


# The keys launch(..., slurm={...}) accepts: launch_slurm's keyword parameters, less device and
# timeout, which launch passes itself.
SLURM_OPTIONS = tuple(p.name for p in inspect.signature(launch_slurm).parameters.values()
                      if p.kind is p.KEYWORD_ONLY and p.name not in ("device", "timeout"))
