"""The four-dimensional device mesh the composing chapter draws: which GPUs talk to which, and over what.

Every group drawn is one :meth:`labkit.parallel.layout.mesh.Degrees.groups` computes, ranks numbered as the
training loop's mesh numbers them; :mod:`labkit.labs.schematics` writes it with the book's other figures.
"""
from __future__ import annotations

from labkit.labs.svg import INK, OWNER_STROKE, Svg
from labkit.parallel.layout.mesh import Degrees

MESH_4D = Degrees(pp=2, dp_shard=2, cp=2, tp=2)
WHAT = {"tp": "tensor: 2 all-reduces of activations per block in forward, 2 in backward",
        "cp": "context: each attention's K and V round a ring",
        "dp_shard": "data: different rows of the batch (FSDP shards over dp_shard x cp)",
        "pp": "pipeline: one activation per microbatch, stage to stage"}
COLOR = {"tp": OWNER_STROKE[0], "cp": OWNER_STROKE[1], "dp_shard": OWNER_STROKE[2], "pp": INK}


def _node(svg: Svg, x: float, y: float, ranks: list[int], d: Degrees, stage: int) -> dict[int, tuple[float, float]]:
    """One node: its 8 GPUs in rows of data-parallel rank, columns of (context, tensor) rank."""
    svg.rect(x - 14, y - 34, 4 * 78 + 18, 2 * 84 + 18, fill="none", stroke=INK, rx=12)
    svg.text(x - 14, y - 44, f"node {stage}: pipeline stage {stage}", weight="bold")
    where = {}
    for rank in ranks:
        c = d.coords(rank)
        gx, gy = x + (c["cp"] * d.tp + c["tp"]) * 78, y + c["dp_shard"] * 84
        svg.rank_box(gx, gy, 62, 30, f"GPU {rank}")
        where[rank] = (gx, gy)
    for pair in d.groups()["tp"]:  # a dashed box round each tensor group
        if pair[0] in where:
            (ax, ay) = where[pair[0]]
            svg.rect(ax - 5, ay - 5, 78 * (d.tp - 1) + 72, 40, fill="none", stroke=COLOR["tp"], rx=8,
                     stroke_dasharray="5 3")
    for pair in d.groups()["cp"]:  # the ring's two hops, drawn as an arc above the boxes
        if pair[0] in where:
            (ax, ay), (bx, _) = where[pair[0]], where[pair[1]]
            svg.add("path", d=f"M {ax + 31} {ay - 5} Q {(ax + bx) / 2 + 31} {ay - 24} {bx + 31} {ay - 5}",
                    fill="none", stroke=COLOR["cp"], stroke_width=2)
    for pair in d.groups()["dp_shard"]:
        if pair[0] in where:
            (ax, ay), (bx, by) = where[pair[0]], where[pair[1]]
            svg.arrow(ax + 20, ay + 30, bx + 20, by, stroke=COLOR["dp_shard"], width=3, head=False)
    return where


def shard_groups(d: Degrees) -> list[list[int]]:
    """FSDP's shard groups of the dense weights: the ranks that differ only in ``dp_shard``, ``ep`` and ``cp``
    (:attr:`Degrees.shard`, the ``shard`` dimension of :class:`labkit.parallel.layout.mesh.ParallelDims`)."""
    keyed: dict[tuple, list[int]] = {}
    for r in range(d.world):
        c = d.coords(r)
        keyed.setdefault((c["pp"], c["dp_replicate"], c["tp"]), []).append(r)
    return list(keyed.values())


def mesh_4d(d: Degrees = MESH_4D) -> str:
    """16 GPUs on two nodes as pipeline 2 x data 2 x context 2 x tensor 2: the tensor and context
    groups inside a node, the pipeline's stages on different nodes."""
    svg = Svg(820, 508, f"A 4-D device mesh: {d.label().replace(' ', ' x ')} on {d.world} GPUs, two nodes")
    stride = d.world // d.pp
    _node(svg, 34, 84, list(range(stride)), d, 0)
    _node(svg, 464, 84, list(range(stride, 2 * stride)), d, 1)
    svg.arrow(354, 160, 446, 160, stroke=COLOR["pp"], width=2)
    svg.text(400, 184, f"r → r + {stride}", anchor="middle", fill=INK)
    for k, dim in enumerate(("tp", "cp", "dp_shard", "pp")):
        svg.swatch(30, 292 + 22 * k, f"{WHAT[dim]}", COLOR[dim], None)
    groups = {**d.groups(), "FSDP shard": shard_groups(d)}
    for k, dim in enumerate(("tp", "cp", "dp_shard", "FSDP shard", "pp")):
        shown = " ".join("{" + ",".join(map(str, g)) + "}" for g in groups[dim][:4 if dim != "FSDP shard" else 2])
        svg.text(30, 396 + 18 * k, f"{dim} groups: {shown} …", fill=INK)
    svg.text(30, 492, "Ranks numbered as the loop's mesh numbers them: pp, dp_replicate, dp_shard, ep, cp, tp, "
             "the last fastest.", fill=INK)
    return svg.render()


FIGURES = {"mesh_4d.svg": mesh_4d}
