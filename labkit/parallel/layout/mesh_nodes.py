"""Process groups of the mesh that follow the machine's nodes: an EP group's rails and nodes.

Like every group, built only here and in :mod:`labkit.parallel.layout.mesh` (tests/test_architecture.py).
"""
from __future__ import annotations

import torch.distributed as dist

from labkit.parallel.layout.mesh import ParallelDims



def node_groups(dims: ParallelDims, per_node: int) -> tuple[dist.ProcessGroup, dist.ProcessGroup]:
    """This rank's (rail, node) groups inside its EP group, built by every rank for every EP group in
    the same order (``new_group`` is a collective): the
    two-hop expert dispatch's groups (:mod:`labkit.parallel.experts.nodes`). The EP ranks must be neighbours, node by node."""
    ep = dims.degrees.ep
    if per_node < 1 or ep % per_node:
        raise ValueError(f"per_node={per_node} must divide ep={ep}")
    mine = None
    for ranks in dims.degrees.groups().get("ep", [list(range(dims.world))]):
        if ranks != list(range(ranks[0], ranks[0] + ep)) or ranks[0] % per_node:
            raise ValueError(f"ep's ranks {ranks} are not neighbours on whole nodes of {per_node}: put ep "
                             "innermost (no cp or tp inside it)")
        rails = [dist.new_group(ranks[i::per_node]) for i in range(per_node)]
        nodes = [dist.new_group(ranks[j:j + per_node]) for j in range(0, ep, per_node)]
        if dims.rank in ranks:
            r = dims.rank - ranks[0]
            mine = (rails[r % per_node], nodes[r // per_node])
    return mine
