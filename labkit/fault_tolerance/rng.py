"""Every random number generator a rank draws from, captured and restored, so a resumed run continues
bit for bit (Python's, NumPy's, torch's CPU generator and, when CUDA is in use, every GPU's). Where
NumPy is not installed (a bare GPU image) nothing can draw from it, and its state is left out.
"""
from __future__ import annotations

import random

import torch

try:
    import numpy as np
except ModuleNotFoundError:
    np = None


def rng_state() -> dict:
    """This process's RNG states: Python, NumPy, torch CPU and, when CUDA is in use, every GPU's."""
    state = {"python": random.getstate(), "torch": torch.get_rng_state()}
    if np is not None:
        np_state = np.random.get_state()
        state["numpy"] = [np_state[0], np_state[1].tolist(), *map(_py, np_state[2:])]
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def seed_rngs(seed: int, rank: int = 0) -> None:
    """Seed Python, NumPy and torch (CPU and CUDA) per rank, so a run's random draws (dropout) depend
    on its seed and rank only, not on what the process did before."""
    s = seed * 1_000_003 + rank
    random.seed(s)
    if np is not None:
        np.random.seed(s % 2**32)
    torch.manual_seed(s)


def _py(v):
    return v.item() if hasattr(v, "item") else v


def set_rng_state(state: dict) -> None:
    random.setstate(state["python"])
    if np is not None and "numpy" in state:
        kind, key, *rest = state["numpy"]
        np.random.set_state((kind, np.array(key, dtype=np.uint32), *rest))
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
