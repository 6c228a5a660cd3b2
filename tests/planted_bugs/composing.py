"""Planted bug, composing: the first dimension varies fastest, not the last."""
# -- grade_id: cmp_coords --
import math


def coords(rank, degrees):
    world = math.prod(degrees.values())
    if not 0 <= rank < world:
        raise ValueError(f"rank={rank} must be in range({world})")
    out = {}
    for dim in degrees:
        rank, out[dim] = divmod(rank, degrees[dim])
    return {dim: out[dim] for dim in degrees}


def group_of(rank, dim, degrees):
    mine = coords(rank, degrees)
    world = math.prod(degrees.values())
    return [r for r in range(world)
            if all(v == mine[k] for k, v in coords(r, degrees).items() if k != dim)]
