"""Where the experts sit, measured on CPU ranks grouped as "nodes": what the lab launches.

:func:`placement_vs_one_process` runs one MoE layer on this rank's tokens under three dispatches (the
flat all-to-all, the two-hop one, two hops with node-limited routing), each against the same layer in
one process on the whole batch (output and every gradient), and counts the token bytes each rank sent
inside its node and out of it, next to what :func:`labkit.parallel.experts.nodes.routed_rows` predicts
from the routing. :func:`uniform_all_to_all` sends evenly to every rank once, the case the planner's
formula (:func:`labkit.comm.all_to_all.all_to_all_split`) describes. :func:`dispatch_bytes_per_token`
measures what one dispatch carries per token for other expert shapes (fine-grained, shared).
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from labkit.comm.all_to_all import all_to_all_split
from labkit.core.moe import MoEMLP
from labkit.parallel.experts.nodes import on_nodes, routed_rows
from labkit.parallel.experts.placement import AllToAll, ExpertParallelPlacement, place_experts, record_all_to_all
from labkit.parallel.layout.mesh import Degrees, ParallelDims

MODES = {"flat": (False, False), "two hops": (True, False), "two hops, node-limited": (True, True)}


def _block(n_embd: int, experts: int, top_k: int, seed: int, **kw) -> MoEMLP:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        block = MoEMLP(n_embd, experts, top_k, 0.0, **kw)  # dropless
        for p in block.parameters():  # a router that prefers some experts per token, as a trained one does
            torch.nn.init.normal_(p, std=0.5 if p is block.router.weight else 0.05)
    return block


def placement_vs_one_process(n_embd: int, experts: int, top_k: int, per_node: int, group_limit: int,
                             tokens: int, seed: int = 0) -> dict[str, dict]:
    """Per dispatch: ``max_err`` (output and gradients against one process), this rank's measured
    ``inside`` / ``leaving`` bytes for one forward and backward and the ``formula``'s, and ``tokens``."""
    torch.set_num_threads(1)
    rank, world = dist.get_rank(), dist.get_world_size()
    gen = torch.Generator().manual_seed(seed)
    x, w = torch.randn(world * tokens, n_embd, generator=gen), torch.randn(world * tokens, n_embd, generator=gen)
    mine = slice(rank * tokens, (rank + 1) * tokens)
    dims = ParallelDims(Degrees(dp_shard=world, ep=world))
    make_two_hop = on_nodes(per_node)
    out = {}
    for name, (two_hop, limited) in MODES.items():
        kw = dict(groups=world // per_node, group_limit=group_limit) if limited else {}
        ref, x_ref = _block(n_embd, experts, top_k, seed, **kw), x.clone().requires_grad_()
        y_ref = ref(x_ref)
        (y_ref * w).sum().backward()
        block, x_mine = _block(n_embd, experts, top_k, seed, **kw), x[mine].clone().requires_grad_()
        place_experts(block, dims, make=make_two_hop if two_hop else ExpertParallelPlacement)
        with record_all_to_all(per_node) as log:  # the input needs a gradient, as a layer's input does
            y = block(x_mine)
            (y * w[mine]).sum().backward()
        router_grad = block.router.weight.grad.clone()
        dist.all_reduce(router_grad)  # each rank's tokens' share of it
        errs = [(y - y_ref[mine]).abs().max(), (x_mine.grad - x_ref.grad[mine]).abs().max(),
                (router_grad - ref.router.weight.grad).abs().max()]
        for key, expert in block.experts.items():
            errs += [(a.grad - b.grad).abs().max() for a, b in zip(expert.parameters(), ref.experts[key].parameters())]
        with torch.no_grad():
            chosen = block.route(x[mine])[1].t()  # (tokens, k): the experts each token chose
        rows = routed_rows(chosen, rank, experts // world, per_node, two_hop)
        row_bytes = n_embd * x.element_size()
        out[name] = {"max_err": max(float(e) for e in errs), "inside": log["inside"], "leaving": log["leaving"],
                     "formula": {k: 4 * v * row_bytes for k, v in rows.items()}, "tokens": tokens,
                     "row_bytes": row_bytes}
    return out


def uniform_all_to_all(rows_per_rank: int, n_embd: int, per_node: int) -> dict[str, float]:
    """One all-to-all sending ``rows_per_rank`` rows to every rank (itself included): this rank's
    measured ``inside`` and ``leaving`` bytes and the formula's."""
    world = dist.get_world_size()
    x = torch.randn(world * rows_per_rank, n_embd)
    with record_all_to_all(per_node) as log:
        AllToAll.apply(x, [rows_per_rank] * world, [rows_per_rank] * world, None)
    inside, leaving = all_to_all_split(world, per_node, x.numel() * x.element_size())
    return {"inside": log["inside"], "leaving": log["leaving"], "formula_inside": inside,
            "formula_leaving": leaving, "sent": x.numel() * x.element_size()}


def dispatch_bytes_per_token(n_embd: int, shapes: dict[str, dict], tokens: int, seed: int = 0) -> dict[str, float]:
    """Per expert shape (:class:`MoEMLP` keyword arguments: ``n_experts``, ``top_k``, ``expert_ffn``,
    ``shared``): the token bytes one forward's dispatch all-to-all carries per token over the group
    (each rank's rows, its own included), under the flat expert-parallel placement."""
    world = dist.get_world_size()
    dims = ParallelDims(Degrees(dp_shard=world, ep=world))
    x = torch.randn(tokens, n_embd, generator=torch.Generator().manual_seed(seed + dist.get_rank()))
    out = {}
    for name, kw in shapes.items():
        block = _block(n_embd, kw["n_experts"], kw["top_k"], seed, expert_ffn=kw.get("expert_ffn", 0),
                       shared=kw.get("shared", 0))
        place_experts(block, dims)
        with torch.no_grad(), record_all_to_all() as log:
            block(x)
        payload = torch.tensor(float(log["payload"]))
        dist.all_reduce(payload)  # dispatch and combine: each carries the routed rows once
        out[name] = float(payload) / 2 / (world * tokens)
    return out


def experts_on_nodes(n_embd: int, experts: int, top_k: int, per_node: int, group_limit: int, tokens: int,
                     shapes: dict[str, dict], seed: int = 0) -> dict:
    """Everything the lab measures on the ranks grouped as nodes, in one launch: the uniform exchange,
    the three dispatches against one process, and the dispatch bytes per token of ``shapes``."""
    return {"uniform": uniform_all_to_all(tokens // dist.get_world_size() or 1, n_embd, per_node),
            "modes": placement_vs_one_process(n_embd, experts, top_k, per_node, group_limit, tokens, seed),
            "dispatch": dispatch_bytes_per_token(n_embd, shapes, tokens, seed)}
