"""Planted bug, memory: stage 2 forgets to shard the gradients (it is stage 1's formula)."""
# -- grade_id: mem_zero_bytes --
import math


def zero_bytes_per_device(n_params, world_size, stage, k=12):
    if stage not in (0, 1, 2, 3):
        raise ValueError(f"stage={stage!r} is unknown; valid ZeRO stages: [0, 1, 2, 3]")
    psi, n = n_params, world_size
    weights = 2 * psi / n if stage >= 3 else 2 * psi
    grads = 2 * psi / n if stage >= 3 else 2 * psi
    optimizer = k * psi / n if stage >= 1 else k * psi
    return math.ceil(weights + grads + optimizer)
