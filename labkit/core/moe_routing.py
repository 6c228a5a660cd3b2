"""DeepSeek-V3's routing (DeepSeek-AI 2024, section 2.1.2): balancing without an auxiliary loss, and
each token limited to a few nodes.

**Auxiliary-loss-free balancing** (Wang et al. 2024, "Loss-Free Balancing", Algorithm 1; DeepSeek-V3
eq. 16). A per-expert bias ``b_i`` is added to the affinity scores *for the top-k choice only*: the
gates that weight the experts' outputs still come from the unbiased scores, so no gradient ever sees
the bias, and none is added to the loss. At the end of each step the bias moves by a fixed amount
against the load: ``b_i += gamma * sign(mean load - load_i)`` (DeepSeek-V3: "decrease the bias term by
gamma if its corresponding expert is overloaded, and increase it by gamma if ... underloaded"; gamma,
the *bias update speed*, was 0.001 for the first 14.3T tokens, section 4.2). The load is counted over
the step's whole global batch (every forward of the step; the routing table is already summed over
the ranks, so every rank moves its biases alike). Like torchtitan's implementation, the step is
centred (the mean of the updates is subtracted): only differences between biases change a choice.

Counting "every forward" would count a block twice where activation checkpointing recomputes it;
the sign of ``mean - load`` does not change when every count doubles, so the update is the same.

**Node-limited routing** (DeepSeek-V3 section 2.1.2, "each token will be sent to at most M nodes,
which are selected according to the sum of the highest K_r/M affinity scores of the experts
distributed on each node"): the experts are cut into ``groups`` consecutive groups (one per node, as
expert parallelism places them), each group scored by the sum of its ``ceil(k / M)`` highest biased
scores, the ``M`` best groups kept and the top k chosen among their experts (the official inference
code's ``Gate``: ``n_expert_groups``, ``n_limited_groups``). :mod:`labkit.parallel.experts.nodes`
sends each token once to each node it chose.

**MaxVio** (Wang et al. 2024's measure of imbalance, "maximal violation"): ``max_i load_i / mean
load - 1``, 0 when every expert has its share.
"""
from __future__ import annotations

import math
from typing import Iterable

import torch
import torch.nn as nn


def choose(scores: torch.Tensor, k: int, bias: torch.Tensor | None = None, groups: int = 0,
           group_limit: int = 0) -> torch.Tensor:
    """The chosen experts ``(N, k)``, best first, for scores ``(N, E)``: the top k of ``scores + bias``
    among the experts of each token's ``group_limit`` best groups (every group when either is 0)."""
    choice_scores = scores if bias is None else scores + bias.to(scores.dtype)
    if groups and group_limit and group_limit < groups:
        n, e = choice_scores.shape
        per_group = choice_scores.view(n, groups, e // groups)
        top = min(math.ceil(k / group_limit), e // groups)
        group_scores = per_group.topk(top, dim=-1).values.sum(dim=-1)  # (N, groups)
        kept = group_scores.topk(group_limit, dim=-1).indices
        mask = torch.ones(n, groups, dtype=torch.bool, device=scores.device).scatter_(1, kept, False)
        choice_scores = per_group.masked_fill(mask.unsqueeze(-1), float("-inf")).view(n, e)
    return choice_scores.topk(k, dim=-1).indices


def bias_step(load: torch.Tensor, rate: float) -> torch.Tensor:
    """The update ``rate * sign(mean - load)``, centred: under-loaded experts up, over-loaded down."""
    step = rate * torch.sign(load.float().mean() - load.float())
    return step - step.mean()


def max_violation(load: Iterable[float]) -> float:
    """MaxVio: the busiest expert's load over the mean load, minus 1 (0 when balanced)."""
    t = torch.as_tensor(list(load), dtype=torch.float64)
    return float(t.max() / t.mean() - 1) if t.sum() > 0 else 0.0


def update_router_biases(module: nn.Module) -> int:
    """Apply each MoE block's bias step for the load its forwards counted since the last call, and
    reset the counts (the training loop calls this after every optimizer step); the blocks updated."""
    done = 0
    for block in module.modules():
        load = getattr(block, "load_since_update", None)
        if load is None or not getattr(block, "bias_rate", 0.0):
            continue
        if load.sum() > 0:
            with torch.no_grad():
                block.router_bias += bias_step(load, block.bias_rate).to(block.router_bias.dtype)
            done += 1
        load.zero_()
    return done


def aux_gradient_share(model: nn.Module, idx: torch.Tensor, targets: torch.Tensor) -> dict[str, float]:
    """How far the auxiliary loss moves the gradients, on one batch: ``|g(loss) - g(cross-entropy)| /
    |g(cross-entropy)|`` over the routers' weights and over every parameter (Wang et al. 2024 call
    the auxiliary loss's part "interference gradients"). 0 when the model adds no auxiliary loss."""
    params = dict(model.named_parameters())
    logits, loss = model(idx, targets)
    ce = torch.nn.functional.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))
    total = torch.autograd.grad(loss, list(params.values()), retain_graph=True, allow_unused=True)
    task = torch.autograd.grad(ce, list(params.values()), allow_unused=True)
    zero = [torch.zeros_like(p) for p in params.values()]
    total = [z if g is None else g for g, z in zip(total, zero)]
    task = [z if g is None else g for g, z in zip(task, zero)]
    out = {}
    for part, keep in (("router", lambda n: ".router." in n), ("all", lambda n: True)):
        pick = [i for i, n in enumerate(params) if keep(n)]
        moved = torch.sqrt(sum(((total[i] - task[i]) ** 2).sum() for i in pick))
        base = torch.sqrt(sum((task[i] ** 2).sum() for i in pick))
        out[part] = float(moved / base) if base > 0 else 0.0
    return out


def load_per_step(routing_per_step: list[list[dict]]) -> tuple[torch.Tensor, torch.Tensor]:
    """From a run's ``routing_per_step`` (per step, per MoE block, ``{"routed": [...]}``): each
    expert's share of the token-choices ``(steps, E)`` and MaxVio ``(steps,)``, averaged over blocks."""
    routed = torch.tensor([[b["routed"] for b in step] for step in routing_per_step], dtype=torch.float64)
    share = routed / routed.sum(dim=-1, keepdim=True)
    return share.mean(dim=1), (share.amax(dim=-1) * routed.shape[-1] - 1).mean(dim=1)
