"""What an all-to-all sends over which link: the one formula the planner prices expert parallelism
with (:func:`labkit.planning.collectives.all_to_all`) and the expert-parallel lab counts bytes against
(:mod:`labkit.parallel.experts.placement`, :mod:`labkit.parallel.experts.nodes`).

An all-to-all among ``n`` ranks, ``k`` of them on each node (ranks numbered node by node), each rank
holding ``nbytes`` spread evenly over the ``n`` destinations (itself included): ``nbytes / n`` stays
on the rank, ``(k - 1) / n`` of it goes to the rank's node-mates (NVLink) and ``(n - k) / n`` leaves
the node through the rank's own NIC (rail-optimised clusters, one NIC per GPU). A node of ``k``
ranks therefore pushes ``k (n - k) / n`` of one rank's bytes through its ``k`` NICs. It is not a
ring: NCCL runs it as one send and one receive per peer, nothing is forwarded, and a ring's way of
spreading a node's cross-node traffic does not apply (DeepSeek-AI 2024, section 3.2.2, splits the
same traffic between InfiniBand and NVLink).
"""
from __future__ import annotations


def all_to_all_split(n: int, per_node: int, nbytes: float) -> tuple[float, float]:
    """``(inside, leaving)``: the bytes one rank sends to its node-mates and out of its node when it
    sends ``nbytes`` evenly to all ``n`` ranks, ``per_node`` ranks a node (what stays on the rank is
    neither)."""
    if n < 1 or per_node < 1:
        raise ValueError(f"n={n} and per_node={per_node} must be at least 1")
    k = min(per_node, n)
    return (k - 1) / n * nbytes, (n - k) / n * nbytes
