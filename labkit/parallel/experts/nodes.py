"""Where the experts sit: expert parallelism across nodes, each token sent once to each node it chose
(DeepSeek-AI 2024, DeepSeek-V3, section 3.2.2).

A flat all-to-all (:class:`labkit.parallel.experts.placement.ExpertParallelPlacement`) sends every
token-choice to its expert's rank: a token whose k experts sit on three other nodes crosses the
network up to k times, and of uniform traffic ``(n - per_node) / n`` leaves the node
(:func:`labkit.comm.all_to_all.all_to_all_split`). DeepSeek-V3 sends each token "via IB to the GPUs
with the same in-node index on its target nodes", which forward it "via NVLink to specific GPUs that
host their target experts", and bounds the nodes a token may choose (node-limited routing,
:func:`labkit.core.moe_routing.choose`), so a token crosses the network at most M times whatever k is.

:class:`NodeLimitedPlacement` does that in two all-to-alls each way, real ones (``all_to_all_single``):

1. **across nodes** (the *rail* group: the EP ranks with this rank's in-node index, one per node): one
   row per (token, chosen node); a token's own node is a send to itself, no wire;
2. **inside the node** (the *node* group): the rank it landed on forwards one row per token-choice to
   the rank holding that expert.

The outputs come back the same way, and the landing rank adds up a token's weighted outputs before
they cross the network again (DeepSeek's "NVLink-to-IB forwarding and accumulation"), so the combine
sends as many rows across nodes as the dispatch. Backward runs both all-to-alls in reverse
(:class:`~labkit.parallel.experts.placement.AllToAll`). :func:`routed_rows` counts the rows each
scheme sends from the routing alone; the lab and tests hold the bytes counted on the wire to it.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn

from labkit.core.moe_grouped import run_experts
from labkit.parallel.experts.placement import AllToAll, ExpertParallelPlacement
from labkit.parallel.layout.mesh import ParallelDims
from labkit.parallel.layout.mesh_nodes import node_groups


def _splits(sizes: torch.Tensor, group) -> tuple[list[int], list[int]]:
    """(what I receive from each peer, what I send each): one all-to-all of the counts."""
    recv = torch.empty_like(sizes)
    dist.all_to_all_single(recv, sizes, group=group)
    return recv.tolist(), sizes.tolist()


def _ints(x: torch.Tensor, out_splits: list[int], in_splits: list[int], group) -> torch.Tensor:
    """Routing metadata (indices) alongside the rows; not token bytes, not counted."""
    out = x.new_empty(sum(out_splits))
    dist.all_to_all_single(out, x.contiguous(), out_splits, in_splits, group=group)
    return out


class NodeLimitedPlacement(ExpertParallelPlacement):
    """An EP group of ``ep`` ranks on ``ep / per_node`` nodes; tokens dispatched in two hops (module
    docstring). Routing and capacity stay :class:`~labkit.core.moe.MoEMLP`'s."""

    def __init__(self, dims: ParallelDims, n_experts: int, per_node: int, groups=None, a2a=None) -> None:
        super().__init__(dims, n_experts, a2a)
        self.per_node = per_node
        self.rail, self.node = groups or node_groups(dims, per_node)

    def combine(self, experts: nn.ModuleDict, h: torch.Tensor, order: torch.Tensor, gates: torch.Tensor,
                counts: list[int], impl: str = "auto") -> torch.Tensor:
        n_tok, k, local, dev = h.shape[0], self.per_node, self.local, h.device
        nodes = self.dims.degrees.ep // k
        expert = torch.repeat_interleave(torch.arange(len(counts), device=dev), torch.tensor(counts, device=dev))
        tok, gate = order % n_tok, gates[order // n_tok, order % n_tok]
        # Hop 1 across nodes: one row per (node, token), sorted by node; each choice keeps its pair.
        pair, which = torch.unique(expert // local // k * n_tok + tok, return_inverse=True)
        pair_node = pair // n_tok
        pairs_per_node = torch.bincount(pair_node, minlength=nodes)
        rows_in, rows_out = _splits(pairs_per_node, self.rail)
        x1 = self.a2a(h[pair % n_tok], rows_in, rows_out, self.rail)
        by_pair = torch.argsort(which, stable=True)  # choices in pair order, so in node order too
        first = pairs_per_node.cumsum(0) - pairs_per_node
        local_pair = which[by_pair] - first[pair_node[which[by_pair]]]  # pair index within its node's block
        ch_in, ch_out = _splits(torch.bincount(pair_node[which], minlength=nodes), self.rail)
        c_pair = _ints(local_pair, ch_in, ch_out, self.rail)
        c_expert = _ints(expert[by_pair], ch_in, ch_out, self.rail)
        c_gate = AllToAll.apply(gate[by_pair].unsqueeze(1), ch_in, ch_out, self.rail, False).squeeze(1)
        src_first = torch.tensor([0, *rows_in], device=dev).cumsum(0)[:-1]
        c_pair = c_pair + torch.repeat_interleave(src_first, torch.tensor(ch_in, device=dev))  # rows of x1
        # Hop 2 inside the node: one row per choice to its expert's rank, sorted by that rank.
        dest = c_expert // local % k
        fwd = torch.argsort(dest * len(counts) + c_expert, stable=True)
        in2, out2 = _splits(torch.bincount(dest, minlength=k), self.node)
        x2 = self.a2a(x1[c_pair[fwd]], in2, out2, self.node)
        e2 = _ints(c_expert[fwd], in2, out2, self.node) - self.first
        perm = torch.argsort(e2, stable=True)
        mine = [experts[str(self.first + e)] for e in range(local)]
        y = run_experts(mine, x2[perm], torch.bincount(e2, minlength=local).tolist(), impl)
        y2 = self.a2a(y[torch.argsort(perm)], out2, in2, self.node)  # back to the landing rank
        # Sum each token's weighted outputs on the landing rank, then one row back across nodes.
        y2 = y2 * c_gate[fwd].unsqueeze(1).to(y2.dtype)
        partial = y2.new_zeros(x1.shape[0], y2.shape[1]).index_add(0, c_pair[fwd], y2)
        back = self.a2a(partial, rows_out, rows_in, self.rail)
        return back.new_zeros(n_tok, back.shape[1]).index_add(0, pair % n_tok, back)


def on_nodes(per_node: int):
    """A placement factory for :func:`~labkit.parallel.experts.placement.place_experts`'s ``make``: two
    hops, ``per_node`` ranks a node; the rail and node groups are built once per mesh, by the first
    block, on every rank."""
    built: dict[int, tuple] = {}

    def make(dims: ParallelDims, n_experts: int, a2a=None) -> NodeLimitedPlacement:
        if id(dims) not in built:
            built[id(dims)] = node_groups(dims, per_node)
        return NodeLimitedPlacement(dims, n_experts, per_node, built[id(dims)], a2a)
    return make


def routed_rows(experts: torch.Tensor, rank: int, local: int, per_node: int, two_hop: bool) -> dict[str, int]:
    """Rows sent by one dispatch of rank ``rank``'s tokens, from their chosen experts ``(N, k)`` alone:
    ``leaving`` their node and ``inside`` it (between two ranks of a node). Flat: each choice goes to
    its expert's rank. Two hops: one row per (token, other node it chose), then one row per choice
    from the rank it lands on (same in-node index) to its expert's rank, when they differ. The
    combine sends the same rows back and backward both again: 4 x these rows per MoE block and step."""
    home, index = rank // per_node, rank % per_node
    dest = experts // local  # (N, k) ranks
    node = dest // per_node
    if not two_hop:
        return {"leaving": int((node != home).sum()), "inside": int(((node == home) & (dest != rank)).sum())}
    first = torch.zeros_like(node, dtype=torch.bool)  # each (token, node) once: its first choice there
    for j in range(node.shape[1]):
        first[:, j] = (node[:, :j] != node[:, j:j + 1]).all(dim=1)
    return {"leaving": int((first & (node != home)).sum()), "inside": int((dest != node * per_node + index).sum())}
