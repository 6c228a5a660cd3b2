"""What the labs' autograder cells use to run a student's code somewhere else than the notebook.

A graded exercise often has to run the student's function where it really runs: on several ranks
of a process group (a gradient sync), or in a fresh process that is killed half-way (an atomic
save). Spawned processes import the function they run, and a function typed into a notebook cell
lives in ``__main__`` of a kernel that no other process can import. Both helpers therefore ship
the function *by value* with ``cloudpickle`` (the serializer Ray, Dask and submitit use for
interactive code): its code, and whatever notebook globals it refers to; modules travel by name.

* :func:`launch_by_value` is :func:`labkit.launch.launch` for notebook-defined functions.
* :func:`run_in_fresh_process` calls a function in a new interpreter and reports how it ended,
  including death by a signal, which is what a crash-consistency check needs to observe.
"""
from __future__ import annotations

import subprocess
import sys
from typing import Any, Callable

import cloudpickle

# The child of run_in_fresh_process: read (fn, args) from stdin, write the pickled result to stdout.
_CHILD = (
    "import sys, cloudpickle\n"
    "fn, args, kwargs = cloudpickle.loads(sys.stdin.buffer.read())\n"
    "out = fn(*args, **kwargs)\n"
    "sys.stdout.flush()\n"
    "sys.stdout.buffer.write(b'\\0LABKIT-RESULT\\0' + cloudpickle.dumps(out))\n"
)
_MARK = b"\0LABKIT-RESULT\0"


def _call_by_value(blob: bytes) -> Any:
    fn, args, kwargs = cloudpickle.loads(blob)
    return fn(*args, **kwargs)


def launch_by_value(fn: Callable[..., Any], *args: Any, world_size: int = 2, device: str = "cpu",
                    timeout: float = 300.0, **kwargs: Any) -> list[Any]:
    """``fn(*args, **kwargs)`` on ``world_size`` ranks, ``fn`` may be defined in a notebook.

    Returns the results indexed by rank; a rank that raises makes this raise
    :class:`labkit.launch.RankError` with its traceback, as :func:`labkit.launch.launch` does.
    """
    from labkit.launch import launch

    if not callable(fn):
        raise ValueError(f"fn must be callable, got {fn!r}")
    return launch(_call_by_value, cloudpickle.dumps((fn, args, kwargs)), world_size=world_size,
                  device=device, timeout=timeout)


def run_in_fresh_process(fn: Callable[..., Any], *args: Any, timeout: float = 60.0,
                         **kwargs: Any) -> tuple[int, Any]:
    """Call ``fn(*args, **kwargs)`` in a new Python process; return ``(returncode, result)``.

    ``returncode`` is 0 when ``fn`` returned (``result`` is its value), negative ``-signum`` when
    the process was killed by a signal, positive when it raised (``result`` is then the stderr
    text, traceback included). A process still running after ``timeout`` seconds is killed and
    reported as ``-9``.
    """
    if not callable(fn):
        raise ValueError(f"fn must be callable, got {fn!r}")
    if not timeout > 0:
        raise ValueError(f"timeout must be positive seconds, got {timeout!r}")
    try:
        proc = subprocess.run([sys.executable, "-c", _CHILD], input=cloudpickle.dumps((fn, args, kwargs)),
                              capture_output=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return -9, f"still running after {timeout} s: killed"
    if proc.returncode == 0:
        _, _, payload = proc.stdout.partition(_MARK)
        return 0, cloudpickle.loads(payload)
    return proc.returncode, proc.stderr.decode(errors="replace")
