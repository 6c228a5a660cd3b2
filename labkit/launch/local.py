"""Run a labkit function on N processes of this machine, and get each rank's result back.

``launch_local(fn, world_size=2)`` starts ``world_size`` processes (fresh interpreters, as torchrun's
workers are: forked from a clean *forkserver* that has imported torch once on CPU, *spawned* on
CUDA), forms a process group over a
``TCPStore`` that the caller hosts on a free port it picked, calls ``fn(*args, **kwargs)`` on every
rank and returns the list of results, indexed by rank. CPU ranks use gloo; ``device="cuda"`` uses
NCCL with one GPU per rank (PyTorch docs, "Distributed communication package", backends).

A rank that raises makes ``launch`` raise :class:`RankError` carrying that rank's traceback; the other
ranks are terminated and every child is reaped, so no process outlives the call. On a cluster the
same functions run under ``torchrun`` through :func:`init_from_env` (see :mod:`labkit.train`).
"""
from __future__ import annotations

import gc
import os
import pickle
import queue as queue_mod
import signal
import sys
import time
import traceback
from datetime import timedelta
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from labkit.core import progress
from labkit.core.checks import positive_number
from labkit.core.devices import backend_for, check_device, rank_device, share_cores, torchrun_env


class RankError(RuntimeError):
    """One or more ranks failed; ``failures`` maps rank -> traceback text."""

    def __init__(self, failures: dict[int, str]) -> None:
        self.failures = failures
        parts = [f"--- rank {r} ---\n{tb.rstrip()}" for r, tb in sorted(failures.items())]
        super().__init__(f"{len(failures)} rank(s) failed: {sorted(failures)}\n" + "\n".join(parts))


def _worker(rank, world_size, device, port, fn, args, kwargs, results, timeout_s, quiet, bars) -> None:
    # Its own process group: whatever this rank starts (a DataLoader's workers, a subprocess) is killed
    # with it when launch cleans up, even after the rank itself has exited.
    os.setpgid(0, 0)
    if quiet:  # libraries' own logging (DeepSpeed's, say) stays out of the notebook
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, 1)
        os.dup2(devnull, 2)
    try:
        os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size),
                          LOCAL_WORLD_SIZE=str(world_size), MASTER_ADDR="127.0.0.1",
                          MASTER_PORT=str(port), LABKIT_DEVICE=device)
        if bars is not None:  # the caller's choice (a notebook wants bars, papermill none)
            os.environ[progress.ENV] = bars
        # Bars are drawn by the caller, where the person is looking (a notebook's widget).
        progress.forward_to(lambda message: results.put((rank, "progress", message)))
        share_cores(world_size)
        rank_device(device, rank)
        store = dist.TCPStore("127.0.0.1", port, world_size, is_master=False,
                              timeout=timedelta(seconds=timeout_s))
        dist.init_process_group(backend_for(device), store=store, rank=rank,
                                world_size=world_size, timeout=timedelta(seconds=timeout_s),
                                **eager_init(device, rank))
        # Plain pickle, not torch's shared-memory reductions: the result must outlive this process.
        results.put((rank, True, pickle.dumps(fn(*args, **kwargs))))
        clean = True
    except BaseException:  # noqa: BLE001 - every failure must reach the caller
        results.put((rank, False, traceback.format_exc()))
        clean = False
    finally:
        leave_group(clean)


def _check_importable(fn: Callable) -> None:
    main = sys.modules.get("__main__")
    if getattr(fn, "__module__", None) == "__main__" and not getattr(main, "__file__", None):
        raise TypeError(
            f"launch(fn={getattr(fn, '__name__', fn)!r}): fn is defined in an interactive session, "
            "which spawned ranks cannot import; put it in a module (e.g. labkit or a .py file "
            "next to the notebook) and import it"
        )


def _free_cached_gpu_memory(device: str) -> None:
    # A notebook that trained a single-process reference keeps its cached blocks on GPU 0, which
    # rank 0 then shares: give them back to the driver before the ranks start (and say so).
    if device != "cuda" or not torch.cuda.is_initialized():
        return
    gc.collect()
    before = torch.cuda.memory_reserved()
    torch.cuda.empty_cache()
    freed = before - torch.cuda.memory_reserved()
    if freed:
        print(f"[launch] released {freed / 2**20:,.0f} MiB of this process's cached GPU memory for the ranks")


# What every rank imports anyway. The forkserver imports it once, and each rank is then forked from
# that clean, single-threaded process: measured here, a two-rank launch took 0.5 s instead of 4 s
# with spawn, whose every rank imports torch again. The strategies' modules too (DTensor, FSDP2,
# pipelining, DCP, and dynamo and sympy, which DDP and DTensor pull in): imported at the first step
# instead, they cost each rank about 1 s of CPU, 14 s of wall time on a 16-rank CPU launch.
PRELOAD = ["torch", "torch.distributed", "labkit.launch.local", "labkit.train",
           "torch._dynamo", "torch.distributed.tensor.parallel", "torch.distributed.fsdp",
           "torch.distributed.pipelining", "torch.distributed.checkpoint", "torch.nn.parallel",
           "labkit.parallel.compose", "labkit.parallel.data_parallel", "labkit.parallel.pipeline.runner",
           "labkit.parallel.context.layout", "labkit.parallel.layout.sizes",
           "labkit.fault_tolerance.checkpointer", "labkit.fault_tolerance.resume"]


def _context(device: str) -> Any:
    """The start method: forkserver on CPU; spawn on CUDA, whose driver must never have been touched
    in a process that forks (the forkserver would be one)."""
    if device == "cuda" or "forkserver" not in mp.get_all_start_methods():
        return mp.get_context("spawn")
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)
    return ctx


def eager_init(device: str, local_rank: int) -> dict:
    # NCCL communicators are built at init, bound to this rank's GPU, rather than lazily at the
    # first collective (PyTorch docs, init_process_group's device_id): a bad GPU fails here.
    return {"device_id": torch.device("cuda", local_rank)} if device == "cuda" else {}


def launch_local(fn: Callable[..., Any], *args: Any, world_size: int = 2, device: str = "cpu",
                 timeout: float = 600.0, quiet: bool = False, **kwargs: Any) -> list[Any]:
    """Call ``fn(*args, **kwargs)`` on ``world_size`` processes of this machine; results by rank.

    ``quiet=True`` silences the ranks' stdout and stderr; errors still come back with tracebacks.
    """
    check_device(device, world_size)
    _check_importable(fn)
    positive_number("timeout", timeout)
    _free_cached_gpu_memory(device)
    where = f"GPUs 0-{world_size - 1} (NCCL)" if device == "cuda" else "CPU processes (gloo)"
    print(f"[launch] {getattr(fn, '__name__', 'fn')} on {world_size} rank(s): {where}", flush=True)
    ctx = _context(device)
    # The caller hosts the rendezvous store on a port the OS picks (port=0): no fixed MASTER_PORT,
    # so parallel launches never collide and there is no pick-then-bind race.
    store = dist.TCPStore("127.0.0.1", 0, world_size, is_master=True, wait_for_workers=False,
                          timeout=timedelta(seconds=timeout))
    results = ctx.Queue()
    bars = os.environ.get(progress.ENV) or ("1" if progress.in_notebook() else None)
    procs = [
        ctx.Process(target=_worker, daemon=True, name=f"labkit-rank{r}",
                    args=(r, world_size, device, store.port, fn, args, kwargs, results, timeout, quiet, bars))
        for r in range(world_size)
    ]
    out: dict[int, Any] = {}
    failures: dict[int, str] = {}
    drawn = progress.Drawn()
    started: list = []
    ok = False
    try:
        for p in procs:
            try:
                p.start()  # fn and its arguments are pickled here
            except Exception as e:  # noqa: BLE001 - said in one line, the others stopped
                raise TypeError(f"launch(fn={getattr(fn, '__name__', fn)!r}) could not start rank {len(started)}: "
                                f"{type(e).__name__}: {e} (ranks are new processes that receive fn and its "
                                "arguments pickled: pass module-level functions and picklable values)") from e
            started.append(p)
        _collect(procs, out, failures, results, timeout, drawn)
        if failures:
            raise RankError(failures)
        ok = True
        return [out[r] for r in range(world_size)]
    finally:
        drawn.close()
        _reap(started, not ok)
        results.close()
        del store


def _collect(procs: list, out: dict, failures: dict, results: Any, timeout: float,
             drawn: Callable[[int, tuple], None]) -> None:
    """Results and failures of every rank, until all reported, one failed (and its peers had a few
    seconds to report theirs), or ``timeout`` passed; progress the ranks forward goes to ``drawn``."""
    world_size, t0 = len(procs), time.monotonic()
    deadline, first_failure = t0 + timeout, None

    def take(rank: int, ok: bool | str, value: Any) -> None:
        nonlocal first_failure, deadline
        if ok == "progress":
            drawn(rank, value)
            return
        (out if ok else failures)[rank] = pickle.loads(value) if ok else value
        if not ok and first_failure is None:
            # Peers of a failed rank usually block in a collective: give them a moment to report
            # their own error, then stop waiting.
            first_failure = (rank, time.monotonic())
            deadline = min(deadline, time.monotonic() + 5.0)

    while len(out) + len(failures) < world_size:
        try:
            take(*results.get(timeout=0.5))
            continue
        except queue_mod.Empty:
            pass
        dead = [r for r, p in enumerate(procs) if r not in out and r not in failures
                and not p.is_alive() and p.exitcode not in (0, None)]
        if dead:
            time.sleep(0.5)  # a result may still be in flight from a rank that died after it
            while True:
                try:
                    take(*results.get_nowait())
                except queue_mod.Empty:
                    break
            for r in dead:
                if r not in out and r not in failures:
                    failures[r] = (f"rank {r} died with exit code {procs[r].exitcode} "
                                   "before reporting a result (killed, or crashed in native code)")
                    first_failure = first_failure or (r, time.monotonic())
                    deadline = min(deadline, time.monotonic() + 5.0)
        if time.monotonic() > deadline:
            for r in range(world_size):
                if r in out or r in failures:
                    continue
                if first_failure is not None:
                    bad, when = first_failure
                    failures[r] = (f"rank {r} was stopped {time.monotonic() - when:.1f} s after rank {bad} failed "
                                   f"({time.monotonic() - t0:.1f} s into the run): it was most likely waiting for "
                                   f"rank {bad} (in a collective, or for something rank {bad} would have sent)")
                else:
                    failures[r] = f"rank {r} did not finish within the time allowed (timeout={timeout} s)"


def _reap(procs: list, failed: bool) -> None:
    """Join, then terminate, then kill every started rank and its process group (what it started too)."""
    for p in procs:
        p.join(timeout=5.0 if not failed else 0.5)
    for p in procs:
        if p.is_alive():
            p.terminate()
            p.join(timeout=2.0)
        if p.is_alive():
            p.kill()
            p.join()
        try:
            os.killpg(p.pid, signal.SIGKILL)  # the rank's group: it is the leader (setpgid in _worker)
        except (ProcessLookupError, PermissionError):
            pass  # nothing left in it


def init_from_env(device: str | None = None) -> tuple[int, int, torch.device]:
    """Join the process group that ``torchrun`` (or Slurm's ``srun torchrun``) describes in env vars.

    Returns ``(rank, world_size, device)``; without torchrun's variables it is a single process and
    no group is formed.
    """
    device = device or os.environ.get("LABKIT_DEVICE", "cpu")
    if "RANK" not in os.environ:
        check_device(device, 1)
        return 0, 1, rank_device(device, 0)
    rank, world_size, local_rank, local_world = torchrun_env()
    check_device(device, local_world or 1)
    dev = rank_device(device, local_rank)
    if not dist.is_initialized():
        share_cores(local_world or world_size)
        dist.init_process_group(backend_for(device), **eager_init(device, local_rank))
    return dist.get_rank(), dist.get_world_size(), dev


def init_one_rank(device: str = "cpu") -> torch.device:
    """A process group of one rank, as ``torchrun --nproc-per-node 1`` would start it: strategies that
    issue collectives (FSDP's, DeepSpeed's) then run in a single process unchanged."""
    check_device(device, 1)
    store = dist.TCPStore("127.0.0.1", 0, 1, is_master=True, wait_for_workers=False)
    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(store.port))
    dev = rank_device(device, 0)
    dist.init_process_group(backend_for(device), store=store, rank=0, world_size=1, **eager_init(device, 0))
    return dev


def leave_group(clean: bool = True) -> None:
    """Leave the process group so every rank exits 0 (``clean=False`` after a failure: no barrier, the
    other ranks may never reach it).

    Measured here (DeepSpeed ZeRO on gloo, about 1 run in 10): a rank aborted at interpreter exit with
    "terminate called without an active exception". The core dump shows a gloo worker thread freeing
    a finished all-gather's tensors, which needs the GIL, while Python was finalizing; the groups
    outlive ``destroy_process_group`` because torch keeps references to them once ``torch._dynamo``
    is imported. A barrier as every group's last collective (it holds no Python tensors), after the
    reference cycles of engines and wrappers are collected, made 40 of 40 runs exit 0.
    """
    gc.collect()  # engines and wrappers in reference cycles release their work while the group lives
    if dist.is_initialized():
        if clean:
            dist.barrier()
        dist.destroy_process_group()
    gc.collect()
