"""How long a collective takes on a group of ranks laid out on nodes: latency per step and bandwidth.

A group is ``n`` ranks, ``k`` of them in each node it spans. The latency-bandwidth (alpha-beta)
model (Hockney 1994; Thakur et al. 2005 for the ring algorithms) with NCCL's own constants
(:mod:`labkit.planning.hardware`):

* **ring all-reduce** sends 2(n-1)/n of the message per rank in 2(n-1) steps; **all-gather** and
  **reduce-scatter** half of that, in n-1 steps (Thakur et al. 2005). A ring that spans nodes takes
  2(nodes-1) of its steps across the network, the others over NVLink (NCCL ``tuning.cc``).
* **tree all-reduce** (NCCL's double binary tree, Sanders et al. 2009) takes 2 log2(nodes) network
  steps: at thousands of ranks the ring's 2(n-1) steps cost more than the bytes. NCCL picks the
  faster of the two; so does this model, with the same bandwidth term for both.
* **bandwidth across nodes**: each GPU has its own NIC (rail-optimised clusters), so a ring with
  ``k`` ranks per node spreads its cross-node traffic over ``k`` NICs: ``k`` times one NIC's bus
  bandwidth, at most NVLink's. A data-parallel group with one rank per node (TP = 8 inside) gets one
  NIC's worth.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from labkit.comm.all_to_all import all_to_all_split
from labkit.planning.hardware import Hardware


@dataclass(frozen=True)
class Group:
    """``n`` ranks, ``per_node`` of them in each node they span."""

    n: int
    per_node: int

    @property
    def nodes(self) -> int:
        return self.n // self.per_node


def group(n: int, stride: int, devices_per_node: int) -> Group:
    """The group of ``n`` ranks ``stride`` apart (ranks numbered node by node): how many share a node."""
    if n <= 1:
        return Group(1, 1)
    if stride >= devices_per_node:
        return Group(n, 1)
    return Group(n, max(1, min(n, devices_per_node // stride)))


def _bandwidth(hw: Hardware, g: Group) -> float:
    if g.nodes <= 1:
        return hw.node.busbw_gb_per_s * 1e9
    return min(hw.node.busbw_gb_per_s, g.per_node * hw.network.busbw_gb_per_s) * 1e9


def _ring_latency(hw: Hardware, g: Group, steps: int, inter_steps: int) -> float:
    inter = min(steps, inter_steps) if g.nodes > 1 else 0
    return hw.base_latency_s + (steps - inter) * hw.node.step_latency_s + inter * hw.network.step_latency_s


def all_reduce(hw: Hardware, g: Group, nbytes: float) -> float:
    """Seconds for an all-reduce of ``nbytes`` per rank: the faster of ring and tree."""
    if g.n <= 1 or nbytes <= 0:
        return 0.0
    wire = 2 * (g.n - 1) / g.n * nbytes / _bandwidth(hw, g)
    ring = _ring_latency(hw, g, 2 * (g.n - 1), 2 * (g.nodes - 1)) + wire
    if g.nodes <= 1:
        return ring
    tree = (hw.base_latency_s + 2 * ((g.per_node - 1) * hw.node.step_latency_s
                                      + math.log2(g.nodes) * hw.network.step_latency_s) + wire)
    return min(ring, tree)


def all_gather(hw: Hardware, g: Group, nbytes: float) -> float:
    """Seconds for an all-gather (or a reduce-scatter) whose full result is ``nbytes``."""
    if g.n <= 1 or nbytes <= 0:
        return 0.0
    return _ring_latency(hw, g, g.n - 1, g.nodes - 1) + (g.n - 1) / g.n * nbytes / _bandwidth(hw, g)


reduce_scatter = all_gather


def all_to_all(hw: Hardware, g: Group, nbytes: float) -> float:
    """Seconds for an all-to-all of ``nbytes`` per rank, each rank sending ``nbytes / n`` to every other.

    Not a ring: NCCL runs it as one send and one receive per peer, all at once, so no byte is
    forwarded and the ring's trick of spreading a node's cross-node traffic over its NICs does not
    apply. Of what a rank sends, ``(k - 1) / n`` stays in its node (NVLink) and ``(n - k) / n``
    leaves it through the rank's own NIC (rail-optimised: one NIC per GPU), so a node of ``k``
    ranks pushes ``k (n - k) / n`` of a rank's bytes through its ``k`` NICs; both parts move at once
    and the slower decides (DeepSeek-AI 2024, section 3.2.2, on the same split of IB and NVLink).
    The split is :func:`labkit.comm.all_to_all.all_to_all_split`, the formula the expert-parallel
    lab's measured bytes are held to."""
    if g.n <= 1 or nbytes <= 0:
        return 0.0
    inside_bytes, leaving_bytes = all_to_all_split(g.n, g.per_node, nbytes)
    inside = inside_bytes / (hw.node.busbw_gb_per_s * 1e9)
    leaving = leaving_bytes / (hw.network.busbw_gb_per_s * 1e9)
    latency = hw.network.step_latency_s if g.nodes > 1 else hw.node.step_latency_s
    return hw.base_latency_s + latency + max(inside, leaving)


def send(hw: Hardware, nbytes: float, across_nodes: bool) -> float:
    """Seconds for one point-to-point transfer (a pipeline stage's activations)."""
    if nbytes <= 0:
        return 0.0
    link = hw.network if across_nodes else hw.node
    return hw.base_latency_s + link.step_latency_s + nbytes / (link.busbw_gb_per_s * 1e9)
