"""Planted bug, failures_at_scale: every rank compared with rank 0 instead of the majority.

Right whenever rank 0 is healthy; when rank 0 itself holds the flipped bit, it blames every other
rank, and it never notices a tie.
"""
# -- grade_id: fas_suspects --
def suspects(table):
    if not table or len({len(row) for row in table}) != 1:
        raise ValueError("every rank needs one fingerprint per tensor")
    out = set()
    for i in range(len(table[0])):
        out |= {r for r, row in enumerate(table) if row[i] != table[0][i]}
    return sorted(out)
