"""Planted bug, pipeline_parallel: a backward waits only for the same stage's forward.

The clock ignores that the gradient of a microbatch comes from the next stage, so every stage
starts its backwards at once: no bubble, and a step shorter than any real pipeline's.
"""
# -- grade_id: pp_gpipe_schedule --
def gpipe_order(p, s, m):
    return [("F", i) for i in range(m)] + [("B", i) for i in range(m)]


def simulate(orders, t_f=1.0, t_b=2.0):
    p = len(orders)
    times, pos, free = {}, [0] * p, [0.0] * p
    while any(pos[s] < len(orders[s]) for s in range(p)):
        progressed = False
        for s in range(p):
            while pos[s] < len(orders[s]):
                kind, i = orders[s][pos[s]]
                dep = (None if s == 0 else (s - 1, "F", i)) if kind == "F" else (s, "F", i)
                if dep is not None and dep not in times:
                    break
                start = max(free[s], times[dep][1] if dep is not None else 0.0)
                end = start + (t_f if kind == "F" else t_b)
                times[(s, kind, i)] = (start, end)
                free[s], pos[s], progressed = end, pos[s] + 1, True
        if not progressed:
            raise ValueError("orders deadlock")
    return times
