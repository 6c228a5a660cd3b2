"""torchrun as ``cluster/slurm/train.sbatch`` runs it: one agent per node that leaves a preemption to the ranks.

    python -m labkit.launch.torchrun [torchrun's arguments] -m labkit.train ...

It is ``python -m torch.distributed.run``, with two differences, both about a signal that is expected:

* **SIGUSR1 goes to the ranks alone.** A batch script warns the whole step at once (``scancel
  --signal=USR1 JOB.0``: every process of it, on every node). torchrun has no handler for SIGUSR1,
  whose default action would kill the agent and orphan its ranks, so the agent ignores it here; the
  ranks take it with their own handler (:mod:`labkit.fault_tolerance.preemption`), finish their
  step, save and exit. A preempted rank then exits 0, not 75 (``LABKIT_PREEMPTED_EXIT_CODE=0``):
  torchrun reports any other status as a failure, with an error report, and restarts the ranks
  under ``--max-restarts``; the batch script knows that it sent the signal. A rank started by the
  agent ignores SIGUSR1 until ``labkit.train`` takes it over (after its restore), so a warning that
  comes during start-up is lost: the batch script repeats it until the step ends.
* **A death signal is one line, not a traceback.** SIGTERM, SIGINT or SIGHUP (a site's preemption,
  ``scancel``, the time limit) still stop torchrun, which forwards SIGTERM to the ranks and waits
  ``--shutdown-timeout`` for them to save and leave. torchrun then raises ``SignalException`` and
  Python prints its traceback; here one line on stderr says what happened, and the exit status is
  128 + the signal's number, as for a process the signal ended.
"""
from __future__ import annotations

import os
import signal
import socket
import sys

PREEMPTED_EXIT_CODE_ENV = "LABKIT_PREEMPTED_EXIT_CODE"


def main(argv: list[str] | None = None) -> int:
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.run import main as torchrun

    signal.signal(signal.SIGUSR1, signal.SIG_IGN)  # inherited by the ranks until labkit.train takes it
    os.environ.setdefault(PREEMPTED_EXIT_CODE_ENV, "0")
    try:
        torchrun(argv)
    except SignalException as e:
        sig = signal.Signals(e.sigval)
        print(f"[torchrun {os.environ.get('SLURMD_NODENAME') or socket.gethostname()}] stopped by {sig.name}, as Slurm stops a job it preempts, cancels "
              f"or times out: the ranks got SIGTERM and --shutdown-timeout to save (no traceback: this is expected)",
              file=sys.stderr, flush=True)
        return 128 + int(sig)
    return 0


if __name__ == "__main__":
    sys.exit(main())
