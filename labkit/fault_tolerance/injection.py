"""Kill real training processes on purpose: torchrun jobs with faults injected at chosen steps.

``run_with_faults(train_args, faults, log)`` starts ``torchrun ... -m labkit.train`` with a step log
(:class:`labkit.fault_tolerance.step_log.StepLog`), watches it, and when rank 0 reports a fault's step it sends the
signal to one worker of the current attempt (``target=1``: rank 1) or to the torchrun agent itself
(``target="agent"``, as a scheduler or a spot notice would). ``SIGKILL`` on a worker gives no warning:
torchrun restarts the whole group (``--max-restarts``) and the run resumes from its last
checkpoint. ``SIGTERM`` gives the preemption handler its grace period: the workers save and exit
with 75, and when the agent itself was stopped, the job is "requeued": started again, as Slurm's
``scontrol requeue`` would.

torchrun runs with ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1``: restarted gloo workers otherwise reach
the previous generation's store and fail or hang (pytorch/pytorch#135712, #167288). The price: the
agent then picks the workers' port by binding port 0 and closing it, and another process can take
that port before rank 0 binds it again (EADDRINUSE at start-up). Give ``max_restarts`` one restart
more than the faults need: a group that failed that way restarts before it restores anything.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from labkit.core.checks import non_negative_int


@dataclass(frozen=True)
class Fault:
    step: int  # fire once rank 0 has logged this step (the targets are then in the next one)
    signal: str = "SIGKILL"  # SIGKILL | SIGTERM | SIGUSR1
    target: int | str = 1  # a rank of the current attempt, or "agent" (the torchrun process)

    def __post_init__(self) -> None:
        non_negative_int("step", self.step)  # the training step after which the fault fires
        if self.signal not in ("SIGKILL", "SIGTERM", "SIGUSR1"):
            raise ValueError(f"signal={self.signal!r} is unknown; valid: ['SIGKILL', 'SIGTERM', 'SIGUSR1']")
        if self.target != "agent" and not (isinstance(self.target, int) and not isinstance(self.target, bool)
                                           and self.target >= 0):
            raise ValueError(f"target={self.target!r} must be a rank (int >= 0) or 'agent'")


def read_log(path: str | os.PathLike) -> list[dict]:
    """The events of a step log; a line cut short by a kill is skipped."""
    p = Path(path)
    if not p.exists():
        return []
    events = []
    for line in p.read_text().splitlines():
        try:
            events.append(json.loads(line))
        except json.JSONDecodeError:
            pass
    return events


def torchrun_command(train_args: list[str], nproc: int = 2, max_restarts: int = 2,
                     shutdown_timeout: int = 30, python: str = sys.executable) -> list[str]:
    """``torchrun`` for ``python -m labkit.train`` on a free port (c10d rendezvous on 127.0.0.1:0)."""
    return [python, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc),
            "--max-restarts", str(max_restarts), "--rdzv-backend", "c10d", "--rdzv-endpoint", "127.0.0.1:0",
            "--shutdown-timeout", str(shutdown_timeout), "-m", "labkit.train", *train_args]


def run_with_faults(train_args: list[str], faults: list[Fault], log: str | os.PathLike, nproc: int = 2,
                    max_restarts: int = 2, shutdown_timeout: int = 30, max_requeues: int = 2,
                    timeout_s: float = 600.0, env: dict | None = None) -> dict:
    """Run training under torchrun, inject ``faults`` in order, requeue after a preemption; what happened.

    ``train_args`` must not hold ``--step-log`` (``log`` is used). Returns the exit code of every
    launch, the faults as fired (with the pid hit and the time) and the step log's events.
    """
    if "--step-log" in train_args:
        raise ValueError("train_args must not set --step-log; pass log= instead")
    cmd = torchrun_command([*train_args, "--step-log", str(log)], nproc, max_restarts, shutdown_timeout)
    env = {**os.environ, "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1", "PYTHONWARNINGS": "ignore", **(env or {})}
    pending, fired, codes = list(faults), [], []
    deadline = time.monotonic() + timeout_s
    out_path = Path(f"{log}.out")  # a file, not a pipe: a full pipe would block torchrun's output
    for launch in range(max_requeues + 1):
        with open(out_path, "a") as out:  # its own process group: nothing outlives a timeout
            proc = subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        seen = len(read_log(log))
        try:
            while proc.poll() is None:
                if time.monotonic() > deadline:
                    raise TimeoutError(f"training under torchrun did not finish within {timeout_s} s")
                events = read_log(log)
                if pending and _due(events, seen, pending[0]):
                    pid = proc.pid if pending[0].target == "agent" else _pid(events, pending[0].target)
                    if pid is not None:
                        os.kill(pid, getattr(signal, pending[0].signal))
                        fired.append({**asdict(pending.pop(0)), "pid": pid, "time": time.time(), "launch": launch})
                        seen = len(events)
                time.sleep(0.02)
            codes.append(proc.returncode)
        finally:
            if proc.poll() is None:
                kill_tree(proc.pid)
                proc.wait()
        events = read_log(log)
        if proc.returncode == 0 or not events or events[-1]["event"] != "preempted":
            break  # finished, or failed for another reason than a preemption: do not requeue
    return {"returncodes": codes, "fired": fired, "events": read_log(log),
            "output_tail": out_path.read_text(errors="replace")[-4000:]}


def _descendants(pid: int) -> list[int]:
    """Every process below ``pid``, from /proc: torchrun's elastic agent starts each worker in a
    session of its own, so killing the agent's process group misses them."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:  # the process ended while we read
            continue
        children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    out, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            out.append(child)
            todo.append(child)
    return out


def kill_tree(pid: int) -> None:
    """SIGKILL ``pid``, its process group and every process below it, whatever their sessions."""
    for p in [*_descendants(pid), pid]:
        try:
            os.kill(p, signal.SIGKILL)
        except ProcessLookupError:
            pass
    try:
        os.killpg(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def _due(events: list[dict], seen: int, fault: Fault) -> bool:
    return any(e["event"] == "step" and e["step"] >= fault.step for e in events[seen:])


def _pid(events: list[dict], rank: int) -> int | None:
    starts = [e for e in events if e["event"] == "start" and e["rank"] == rank]
    return starts[-1]["pid"] if starts else None


def recovery(events: list[dict], fired: list[dict]) -> list[dict]:
    """What each fired fault cost, from the step log: the last step done before the run went down
    (a SIGTERMed run finishes the step it is in), the step it resumed from, the steps redone, and the
    seconds from the fault to the restore and to training being back where it had been."""
    out = []
    for f in fired:
        restore = next((e for e in events if e["event"] == "restore" and e["time"] > f["time"]), None)
        if restore is None:
            continue
        done = max((e["step"] for e in events if e["event"] == "step" and e["time"] < restore["time"]), default=0)
        back = next((e for e in events if e["event"] == "step" and e["time"] > restore["time"] and e["step"] > done),
                    None)
        out.append({"signal": f["signal"], "target": f["target"], "last_done": done, "resumed_from": restore["step"],
                    "steps_redone": done - restore["step"], "restart_s": restore["time"] - f["time"],
                    "restore_s": restore["seconds"], "recovery_s": back["time"] - f["time"] if back else None})
    return out
