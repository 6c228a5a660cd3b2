"""``make gpu-check`` within the time a lent GPU has: each item and each lab in a process of its own,
stopped at its budget.

A GPU lent for 15 minutes cannot wait for a lab that hangs in a collective or a cold compile that
takes five: every item and lab runs in a new session (:func:`run_apart`), and when its seconds are up
its whole process group is killed (the ranks it launched, their forkserver) and it is reported as
over its budget, with whatever parts it finished. :class:`Budget` hands each one its seconds, never
more than the run has left: the check ends within its budget however the GPU behaves, and what was
not started says so. ``--full`` runs everything, each still stopped after an hour.
"""
from __future__ import annotations

import os
import signal
import subprocess
import time

# The default run (seconds): the items, then the labs with what is left. On one H100 the items are
# predicted to take about 5 minutes (the device item's cold Inductor compiles are most of it). On CPU
# processes (the suite checking the check) every lab's ci profile runs too: about 7 minutes on two
# busy cores, measured, so twice that.
TOTAL_S = {"cuda": 600.0, "cpu": 1200.0}
ITEM_S = {"environment": 60, "strategies": 180, "fsdp2": 60, "context": 90, "experts": 90, "precision": 150,
          "speed": 90, "device": 240, "determinism": 90}
# A lab's gpu profile trimmed for the check (labkit.labs.profiles.GPU_CHECK); on CPU processes its ci
# profile, untrimmed: inside_device's took 119 s on two idle cores, measured, and more on busy ones
LAB_S = {"cuda": 120.0, "cpu": 300.0}
FULL_S = 3600.0  # --full: an item or lab that takes an hour is stopped all the same
MIN_START_S = 20.0  # less than this left: a child is not started (torch's import alone takes seconds)


class Budget:
    """Seconds for each item and lab, within a total (None: ``--full``, no total)."""

    def __init__(self, total: float | None = TOTAL_S["cuda"]) -> None:
        self.total, self.t0 = total, time.monotonic()

    def used(self) -> float:
        return time.monotonic() - self.t0

    def grant(self, want: float) -> float | None:
        """The seconds a child may run: ``want`` (``--full``: :data:`FULL_S`), cut to what the run has
        left; None when too little is left to start one."""
        if self.total is None:
            return FULL_S
        left = self.total - self.used()
        return min(want, left) if left >= MIN_START_S else None

    def spent(self) -> str:
        return (f"not run: the check's {self.total:.0f} s budget is spent ({self.used():.0f} s used); --full runs "
                "everything, or --budget S gives more")


def run_apart(argv: list[str], seconds: float, env: dict | None = None) -> tuple[int | None, str, str]:
    """Run ``argv`` in a session of its own: ``(exit status, stdout, stderr)``, the status None when it ran
    past ``seconds`` and its whole process group was killed (what it printed until then is kept)."""
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                            start_new_session=True)
    try:
        out, err = proc.communicate(timeout=seconds)
        return proc.returncode, out, err
    except subprocess.TimeoutExpired:
        try:
            os.killpg(proc.pid, signal.SIGKILL)  # the child, the ranks it launched, their forkserver
        except ProcessLookupError:
            pass
        out, err = proc.communicate()
        return None, out, err
