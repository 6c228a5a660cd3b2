"""Parallel runs held against one process on the same data, as the labs show it: the largest difference
in loss and in parameters, printed, and the loss curves beside their deviation from the reference.

Every parallel lab opens this way (data, tensor and pipeline parallelism, ZeRO and FSDP): the same GPT,
seed and global batch trained by one process and by each layout, step by step. In fp32 a correct
layout differs from one process only in the order of its sums; the red line at 1e-5 is the
tolerance the tests hold each run's loss to.
"""
from __future__ import annotations

from typing import Any

import numpy as np

TOLERANCE = 1e-5  # the fp32 tolerance the tests hold a parallel run's loss to (tests/test_labs.py)
FLOOR = 1e-9  # where an exact 0 is drawn on the log axis


def deviations(ref: dict, runs: dict[str, dict]) -> tuple[dict[str, float], dict[str, float]]:
    """Per run, the largest ``|loss - single|`` over the steps and, where both returned their
    parameters (``return_params=True``), the largest ``|parameter - single|`` after the last."""
    ref_loss = np.array(ref["loss"])
    dev = {k: float(np.abs(np.array(r["loss"]) - ref_loss).max()) for k, r in runs.items()}
    pdev = {k: max((ref["params"][n] - r["params"][n]).abs().max().item() for n in ref["params"])
            for k, r in runs.items() if "params" in r and "params" in ref}
    return dev, pdev


def against_single(ref: dict, runs: dict[str, dict], title: str,
                   also: dict[str, list[float]] | None = None) -> tuple[dict, dict, Any]:
    """Print each run's deviations (:func:`deviations`) and draw its loss curve beside its deviation
    from ``ref`` per step; ``also``: other references' losses, drawn dotted in the deviation panel and
    printed. Returns ``(loss deviations, parameter deviations, figure)``."""
    import matplotlib.pyplot as plt

    dev, pdev = deviations(ref, runs)
    width = max(len(k) for k in (*runs, *(also or {})))
    for k in runs:
        params = f"   max |param - single| {pdev[k]:.1e}" if k in pdev else ""
        print(f"{k:{width}} max |loss - single| {dev[k]:.1e}{params}")
    ref_loss = np.array(ref["loss"])
    for k, loss in (also or {}).items():
        print(f"{k:{width}} max |loss - single| {np.abs(np.array(loss) - ref_loss).max():.1e}")
    fig, (ax, ax2) = plt.subplots(1, 2, figsize=(10, 3.6))
    steps = np.arange(1, len(ref_loss) + 1)
    ax.plot(steps, ref_loss, lw=4, alpha=0.35, color="k", label="single process")
    for k, r in runs.items():
        ax.plot(steps, r["loss"], lw=1, label=k)
        ax2.semilogy(steps, np.maximum(np.abs(np.array(r["loss"]) - ref_loss), FLOOR), ".-", ms=3, label=k)
    for k, loss in (also or {}).items():
        ax2.semilogy(steps, np.maximum(np.abs(np.array(loss) - ref_loss), FLOOR), "k:", lw=1, label=k)
    ax.set(xlabel="step", ylabel="training loss", title=title)
    ax2.axhline(TOLERANCE, color="red", ls=":", label=f"{TOLERANCE:g}")
    ax2.set(xlabel="step", ylabel=f"|loss - single| (0 drawn at {FLOOR:g})", title="Deviation from the reference")
    ax.legend(fontsize=7)
    ax2.legend(fontsize=6, ncol=2 if len(runs) > 4 else 1)
    fig.tight_layout()
    plt.show()
    return dev, pdev, fig
