"""Preemption: turn a scheduler's warning signal into "finish the step, save, exit to be requeued".

Schedulers warn before they kill. Slurm sends the signal of ``--signal=[B:]USR1@SECONDS`` that long
before the time limit, and on ``scancel`` or preemption SIGTERM, then SIGKILL after ``KillWait``
(default 30 s; Slurm docs, slurm.conf). Kubernetes sends SIGTERM and SIGKILLs after
``terminationGracePeriodSeconds`` (default 30 s). torchrun forwards SIGTERM to its workers and
SIGKILLs them after ``--shutdown-timeout`` (default 30 s). Spot capacity gives a notice too: two
minutes on AWS, 30 seconds on Google Cloud, delivered as a shutdown (SIGTERM) on the VM.

:class:`PreemptionHandler` records SIGTERM or SIGUSR1 and the training loop polls it once per step
(a collective: every rank must stop at the same step, and save together). With time left in the
grace period for a checkpoint it saves, then exits with :data:`REQUEUE_EXIT_CODE`. A batch script
requeues on that code::

    srun python -m labkit.train --checkpoint-dir "$CKPT" --grace-s 60 ...   # one task per rank
    rc=$?
    if [ "$rc" -eq 75 ]; then scontrol requeue "$SLURM_JOB_ID"; fi

Under torchrun the workers exit with 75, but torchrun itself reports any worker failure as exit
code 1 (and restarts the workers under ``--max-restarts``): a batch script around torchrun should
requeue when it forwarded the signal itself (its own ``trap``), and can read the ``preempted``
event in the run's ``--step-log``. ``cluster/slurm/train.sbatch`` does both, and runs torchrun as
:mod:`labkit.launch.torchrun`, under which a preempted rank exits 0 (``LABKIT_PREEMPTED_EXIT_CODE``).
"""
from __future__ import annotations

import math
import signal
import threading
import time

import torch
import torch.distributed as dist

from labkit.core.checks import non_negative_number
from labkit.core.devices import comm_device

# EX_TEMPFAIL of BSD sysexits.h: "a temporary failure ... the user is invited to retry the operation
# later". Distinct from 0 (done), 1 (a crash: do not requeue a bug forever) and 128+N (killed by N).
REQUEUE_EXIT_CODE = 75
SIGNALS = (signal.SIGTERM, signal.SIGUSR1)
CONTINUE, SAVE_AND_EXIT, EXIT = "continue", "save_and_exit", "exit"


def check_grace(grace_s: float, reserve_s: float) -> None:
    """Clear errors for a grace period and reserve that cannot work (``TrainConfig`` checks them early)."""
    for name, v in (("grace_s", grace_s), ("reserve_s", reserve_s)):
        non_negative_number(name, v)  # seconds
    if reserve_s >= grace_s > 0:
        raise ValueError(f"reserve_s={reserve_s} leaves nothing of grace_s={grace_s} for saving; use "
                         f"reserve_s < grace_s (e.g. reserve_s={grace_s / 4:g}; --reserve-s on the command line)")


class PreemptionHandler:
    """Record the first SIGTERM/SIGUSR1; :meth:`poll` says, on every rank alike, what the loop does next.

    ``grace_s`` is the time from the signal to the SIGKILL that follows it (Slurm's KillWait,
    torchrun's ``--shutdown-timeout``); ``reserve_s`` is kept back for leaving cleanly. A save is
    attempted only when the estimated save time fits in what is left of the grace period.
    """

    def __init__(self, grace_s: float = 30.0, reserve_s: float = 2.0,
                 signals: tuple[int, ...] = SIGNALS) -> None:
        check_grace(grace_s, reserve_s)
        self.grace_s, self.reserve_s, self.signals = float(grace_s), float(reserve_s), tuple(signals)
        self.received: int | None = None  # the signal number, once one arrived
        self.received_at: float | None = None
        self._previous: dict[int, object] = {}

    def install(self) -> "PreemptionHandler":
        """Take over the signals (main thread only); the previous handlers come back on uninstall()."""
        if threading.current_thread() is not threading.main_thread():
            raise RuntimeError("signal handlers can only be installed from the main thread")
        for s in self.signals:
            self._previous[s] = signal.signal(s, self._on_signal)
        return self

    def uninstall(self) -> None:
        for s, h in self._previous.items():
            signal.signal(s, h)
        self._previous.clear()

    def __enter__(self) -> "PreemptionHandler":
        return self.install()

    def __exit__(self, *exc) -> None:
        self.uninstall()

    def _on_signal(self, signum: int, frame) -> None:
        # Only record: the step in progress finishes, the loop decides at the step boundary.
        if self.received is None:
            self.received, self.received_at = signum, time.monotonic()

    @property
    def signal_name(self) -> str | None:
        return None if self.received is None else signal.Signals(self.received).name

    def time_left(self) -> float:
        """Seconds until the expected SIGKILL (infinite while no signal has arrived)."""
        if self.received_at is None:
            return math.inf
        return self.grace_s - (time.monotonic() - self.received_at)

    def poll(self, save_estimate_s: float = 0.0) -> str:
        """CONTINUE, SAVE_AND_EXIT or EXIT (too late to save), agreed by every rank of the group."""
        stop = self.received is not None
        too_late = stop and self.time_left() - self.reserve_s < save_estimate_s
        if dist.is_available() and dist.is_initialized():
            dev = comm_device()  # not get_backend() == "nccl": a CUDA group's backend is "cpu:gloo,cuda:nccl"
            # One rank warned is enough to stop all; one rank short of time makes all skip the save.
            flags = torch.tensor([float(stop), float(too_late)], device=dev)
            dist.all_reduce(flags, op=dist.ReduceOp.MAX)
            stop, too_late = bool(flags[0].item()), bool(flags[1].item())
        if not stop:
            return CONTINUE
        return EXIT if too_late else SAVE_AND_EXIT
