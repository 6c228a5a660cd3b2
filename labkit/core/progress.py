"""Progress bars, drawn where the person is looking.

- In a terminal: tqdm's text bar, for runs long enough to want one (50 steps or more).
- In a Jupyter notebook: tqdm's notebook widget (``tqdm.auto``), for every run.
- In a rank that :func:`labkit.launch.launch` started from either: the rank draws nothing; it
  forwards its count to the caller (:func:`forward_to`), which draws the bar where the rank's
  own stderr would not reach (a notebook shows the kernel's widgets, not a child's terminal codes).
- Under papermill (``labkit run``, the book) no bars: ``LABKIT_PROGRESS=0``. ``LABKIT_PROGRESS=1``
  forces them on.

Where tqdm is not installed (a bare GPU image with CUDA torch and little else) the same calls do
nothing: only the bar is missing.
"""
from __future__ import annotations

import os
import sys
import time
from typing import Any, Callable

try:
    from tqdm.auto import tqdm
except ModuleNotFoundError:  # the same calls, doing nothing

    class tqdm:  # noqa: N801 - tqdm's own name, so callers do not care which they got
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            self.n = kwargs.get("initial", 0)

        def update(self, n: int = 1) -> None:
            self.n += n

        def set_postfix(self, *args: Any, **kwargs: Any) -> None:
            pass

        def refresh(self) -> None:
            pass

        def close(self) -> None:
            pass

ENV = "LABKIT_PROGRESS"
LONG_RUN = 50  # steps: a terminal gets a bar from here on (a notebook always does)
_sink: Callable[[tuple], None] | None = None


def in_notebook() -> bool:
    """True inside a Jupyter kernel (IPython's ZMQ shell)."""
    shell = sys.modules.get("IPython")
    ip = shell.get_ipython() if shell is not None and hasattr(shell, "get_ipython") else None
    return type(ip).__name__ == "ZMQInteractiveShell"


def wanted(steps: int | None) -> bool:
    """Whether a run of ``steps`` should show a bar here (module docstring); ``LABKIT_PROGRESS``
    decides when it is set."""
    env = os.environ.get(ENV) or None  # empty: unset (a job script's unset variable)
    if env in ("0", "1"):
        return env == "1"
    if env is not None:
        raise ValueError(f"{ENV}={env!r} must be 1 (draw progress bars) or 0 (none), or unset (bars where a "
                         "person is looking)")
    if in_notebook():
        return True
    return sys.stderr.isatty() and (steps or 0) >= LONG_RUN


def forward_to(send: Callable[[tuple], None] | None) -> None:
    """In a launched rank: send bar updates to the caller through ``send`` instead of drawing them."""
    global _sink
    _sink = send


class _Forwarded:
    """A bar whose count goes to the process that launched this rank, twice a second at most."""

    def __init__(self, send: Callable[[tuple], None], total: int | None, initial: int, desc: str) -> None:
        self.send, self.total, self.n, self.desc = send, total, initial, desc
        self.postfix: dict = {}
        self.sent = 0.0
        self.send(("open", desc, initial, total, {}))

    def update(self, n: int = 1) -> None:
        self.n += n
        if time.monotonic() - self.sent >= 0.5 or (self.total is not None and self.n >= self.total):
            self.sent = time.monotonic()
            self.send(("update", self.desc, self.n, self.total, dict(self.postfix)))

    def set_postfix(self, refresh: bool = True, **kwargs: Any) -> None:
        self.postfix.update(kwargs)

    def close(self) -> None:
        self.send(("close", self.desc, self.n, self.total, dict(self.postfix)))


def bar(total: int | None, desc: str, show: bool, initial: int = 0) -> Any:
    """A progress bar over ``total`` steps, or one that draws nothing when ``show`` is false."""
    if show and _sink is not None:
        return _Forwarded(_sink, total, initial, desc)
    return tqdm(total=total, initial=initial, desc=desc, disable=not show, mininterval=1.0)


class Drawn:
    """The caller's side of forwarded bars: one tqdm bar per rank and description."""

    def __init__(self) -> None:
        self.bars: dict[tuple[int, str], Any] = {}

    def __call__(self, rank: int, message: tuple) -> None:
        kind, desc, n, total, postfix = message
        key = (rank, desc)
        if key not in self.bars:
            self.bars[key] = tqdm(total=total, initial=n, desc=desc, mininterval=0)
        b = self.bars[key]
        b.update(n - b.n)
        if postfix:
            b.set_postfix(**postfix, refresh=False)
        b.refresh()
        if kind == "close":
            self.bars.pop(key).close()

    def close(self) -> None:
        for b in self.bars.values():
            b.close()
        self.bars.clear()


__all__ = ["tqdm", "bar", "wanted", "in_notebook", "forward_to", "Drawn", "ENV"]
