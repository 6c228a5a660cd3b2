"""Starting ranks: on this machine's processes, under torchrun, or as a Slurm job.

``launch(fn, *args, world_size=2)`` calls ``fn(*args)`` on every rank and returns the results
indexed by rank; with ``slurm={"nodes": 2}`` the same call runs as a Slurm job. Under torchrun (or
``srun torchrun``) a rank joins the group the environment describes with :func:`init_from_env`.

* :mod:`labkit.launch.local`: spawned processes over a ``TCPStore`` the caller hosts, and torchrun.
* :mod:`labkit.launch.slurm`: one submitit job, a task per rank.
"""
from __future__ import annotations

from typing import Any, Callable

from labkit.launch import slurm as _slurm
from labkit.launch.local import (
    RankError,
    init_from_env,
    init_one_rank,
    launch_local,
    leave_group,
)
from labkit.launch.slurm import check_slurm_options, launch_slurm

__all__ = ["RankError", "init_from_env", "init_one_rank", "launch", "launch_local", "launch_slurm", "leave_group"]


def launch(fn: Callable[..., Any], *args: Any, world_size: int = 2, device: str = "cpu", timeout: float = 600.0,
           quiet: bool = False, slurm: dict | None = None, **kwargs: Any) -> list[Any]:
    """Call ``fn(*args, **kwargs)`` on ``world_size`` ranks; return the results indexed by rank.

    ``quiet=True`` silences the ranks' stdout and stderr; errors still come back with tracebacks.
    ``slurm={"nodes": 2, "tasks_per_node": 4, "partition": "gpu"}`` runs the same call as a Slurm
    job instead (:func:`labkit.launch.slurm.launch_slurm`); ``world_size`` is then nodes x tasks,
    and a key that is not one of ``launch_slurm``'s options is an error, raised before submitting.
    """
    if slurm is not None:
        opts = check_slurm_options(slurm, world_size)
        return _slurm.launch_slurm(fn, *args, device=device, timeout=timeout, **opts, **kwargs)
    return launch_local(fn, *args, world_size=world_size, device=device, timeout=timeout, quiet=quiet, **kwargs)
