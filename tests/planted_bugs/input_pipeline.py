"""Planted bug, input_pipeline: enough workers to hide the load entirely, ceil(L / C), whatever the target.

Over-provisions whenever a small wait is allowed (and never considers 0 workers).
"""
# -- grade_id: ip_workers --
import math


def wait_fraction(load_s, compute_s, num_workers):
    for name, v in (("load_s", load_s), ("compute_s", compute_s), ("num_workers", num_workers)):
        if v < 0:
            raise ValueError(f"{name} must be >= 0, got {v!r}")
    if num_workers == 0:
        return load_s / (load_s + compute_s)
    per_batch = load_s / num_workers
    return max(0.0, per_batch - compute_s) / max(compute_s, per_batch)


def workers_needed(load_s, compute_s, target=0.05):
    return max(1, math.ceil(load_s / compute_s))
