"""Planted bug, strategy_cost: the "best" interval is Young's sqrt(2 C M), not the minimum of E.

Close enough for 2-minute checkpoints on a 2.4 h MTBF (the visible test); minutes to hours off for
slow checkpoints on an unreliable fleet (hidden tests).
"""
# -- grade_id: sc_checkpoint_interval --
import math


def expected_wall_hours(work_h, mtbf_h, interval_h, checkpoint_h, restart_h):
    if interval_h is None:
        return (mtbf_h + restart_h) * math.expm1(work_h / mtbf_h)
    tau = min(interval_h, work_h)
    return (work_h / tau) * (mtbf_h + restart_h) * math.expm1((tau + checkpoint_h) / mtbf_h)


def best_interval_hours(work_h, mtbf_h, checkpoint_h, restart_h):
    return min(math.sqrt(2 * checkpoint_h * mtbf_h), work_h)
