"""Expert parallelism: the experts of every MoE block split over ranks, tokens sent to them and their
outputs brought back with all-to-all (GShard, Lepikhin et al. 2020, section 3; Switch Transformer,
Fedus et al. 2021, section 2.2), the rest of the model data parallel.

Layout. The EP ranks are carved out of the ranks that shard the weights (torchtitan's
``ParallelDims``: ``dp_shard = dp_shard_mod_ep x ep``, :mod:`labkit.parallel.layout.degrees`). Each EP
group holds one copy of all E experts, ``E/ep`` per rank (its i-th rank holds experts
``[i*E/ep, (i+1)*E/ep)``); ranks at the same place of every group hold the same experts. Every rank
reads its own rows of the global batch, as plain data parallelism does.

One MoE block, forward: route locally; all-reduce the routing table over *all* ranks (capacity and
drop order are those of the global batch, :mod:`labkit.core.moe`); exchange the split sizes (an
all-to-all of E counts); all-to-all the kept rows to the ranks of their experts (dispatch); run the
local experts; all-to-all the outputs back (combine). Backward: the two all-to-alls run in reverse
(:class:`AllToAll`, whose backward is the all-to-all with the split sizes swapped).

Gradients. Each rank's loss is its tokens' loss divided by the global batch's token count
(torchtitan's normalisation, :mod:`labkit.parallel.compose`), and every reduction sums. A non-expert
parameter's gradient on a rank holds that rank's contribution, summed over the sharding ranks by
FSDP2's reduce-scatter. An expert's gradient already holds the contributions of every rank of its EP
group (their tokens' gradients came back to it through the all-to-all), and FSDP2 sums it over the
ranks that hold the same experts: every token rank counted once, nothing left to divide. The
auxiliary loss needs nothing more (see ``MoEMLP._aux``).
"""
from __future__ import annotations

import math
from contextlib import contextmanager
from typing import Iterator, Sequence

import torch
import torch.distributed as dist
import torch.nn as nn

from labkit.comm.all_to_all import all_to_all_split
from labkit.core.moe import MoEMLP, Placement
from labkit.core.moe_grouped import run_experts
from labkit.parallel.layout.mesh import ParallelDims

_RECORDS: list[dict] = []  # open record_all_to_all() logs


class AllToAll(torch.autograd.Function):
    """``all_to_all_single`` that autograd can go through: forward sends ``in_splits[i]`` rows to rank
    i of ``group`` and receives ``out_splits[i]`` from it; backward sends the gradients back the
    same way, splits swapped. (``torch.distributed.nn.functional.all_to_all_single`` is the
    library's equivalent; the tests hold the two equal on gloo.)"""

    @staticmethod
    def forward(ctx, x, out_splits, in_splits, group, counted=True):
        ctx.splits, ctx.group, ctx.counted = (out_splits, in_splits), group, counted
        return _exchange(x, out_splits, in_splits, group, counted)

    @staticmethod
    def backward(ctx, grad):
        out_splits, in_splits = ctx.splits
        return _exchange(grad, in_splits, out_splits, ctx.group, ctx.counted), None, None, None, None


def _exchange(x: torch.Tensor, out_splits: list[int], in_splits: list[int], group, counted: bool = True) -> torch.Tensor:
    """``all_to_all_single``, recorded in the open :func:`record_all_to_all` logs unless ``counted`` is
    False (routing metadata that travels beside the tokens)."""
    x = x.contiguous()
    out = x.new_empty((sum(out_splits),) + tuple(x.shape[1:]))
    dist.all_to_all_single(out, x, out_splits, in_splits, group=group)
    if not counted:
        return out
    row = math.prod(x.shape[1:]) * x.element_size()
    me = dist.get_rank(group)
    for log in _RECORDS:
        log["calls"] += 1
        log["bytes"] += (sum(in_splits) - in_splits[me]) * row  # to other ranks: the wire
        log["payload"] += sum(in_splits) * row  # the whole input, this rank's own rows included
        log["received"] += sum(out_splits) * row
        if log["per_node"]:  # by where each destination sits: ranks numbered node by node
            home = dist.get_rank() // log["per_node"]
            for i, rows in enumerate(in_splits):
                peer = dist.get_global_rank(group, i) if group is not None else i
                if peer != dist.get_rank():
                    log["leaving" if peer // log["per_node"] != home else "inside"] += rows * row
    return out


@contextmanager
def record_all_to_all(per_node: int = 0) -> Iterator[dict]:
    """Count this rank's token all-to-alls (forward and backward): calls, bytes sent to other ranks,
    payload (the inputs whole) and bytes received (own rows included); with ``per_node`` (ranks a
    node, numbered node by node) the bytes sent to other ranks split into ``inside`` the node and
    ``leaving`` it. The split-size exchange is not counted."""
    log = {"calls": 0, "bytes": 0, "payload": 0, "received": 0, "per_node": per_node, "inside": 0, "leaving": 0}
    _RECORDS.append(log)
    try:
        yield log
    finally:
        _RECORDS.remove(log)


class ExpertParallelPlacement(Placement):
    """A block's experts ``[first, first + local)`` on this rank; the rest on its EP group's ranks.

    ``dims``: the run's mesh (:class:`labkit.parallel.layout.mesh.ParallelDims`): the EP group carries the
    tokens, the token ranks (every rank holding other tokens of this pipeline place and TP place)
    sum the routing table."""

    def __init__(self, dims: ParallelDims, n_experts: int, a2a=None) -> None:
        ep = dims.degrees.ep
        if n_experts % ep:
            raise ValueError(f"ep={ep} must divide the number of experts {n_experts}")
        self.dims, self.local = dims, n_experts // ep
        self.first = dims.coords["ep"] * self.local
        self.a2a = a2a or AllToAll.apply

    def shard(self) -> tuple[int, int]:
        return self.dims.tokens_rank, self.dims.degrees.tokens

    def all_reduce(self, table: torch.Tensor) -> torch.Tensor:
        if self.dims.tokens_group is not None:
            dist.all_reduce(table, group=self.dims.tokens_group)
        return table

    def run(self, experts: nn.ModuleDict, x: torch.Tensor, counts: list[int], impl: str = "auto") -> torch.Tensor:
        ep, local, group = self.dims.degrees.ep, self.local, self.dims.group("ep")
        if ep == 1:  # every expert here: data parallelism with global routing, nothing to send
            return super().run(experts, x, counts, impl)
        send = torch.tensor(counts, dtype=torch.int64, device=x.device)
        recv = torch.empty_like(send)  # recv[s*local + e]: rows rank s sends to my expert e
        dist.all_to_all_single(recv, send, group=group)  # the split sizes first
        recv = recv.view(ep, local)
        in_splits = send.view(ep, local).sum(dim=1).tolist()
        out_splits = recv.sum(dim=1).tolist()
        xr = self.a2a(x, out_splits, in_splits, group)  # rows by source rank, then by expert
        # Regroup by local expert, run each expert on its rows, put them back in arrival order.
        which = torch.repeat_interleave(torch.arange(local, device=x.device).repeat(ep), recv.flatten())
        perm = torch.argsort(which, stable=True)
        mine = [experts[str(self.first + e)] for e in range(local)]
        y = run_experts(mine, xr[perm], recv.sum(dim=0).tolist(), impl)
        return self.a2a(y[torch.argsort(perm)], in_splits, out_splits, group)


def moe_blocks(module: nn.Module) -> list[MoEMLP]:
    return [m for m in module.modules() if isinstance(m, MoEMLP)]


def place_experts(module: nn.Module, dims: ParallelDims, a2a=None, make=ExpertParallelPlacement) -> set[int]:
    """Keep only this rank's experts in every MoE block of ``module`` and route through the EP group
    (``make(dims, n_experts, a2a)`` builds each block's placement: the flat all-to-all, or
    :func:`labkit.parallel.experts.nodes.on_nodes`'s two hops); the ids of the expert parameters left
    (their gradients are reduced over other ranks than the rest's)."""
    for block in moe_blocks(module):
        block.placement = place = make(dims, block.n_experts, a2a)
        for e in range(block.n_experts):
            if not place.first <= e < place.first + place.local:
                del block.experts[str(e)]
    return {id(p) for b in moe_blocks(module) for p in b.experts.parameters()}


def all_to_all_bytes(sent: Sequence[Sequence[int]], hidden: int, bytes_per_element: int) -> list[int]:
    """Bytes each rank of one EP group sends to the others in one forward and backward of one MoE
    block, from the routing counts: ``sent[r][e]`` kept token-choices rank r dispatches to expert e
    (experts placed ``E/ep`` per rank, in order). Rank r sends its rows for other ranks' experts
    (forward dispatch, backward combine) and the outputs of rows other ranks sent it (forward
    combine, backward dispatch): ``2 x (out_r + in_r) x hidden x bytes``."""
    ep, E = len(sent), len(sent[0])
    local = E // ep
    mine = [range(r * local, (r + 1) * local) for r in range(ep)]
    out = [sum(n for e, n in enumerate(sent[r]) if e not in mine[r]) for r in range(ep)]
    into = [sum(sent[s][e] for s in range(ep) if s != r for e in mine[r]) for r in range(ep)]
    return [2 * (o + i) * hidden * bytes_per_element for o, i in zip(out, into)]


def expected_all_to_all_bytes(tokens: int, top_k: int, hidden: int, bytes_per_element: int, ep: int,
                              per_node: int = 0) -> float:
    """The same in expectation, with uniform routing and nothing dropped: 4 all-to-alls (2 forward,
    2 backward) of ``top_k x tokens x hidden x bytes`` per rank (``tokens``: this rank's), of which
    ``(ep-1)/ep`` go to other ranks; with ``per_node`` only the part that leaves the node
    (:func:`labkit.comm.all_to_all.all_to_all_split`, the planner's formula)."""
    inside, leaving = all_to_all_split(ep, per_node or ep, 4 * top_k * tokens * hidden * bytes_per_element)
    return leaving if per_node else inside + leaving
