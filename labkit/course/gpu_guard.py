"""How ``make gpu-check`` runs one part and reports it: a missing package or tool is a skip that names
it, anything else a failure with its cause in one line and the whole error kept for the JSON report."""
from __future__ import annotations

import time
import traceback
from typing import Callable

from labkit.course import gpu_items
from labkit.course.gpu_items import Item, log
from labkit.labs.script import LabSkipped, missing

STATUS = {"pass": "PASS", "fail": "FAIL", "skip": "SKIP", "over": "OVER"}  # OVER: stopped at its time budget


def cause(e: BaseException) -> tuple[str, str]:
    """A failure's short cause (one line, for the markdown) and its whole error (for the JSON): for ranks
    that failed, the first failing rank's last traceback line, not "1 rank(s) failed"."""
    from labkit.launch import RankError

    whole = "".join(traceback.format_exception(type(e), e, e.__traceback__))
    if isinstance(e, RankError) and e.failures:
        rank, tb = min(e.failures.items())
        lines = [ln.strip() for ln in tb.strip().splitlines() if ln.strip()]
        short = f"rank {rank}: {lines[-1] if lines else 'no traceback'}"
        whole = f"{whole}\n--- rank {rank}, last lines ---\n" + "\n".join(tb.strip().splitlines()[-15:])
    elif getattr(e, "ename", None):  # papermill's error from a lab's cell
        value = str(getattr(e, "evalue", "") or "").strip().splitlines()
        short = f"{e.ename}: {value[0] if value else ''}"
    else:
        lines = [ln for ln in str(e).strip().splitlines() if ln.strip()]
        short = f"{type(e).__name__}: {lines[0] if lines else ''}"
    return short[:400], whole[-20000:]


def _guarded(name: str, fn: Callable[[], list[Item]]) -> list[Item]:
    """Run one item; a missing package is a skip naming it, any other error a failure with its cause
    in one line and the whole error kept for the JSON report."""
    t0 = time.perf_counter()
    try:
        items = fn()
    except ModuleNotFoundError as e:
        items = [Item(name, "skip", f"needs {missing(e)}")]
    except LabSkipped as e:
        items = [Item(name, "skip", str(e))]
    except Exception as e:  # noqa: BLE001 - the report says what failed and goes on to the next item
        short, whole = cause(e)
        if getattr(e, "ename", None) == "ModuleNotFoundError":  # papermill's: a lab's cell lacked a package
            items = [Item(name, "skip", short.split(": ", 1)[-1])]
        else:
            items = [Item(name, "fail", short, error=whole)]
    seconds = time.perf_counter() - t0
    for it in items:
        it.seconds = it.seconds or seconds / len(items)
        log(f"{STATUS[it.status]} {it.name}: {it.detail}")
    return gpu_items.emit(items)
