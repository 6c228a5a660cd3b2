"""A mixture-of-experts MLP: E experts, a linear router, top-k routing, dropless by default or with an
expert capacity that drops tokens (the 2021 practice), Switch's load-balancing auxiliary loss or
DeepSeek-V3's bias, fine-grained and shared experts.

Routing (Shazeer et al. 2017; GShard, Lepikhin et al. 2020, Algorithm 1; Switch Transformer, Fedus
et al. 2021, section 2). Each token's router logits ``W_r x`` give probabilities ``p = softmax`` over
the E experts, in fp32 (Switch's "selective precision"). The token goes to its ``top_k`` experts and
its output is ``sum_j g_j E_j(x)``. The gates ``g_j`` are the top-k probabilities *renormalised to
sum to 1* when ``top_k > 1`` (GShard Algorithm 1, ``gates /= denom``; Mixtral, Jiang et al. 2024,
eq. 1, a softmax over the top-k logits, which is the same) and the raw probability at ``top_k = 1``
(Switch eq. 2: with one expert a renormalised gate would be 1 and the router would learn nothing from
the task loss). ``renormalize=`` overrides.

Experts (DeepSeekMoE, Dai et al. 2024): each expert has the dense MLP's shape unless ``expert_ffn``
narrows it (fine-grained experts: m times as many experts, 1/m as wide, m times the top-k, the same
compute); ``shared`` experts run on every token without routing (one MLP ``shared x expert_ffn`` wide,
as DeepSeek's code builds them) and their output is added to the routed experts'. The routed rows
run as grouped GEMMs where the build has them (:mod:`labkit.core.moe_grouped`). The choice may add a
per-expert bias and be limited to a few groups of experts (:mod:`labkit.core.moe_routing`): the
gates stay the unbiased probabilities.

Capacity. An expert takes at most ``C = ceil(capacity_factor * top_k * tokens / E)`` token-choices
(Switch eq. 3 with k choices, as GShard's ``expert_capacity``); ``capacity_factor=0`` means no limit:
dropless, as MegaBlocks (Gale et al. 2023) and DeepSeek-V3 train.
Choices beyond C are dropped in a fixed order: every first choice before any second choice (GShard
Algorithm 1 offsets the second choices' positions by the first choices' count), and within one rank
of choice, earlier tokens of the global batch first (Switch's cumulative sum over tokens). A dropped
choice adds nothing; a token with all its choices dropped leaves the block as zero, so the residual
stream carries it past unchanged.

Auxiliary loss (Switch eq. 4, GShard's ``l_aux``): ``E * sum_i f_i P_i``, with ``f_i`` the fraction
of token-choices the router assigned to expert i (before capacity, as Switch's code counts it; over
all k choices, divided by k so that ``sum f_i = 1``: at k = 1 it is exactly Switch's) and ``P_i`` the
mean router probability of expert i. It is 1 when either f or P is uniform (E * sum_i f_i / E), and
the model adds ``moe_aux_weight`` times it per MoE layer (Switch: alpha = 1e-2).

Global batch. Capacity, drop order and ``f``/``P`` are properties of the *whole* batch. The block
gets them from one sum: each process writes its per-expert counts (and probability sums) into its
row of a table, :class:`Placement` ``.all_reduce`` sums the table over the processes, and every
process reads the totals and the counts of the shards before its own. In one process the sum is the
table itself; under expert parallelism (:mod:`labkit.parallel.experts.placement`) it is an all-reduce,
so every token is kept or dropped exactly as one process would, and the loss is one process's.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from labkit.core.checks import non_negative_int, non_negative_number, positive_int
from labkit.core.moe_grouped import run_experts
from labkit.core.moe_routing import choose


def expert_capacity(tokens: int, n_experts: int, top_k: int, capacity_factor: float) -> int | None:
    """Token-choices one expert takes: ``ceil(capacity_factor * top_k * tokens / n_experts)``; None
    (no limit) when ``capacity_factor`` is 0."""
    if capacity_factor == 0:
        return None
    return math.ceil(capacity_factor * top_k * tokens / n_experts)


@dataclass(frozen=True)
class RoutingStats:
    """What one forward of one MoE block decided. Global figures cover the whole batch (every rank's
    tokens under expert parallelism); ``sent`` and ``passed_through`` are this process's."""

    tokens: int  # tokens in the global batch
    capacity: int | None  # token-choices per expert (None: no limit)
    routed: list[int]  # token-choices the router assigned to each expert, before capacity
    kept: list[int]  # ... that the expert processed: min(routed, capacity)
    dropped: int  # token-choices beyond capacity: sum(routed) - sum(kept)
    sent: list[int]  # this process's kept token-choices per expert (the rows it dispatches)
    passed_through: int  # this process's tokens with every choice dropped (the residual carries them)
    aux: float  # the unweighted auxiliary loss E * sum f_i P_i


class Expert(nn.Module):
    """One expert: the dense MLP's names (``fc``, ``proj``: GPT's scaled init finds it), ``ffn`` wide."""

    def __init__(self, n_embd: int, bias: bool = True, dropout: float = 0.0, ffn: int | None = None) -> None:
        super().__init__()
        ffn = ffn or 4 * n_embd
        self.fc = nn.Linear(n_embd, ffn, bias=bias)
        self.proj = nn.Linear(ffn, n_embd, bias=bias)
        self.drop = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.drop(self.proj(F.gelu(self.fc(x))))


class Placement:
    """Where the experts run and what the global batch is. This one: every expert in this process,
    and this process's batch is the whole batch. Expert parallelism subclasses it."""

    def shard(self) -> tuple[int, int]:
        """``(index, count)``: this process's tokens are shard ``index`` of ``count`` equal shards,
        in the global batch's order (data-parallel rank order)."""
        return 0, 1

    def all_reduce(self, table: torch.Tensor) -> torch.Tensor:
        """The element-wise sum of ``table`` over every process that holds part of the batch."""
        return table

    def run(self, experts: nn.ModuleDict, x: torch.Tensor, counts: list[int], impl: str = "auto") -> torch.Tensor:
        """Experts' outputs for ``x``, rows sorted by expert, ``counts[e]`` rows for expert e."""
        return run_experts([experts[str(e)] for e in range(len(counts))], x, counts, impl)

    def combine(self, experts: nn.ModuleDict, h: torch.Tensor, order: torch.Tensor, gates: torch.Tensor,
                counts: list[int], impl: str = "auto") -> torch.Tensor:
        """Each token's ``sum_j g_j E_j(h)`` ``(N, C)``: ``order`` the kept choices (flat index
        ``j * N + t``) sorted by expert, ``counts`` per expert; ``gates`` ``(k, N)``."""
        k, n = gates.shape
        y = self.run(experts, h[order % n], counts, impl)
        # Each output row back to its (choice, token) slot, weighted by its gate.
        slots = y.new_zeros(k * n, y.shape[-1]).index_copy(0, order, y).view(k, n, -1)
        return (slots * gates.unsqueeze(-1).to(slots.dtype)).sum(dim=0)


class MoEMLP(nn.Module):
    """Drop-in for the GPT's ``MLP``: ``(B, T, C) -> (B, T, C)``; after each forward ``aux_loss``
    (a differentiable scalar) and ``stats`` (:class:`RoutingStats`) describe the routing.

    ``bias_rate`` > 0 routes with a per-expert bias (the buffer ``router_bias``) moved by
    :func:`labkit.core.moe_routing.update_router_biases` after each step from the load counted in
    ``load_since_update``; ``groups`` and ``group_limit`` limit each token to that many groups of
    consecutive experts (nodes)."""

    def __init__(self, n_embd: int, n_experts: int, top_k: int = 2, capacity_factor: float = 1.25,
                 bias: bool = True, dropout: float = 0.0, renormalize: bool | None = None,
                 expert_ffn: int = 0, shared: int = 0, bias_rate: float = 0.0, groups: int = 0,
                 group_limit: int = 0) -> None:
        super().__init__()
        self.n_experts = positive_int("n_experts", n_experts)
        self.top_k = positive_int("top_k", top_k)
        if top_k > n_experts:
            raise ValueError(f"top_k={top_k} must be at most n_experts={n_experts}")
        self.capacity_factor = non_negative_number("capacity_factor", capacity_factor)
        self.renormalize = top_k > 1 if renormalize is None else bool(renormalize)
        self.bias_rate = non_negative_number("bias_rate", bias_rate)
        self.groups, self.group_limit = non_negative_int("groups", groups), non_negative_int("group_limit", group_limit)
        if groups and n_experts % groups:
            raise ValueError(f"groups={groups} must divide n_experts={n_experts}")
        if group_limit > groups:
            raise ValueError(f"group_limit={group_limit} must be at most groups={groups}")
        if group_limit and group_limit * (n_experts // groups) < top_k:
            raise ValueError(f"group_limit={group_limit} groups of {n_experts // groups} experts hold fewer than "
                             f"top_k={top_k}")
        ffn = non_negative_int("expert_ffn", expert_ffn) or 4 * n_embd
        self.router = nn.Linear(n_embd, n_experts, bias=False)
        # Keyed by the global expert index: under expert parallelism a rank keeps only its own keys,
        # and parameter names (checkpoints) stay those of one process.
        self.experts = nn.ModuleDict({str(e): Expert(n_embd, bias, dropout, ffn) for e in range(n_experts)})
        self.shared = Expert(n_embd, bias, dropout, non_negative_int("shared", shared) * ffn) if shared else None
        # The bias steers the choice, no gradient reaches it; saved with the model only when it is used.
        self.register_buffer("router_bias", torch.zeros(n_experts), persistent=self.bias_rate > 0)
        self.register_buffer("load_since_update", torch.zeros(n_experts, dtype=torch.float64), persistent=False)
        self.placement: Placement = Placement()
        self.impl = "auto"  # how the experts multiply: labkit.core.moe_grouped.IMPLS
        self.aux_loss: torch.Tensor | None = None
        self.stats: RoutingStats | None = None

    @classmethod
    def from_config(cls, cfg) -> "MoEMLP":
        """From a ``GPTConfig`` with the ``moe_*`` fields."""
        return cls(cfg.n_embd, cfg.moe_experts, cfg.moe_top_k, cfg.moe_capacity_factor, cfg.bias, cfg.dropout,
                   expert_ffn=cfg.moe_expert_ffn, shared=cfg.moe_shared, bias_rate=cfg.moe_bias_rate,
                   groups=cfg.moe_groups, group_limit=cfg.moe_group_limit)

    def route(self, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Router probabilities ``(N, E)`` (fp32), the chosen experts ``(k, N)`` (row j: every
        token's j-th choice) and their gates ``(k, N)``, from the unbiased probabilities."""
        probs = self.router(h).float().softmax(dim=-1)
        top_e = choose(probs.detach(), self.top_k, self.router_bias if self.bias_rate else None, self.groups,
                       self.group_limit)
        top_p = probs.gather(1, top_e)
        gates = top_p / top_p.sum(dim=-1, keepdim=True) if self.renormalize else top_p
        return probs, top_e.t(), gates.t()

    def _global_table(self, choice: torch.Tensor, probs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Per-shard counts ``(shards, k, E)`` and probability sums ``(E,)`` of the global batch: one
        table, one sum over the processes (float64: counts stay exact, sums lose nothing)."""
        k, E = self.top_k, self.n_experts
        index, shards = self.placement.shard()
        table = torch.zeros(shards * k * E + E, dtype=torch.float64, device=probs.device)
        counts = F.one_hot(choice, E).sum(dim=1)  # (k, E)
        table[index * k * E:(index + 1) * k * E] = counts.flatten().double()
        table[shards * k * E:] = probs.detach().sum(dim=0).double()
        table = self.placement.all_reduce(table)
        return table[:shards * k * E].view(shards, k, E).round().long(), table[shards * k * E:]

    def _positions(self, choice: torch.Tensor, by_shard: torch.Tensor) -> torch.Tensor:
        """Each choice's place in its expert's queue ``(k, N)``: first choices of the global batch
        before second choices, earlier shards and earlier tokens first."""
        index, _ = self.placement.shard()
        total = by_shard.sum(dim=0)  # (k, E)
        offset = total.cumsum(dim=0) - total + by_shard[:index].sum(dim=0)  # earlier levels + shards
        onehot = F.one_hot(choice, self.n_experts)  # (k, N, E)
        local = (onehot.cumsum(dim=1) - 1).gather(2, choice.unsqueeze(-1)).squeeze(-1)
        return local + offset.gather(1, choice)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape, (k, E) = x.shape, (self.top_k, self.n_experts)
        h = x.reshape(-1, shape[-1])
        N = h.shape[0]
        probs, choice, gates = self.route(h)
        by_shard, prob_sum = self._global_table(choice, probs)
        total = by_shard.sum(dim=0)
        tokens = int(total[0].sum())
        capacity = expert_capacity(tokens, E, k, self.capacity_factor)
        keep = self._positions(choice, by_shard) < (capacity if capacity is not None else tokens * k + 1)
        # Dispatch: kept choices (flat index j*N + t), sorted by expert; stable, so in priority order.
        flat_e = choice.flatten()
        kept = keep.flatten().nonzero().squeeze(1)
        order = kept[torch.argsort(flat_e[kept], stable=True)]
        sent = torch.bincount(flat_e[order], minlength=E)
        out = self.placement.combine(self.experts, h, order, gates, sent.tolist(), self.impl).to(x.dtype)
        if self.shared is not None:  # every token, no routing, nothing sent
            out = out + self.shared(h)
        self.aux_loss = self._aux(probs, total, prob_sum, tokens)
        routed = total.sum(dim=0)
        if self.bias_rate and self.training and torch.is_grad_enabled():  # the step's load, for the bias
            self.load_since_update += routed.to(self.load_since_update)
        kept_n = routed.clamp(max=capacity) if capacity is not None else routed
        self.stats = RoutingStats(tokens, capacity, routed.tolist(), kept_n.tolist(), int((routed - kept_n).sum()),
                                  sent.tolist(), int((~keep).all(dim=0).sum()), self.aux_loss.detach().item())
        return out.view(shape)

    def _aux(self, probs: torch.Tensor, total: torch.Tensor, prob_sum: torch.Tensor, tokens: int) -> torch.Tensor:
        """``E * sum_i f_i P_i`` over the global batch. With f global (a count, no gradient) the loss
        is linear in P, and P is the mean of the shards' ``P_local``: so the gradient flows through
        this process's ``P_local`` (its own tokens), which, weighted by the rank's share of the global
        tokens and summed over the data-parallel ranks as gradients are, is the gradient of the global loss; the value is the global one (the detached
        correction), so every rank reports what one process computes."""
        f = (total.sum(dim=0).double() / (self.top_k * tokens)).to(probs.dtype)
        p_local = probs.mean(dim=0)
        p = p_local + ((prob_sum / tokens).to(probs.dtype) - p_local).detach()
        return self.n_experts * (f * p).sum()
