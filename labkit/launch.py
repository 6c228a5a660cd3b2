"""Run a labkit function on N ranks from a notebook or a script, and get each rank's result back.

``launch(fn, world_size=2)`` starts ``world_size`` processes (``torch.multiprocessing`` with the
*spawn* start method, as torchrun's workers are fresh interpreters too), forms a process group over a
``TCPStore`` that the caller hosts on a free port it picked, calls ``fn(*args, **kwargs)`` on every
rank and returns the list of results, indexed by rank. CPU ranks use gloo; ``device="cuda"`` uses
NCCL with one GPU per rank (PyTorch docs, "Distributed communication package", backends).

A rank that raises makes ``launch`` raise :class:`RankError` carrying that rank's traceback; the other
ranks are terminated and every child is reaped, so no process outlives the call. On a cluster the
same functions run under ``torchrun`` through :func:`init_from_env` (see ``labkit.train``).
"""
from __future__ import annotations

import os
import pickle
import queue as queue_mod
import sys
import time
import traceback
from datetime import timedelta
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

DEVICES = ("cpu", "cuda")


class RankError(RuntimeError):
    """One or more ranks failed; ``failures`` maps rank -> traceback text."""

    def __init__(self, failures: dict[int, str]) -> None:
        self.failures = failures
        parts = [f"--- rank {r} ---\n{tb.rstrip()}" for r, tb in sorted(failures.items())]
        super().__init__(f"{len(failures)} rank(s) failed: {sorted(failures)}\n" + "\n".join(parts))


def check_device(device: str, world_size: int = 1) -> None:
    """Clear errors for an unknown device or more CUDA ranks than GPUs."""
    if device not in DEVICES:
        raise ValueError(f"device={device!r} is not supported; valid devices: {list(DEVICES)}")
    if not isinstance(world_size, int) or isinstance(world_size, bool) or world_size < 1:
        raise ValueError(f"world_size must be a positive integer, got {world_size!r}")
    if device == "cuda":
        n = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if n < world_size:
            raise ValueError(
                f"device='cuda' with world_size={world_size} needs {world_size} GPUs, found {n}; "
                f"use world_size<={n}" + ("" if n else " or device='cpu'")
            )


def backend_for(device: str) -> str:
    return "nccl" if device == "cuda" else "gloo"


def rank_device(device: str, local_rank: int) -> torch.device:
    if device == "cuda":
        torch.cuda.set_device(local_rank)
        return torch.device("cuda", local_rank)
    return torch.device("cpu")


def _share_cores(world_size: int) -> None:
    # N ranks on one host each defaulting to all cores oversubscribe the CPU badly.
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world_size))


def _worker(rank, world_size, device, port, fn, args, kwargs, results, timeout_s, quiet) -> None:
    if quiet:  # libraries' own logging (DeepSpeed's, say) stays out of the notebook
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, 1)
        os.dup2(devnull, 2)
    try:
        os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size),
                          LOCAL_WORLD_SIZE=str(world_size), MASTER_ADDR="127.0.0.1",
                          MASTER_PORT=str(port), LABKIT_DEVICE=device)
        _share_cores(world_size)
        rank_device(device, rank)
        store = dist.TCPStore("127.0.0.1", port, world_size, is_master=False,
                              timeout=timedelta(seconds=timeout_s))
        dist.init_process_group(backend_for(device), store=store, rank=rank,
                                world_size=world_size, timeout=timedelta(seconds=timeout_s))
        # Plain pickle, not torch's shared-memory reductions: the result must outlive this process.
        results.put((rank, True, pickle.dumps(fn(*args, **kwargs))))
    except BaseException:  # noqa: BLE001 - every failure must reach the caller
        results.put((rank, False, traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def _check_importable(fn: Callable) -> None:
    main = sys.modules.get("__main__")
    if getattr(fn, "__module__", None) == "__main__" and not getattr(main, "__file__", None):
        raise TypeError(
            f"launch(fn={getattr(fn, '__name__', fn)!r}): fn is defined in an interactive session, "
            "which spawned ranks cannot import; put it in a module (e.g. labkit or a .py file "
            "next to the notebook) and import it"
        )


def launch(
    fn: Callable[..., Any],
    *args: Any,
    world_size: int = 2,
    device: str = "cpu",
    timeout: float = 600.0,
    quiet: bool = False,
    slurm: dict | None = None,
    **kwargs: Any,
) -> list[Any]:
    """Call ``fn(*args, **kwargs)`` on ``world_size`` ranks; return the results indexed by rank.

    ``quiet=True`` silences the ranks' stdout and stderr; errors still come back with tracebacks.
    ``slurm={"nodes": 2, "tasks_per_node": 4, "partition": "gpu"}`` runs the same call as a Slurm
    job instead (:func:`labkit.slurm_launch.launch_slurm`); ``world_size`` is then nodes x tasks,
    and a key that is not one of ``launch_slurm``'s options is an error, raised before submitting.
    """
    if slurm is not None:
        from labkit.slurm_launch import check_slurm_options, launch_slurm

        opts = check_slurm_options(slurm, world_size)
        return launch_slurm(fn, *args, device=device, timeout=timeout, **opts, **kwargs)
    check_device(device, world_size)
    _check_importable(fn)
    if timeout <= 0:
        raise ValueError(f"timeout must be positive seconds, got {timeout!r}")
    ctx = mp.get_context("spawn")
    # The caller hosts the rendezvous store on a port the OS picks (port=0): no fixed MASTER_PORT,
    # so parallel launches never collide and there is no pick-then-bind race.
    store = dist.TCPStore("127.0.0.1", 0, world_size, is_master=True, wait_for_workers=False,
                          timeout=timedelta(seconds=timeout))
    results = ctx.Queue()
    procs = [
        ctx.Process(target=_worker, daemon=True, name=f"labkit-rank{r}",
                    args=(r, world_size, device, store.port, fn, args, kwargs, results, timeout, quiet))
        for r in range(world_size)
    ]
    out: dict[int, Any] = {}
    failures: dict[int, str] = {}
    deadline = time.monotonic() + timeout
    try:
        for p in procs:
            p.start()
        while len(out) + len(failures) < world_size:
            try:
                rank, ok, value = results.get(timeout=0.5)
                (out if ok else failures)[rank] = pickle.loads(value) if ok else value
                if failures:
                    # Peers of a failed rank usually block in a collective: give them a moment
                    # to report their own error, then stop waiting.
                    deadline = min(deadline, time.monotonic() + 5.0)
                continue
            except queue_mod.Empty:
                pass
            dead = [r for r, p in enumerate(procs) if r not in out and r not in failures
                    and not p.is_alive() and p.exitcode not in (0, None)]
            if dead:
                time.sleep(0.5)  # a result may still be in flight from a rank that died after it
                while True:
                    try:
                        rank, ok, value = results.get_nowait()
                    except queue_mod.Empty:
                        break
                    (out if ok else failures)[rank] = pickle.loads(value) if ok else value
                for r in dead:
                    if r not in out and r not in failures:
                        failures[r] = (f"rank {r} died with exit code {procs[r].exitcode} "
                                       "before reporting a result (killed, or crashed in native code)")
            if time.monotonic() > deadline:
                for r in range(world_size):
                    if r not in out and r not in failures:
                        failures[r] = f"rank {r} did not finish within the time allowed (timeout={timeout} s)"
        if failures:
            raise RankError(failures)
        return [out[r] for r in range(world_size)]
    finally:
        for p in procs:
            p.join(timeout=5.0 if not failures else 0.5)
        for p in procs:
            if p.is_alive():
                p.terminate()
                p.join(timeout=2.0)
            if p.is_alive():
                p.kill()
                p.join()
        results.close()
        del store


def init_from_env(device: str | None = None) -> tuple[int, int, torch.device]:
    """Join the process group that ``torchrun`` (or Slurm's ``srun torchrun``) describes in env vars.

    Returns ``(rank, world_size, device)``; without torchrun's variables it is a single process and
    no group is formed.
    """
    device = device or os.environ.get("LABKIT_DEVICE", "cpu")
    if "RANK" not in os.environ:
        check_device(device, 1)
        return 0, 1, rank_device(device, 0)
    world_size = int(os.environ["WORLD_SIZE"])
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    check_device(device, int(os.environ.get("LOCAL_WORLD_SIZE", 1)))
    dev = rank_device(device, local_rank)
    if not dist.is_initialized():
        _share_cores(int(os.environ.get("LOCAL_WORLD_SIZE", world_size)))
        dist.init_process_group(backend_for(device))
    return dist.get_rank(), dist.get_world_size(), dev
