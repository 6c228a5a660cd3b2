"""Progress bars: tqdm's where it is installed, a silent stand-in where it is not (a bare GPU image
with CUDA torch and little else still trains; only the bar is missing)."""
from __future__ import annotations

from typing import Any

try:
    from tqdm import tqdm
except ModuleNotFoundError:  # the same calls, doing nothing

    class tqdm:  # noqa: N801 - tqdm's own name, so callers do not care which they got
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            pass

        def update(self, n: int = 1) -> None:
            pass

        def set_postfix(self, *args: Any, **kwargs: Any) -> None:
            pass

        def close(self) -> None:
            pass

__all__ = ["tqdm"]
