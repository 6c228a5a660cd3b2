"""The failures-at-scale chapter's schematic, drawn from the code it describes.

Left: where :class:`labkit.fault_tolerance.peer_checkpoint.PeerSnapshot` keeps each rank's in-memory
checkpoint (:func:`~labkit.fault_tolerance.peer_checkpoint.holder`), and where a replaced rank's
comes back from. Right: the shares of the global batch each replica computes, step by step, while
one replica is gone, under the two policies of :mod:`labkit.fault_tolerance.elastic`
(:func:`~labkit.fault_tolerance.elastic.shares_of`). :mod:`labkit.labs.schematics` writes it to
``book/images`` with the book's other schematics (``python -m labkit.labs.schematics``), and
``tests/test_schematics.py`` regenerates it and compares byte for byte.
"""
from __future__ import annotations

from labkit.fault_tolerance.elastic import shares_of
from labkit.fault_tolerance.peer_checkpoint import holder
from labkit.labs.svg import ALERT, INK, OWNER_FILL, OWNER_STROKE, Svg

RING, REPLICAS, STEPS, GONE = 4, 3, 8, (3, 6)  # replica 1 missing for steps 3..5 (0-based)


def _ring(svg: Svg, x0: float, y0: float) -> None:
    svg.text(x0 + 150, y0, f"In-memory checkpoints: {RING} ranks in a ring", anchor="middle", size=14,
             weight="bold")
    for r in range(RING):
        x = x0 + r * 78
        svg.rank_box(x, y0 + 14, 66, 26, f"rank {r}")
        svg.rect(x, y0 + 46, 66, 22, fill=OWNER_FILL[r], stroke=OWNER_STROKE[r], stroke_width=0.8)
        svg.text(x + 33, y0 + 61, f"own {r}", anchor="middle", size=11)
        held = next(k for k in range(RING) if holder(k, RING) == r)
        svg.rect(x, y0 + 72, 66, 22, fill=OWNER_FILL[held], stroke=OWNER_STROKE[held], stroke_width=0.8,
                 stroke_dasharray="3 2")
        svg.text(x + 33, y0 + 87, f"holds {held}", anchor="middle", size=11)
    lost = 2
    x_lost, x_hold = x0 + lost * 78 + 33, x0 + holder(lost, RING) * 78 + 33
    svg.text(x_lost, y0 + 122, "✕ killed: a new", anchor="middle", fill=ALERT, size=11)
    svg.text(x_lost, y0 + 136, "process, empty", anchor="middle", fill=ALERT, size=11)
    svg.arrow(x_hold, y0 + 98, x_lost + 14, y0 + 110, stroke=ALERT)
    svg.text(x0, y0 + 162, f"after each step: rank r sends its snapshot to rank r+1 (mod {RING});",
             fill=INK, size=11)
    svg.text(x0, y0 + 178, f"a replaced rank {lost} gets it back from rank {holder(lost, RING)}, no disk read",
             fill=INK, size=11)


def _grid(svg: Svg, x0: float, y0: float, policy: str, why: str) -> None:
    svg.text(x0, y0, f"{policy}: {why}", size=13, weight="bold")
    cw, ch = 34, 22
    for t in range(STEPS):
        svg.text(x0 + 74 + t * cw + cw / 2, y0 + 18, str(t + 1), anchor="middle", size=10, fill=INK)
    for rep in range(REPLICAS):
        y = y0 + 24 + rep * (ch + 4)
        svg.text(x0, y + 15, f"replica {rep}", size=11)
        for t in range(STEPS):
            members = [m for m in range(REPLICAS) if not (m == 1 and GONE[0] <= t < GONE[1])]
            x = x0 + 74 + t * cw
            if rep not in members:
                svg.rect(x, y, cw - 3, ch, fill="white", stroke=ALERT, stroke_dasharray="3 2")
                continue
            shares = shares_of(policy, members, rep, REPLICAS)
            svg.rect(x, y, cw - 3, ch, fill=OWNER_FILL[rep] if len(shares) == 1 else OWNER_FILL[1],
                     stroke=OWNER_STROKE[rep], stroke_width=0.8)
            svg.text(x + (cw - 3) / 2, y + 15, "+".join(map(str, shares)), anchor="middle", size=10)


def failures_at_scale() -> str:
    svg = Svg(760, 310, "In-memory checkpoints kept by a peer, and replicas that train through a lost one")
    _ring(svg, 20, 30)
    _grid(svg, 372, 30, "shrink", "survivors' shares only")
    _grid(svg, 372, 150, "cover", "the lost share as an extra micro-batch")
    svg.text(372, 270, "cells: the shares of the global batch each replica computes per step;", fill=INK,
             size=11)
    svg.text(372, 286, "dashed: replica 1 gone, replaced by torchrun, rejoined by the survivors", fill=INK,
             size=11)
    return svg.render()


FIGURES = {"failures_at_scale.svg": failures_at_scale}
