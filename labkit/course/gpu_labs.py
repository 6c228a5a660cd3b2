"""``make gpu-check``'s labs: each lab's ``gpu`` profile, trimmed for the check
(:data:`labkit.labs.profiles.GPU_CHECK`), in a process of its own and within its time budget.

A lab that needs more GPUs than the machine has is a skip naming how many (its gpu profile would run
the cpu profile on CPU processes: no GPU code, and minutes of gloo); one that needs a package the
machine lacks is a skip naming it; one that runs past its seconds is stopped and reported over its
budget. A lab that ran says what it left out (its figures without matplotlib, an exercise's grading
without cloudpickle).
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

from labkit.course.gpu_budget import LAB_S, Budget, run_apart
from labkit.course.gpu_guard import _guarded
from labkit.course.gpu_items import Item, Setting, has, log
from labkit.labs.parameters import MIN_GPUS
from labkit.labs.profiles import GPU_CHECK
from labkit.labs.script import LabSkipped


# A lab in a process of its own: nothing it leaves (deterministic mode, recorded values, GPU tensors
# until the next collection) reaches the next lab. Exit status 3: it needs a package that is missing.
_CHILD = """
import json, pathlib, sys
from labkit.labs.runner import run_lab
from labkit.labs.script import LabSkipped, missing
kw = json.loads(sys.argv[1])
kw["out_dir"] = pathlib.Path(kw["out_dir"])
try:
    print(run_lab(**kw))
except LabSkipped as e:
    sys.exit(print(e, file=sys.stderr) or 3)
except ModuleNotFoundError as e:
    sys.exit(print(f"needs {missing(e)}", file=sys.stderr) or 3)
except Exception as e:
    if getattr(e, "ename", None) != "ModuleNotFoundError":
        raise
    sys.exit(print(getattr(e, "evalue", e), file=sys.stderr) or 3)
"""


class LabFailed(RuntimeError):
    """A lab's process failed: the message's first line is its error, then the end of what it printed."""


class LabOver(RuntimeError):
    """A lab ran past its time budget and was stopped."""


def run_lab_apart(name: str, profile: str, out: Path, overrides: dict, as_script: bool, gpus: int | None,
                  seconds: float = 3600.0) -> Path:
    """:func:`labkit.labs.runner.run_lab` in a new process, stopped after ``seconds``; the path of the
    metrics it wrote."""
    kw = dict(name=name, profile=profile, out_dir=str(out), force=True, overrides=overrides, as_script=as_script,
              gpus=gpus, quiet=True)
    code, stdout, stderr = run_apart([sys.executable, "-c", _CHILD, json.dumps(kw)], seconds)
    err = [ln for ln in stderr.strip().splitlines() if ln.strip()]
    if code is None:
        raise LabOver(f"ran past its {seconds:.0f} s and was stopped")
    if code == 3:
        raise LabSkipped(err[-1] if err else f"lab {name!r} needs a package that is not installed")
    if code:
        tail = "\n".join(err[-40:])
        raise LabFailed(f"{err[-1] if err else f'exit status {code}'}\n{tail}")
    return Path(stdout.strip().splitlines()[-1])


def _left_out(path: Path) -> str:
    """What a lab's run left out (its figures, an exercise's grading), from its metrics."""
    try:
        left = json.loads(path.read_text()).get("environment", {}).get("left_out", [])
    except (OSError, ValueError, AttributeError):
        return ""
    return f"; left out: {'; '.join(left)}" if left else ""


def lab_items(s: Setting, labs: list[str], profile: str, out: Path, as_script: bool = False,
              budget: Budget | None = None) -> list[Item]:
    """Every lab under ``profile`` (trimmed for the check when it is ``gpu``), one item each, each within
    its time budget; a lab that needs more GPUs than there are is a skip naming how many."""
    notebook = not as_script and has("papermill") and has("jupytext") and has("ipykernel")
    budget = budget or Budget(None)
    items = []
    for name in labs:
        overrides = GPU_CHECK.get(name, {}) if profile == "gpu" else {}
        how = "papermill" if notebook else "as a script"
        need = MIN_GPUS.get(name, 1)
        seconds = budget.grant(LAB_S[s.device])
        if profile == "gpu" and need > s.world:
            # its gpu profile would run the cpu profile on CPU processes: no GPU code, minutes of gloo
            items.append(Item(f"lab {name}", "skip", f"needs {need} GPUs and this machine has {s.world}"))
            log(f"SKIP lab {name}: {items[-1].detail}")
            continue
        if seconds is None:
            items.append(Item(f"lab {name}", "skip", budget.spent()))
            log(f"SKIP lab {name}: {items[-1].detail}")
            continue

        def run(name=name, overrides=overrides, seconds=seconds) -> list[Item]:
            try:
                path = run_lab_apart(name, profile, out, overrides, not notebook, s.world if profile == "gpu" else None,
                                     seconds)
            except LabOver as e:
                short = budget.total and seconds < LAB_S[s.device]
                cut = "; that was what the check's budget had left" if short else ""
                return [Item(f"lab {name}", "over", f"{e}{cut}")]
            return [Item(f"lab {name}", "pass", f"{profile} profile{' (trimmed)' if overrides else ''}, {how}: "
                         f"metrics in {path}{_left_out(path)}")]

        items += _guarded(f"lab {name}", run)
    return items
