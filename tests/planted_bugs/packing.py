"""Planted bug, packing: best fit, but in arrival order (no sort by decreasing length).

Every row is valid, but long sequences arriving late find the rows filled by short ones.
"""
# -- grade_id: pk_best_fit --
from bisect import bisect_left, insort


def best_fit_decreasing(lengths, capacity):
    lengths = [int(n) for n in lengths]
    if any(n > capacity for n in lengths):
        raise ValueError(f"a sequence is longer than capacity={capacity}")
    rows, open_rows = [], []
    for i, n in enumerate(lengths):
        k = bisect_left(open_rows, (n, -1))
        if k < len(open_rows):
            room, row = open_rows.pop(k)
        else:
            room, row = capacity, len(rows)
            rows.append([])
        rows[row].append(i)
        if room - n > 0:
            insort(open_rows, (room - n, row))
    return rows
