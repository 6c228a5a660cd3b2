"""Expert parallelism in the one loop: a mixture-of-experts GPT with its experts spread over ``ep`` ranks.

Every rank reads its own rows of the global batch. In each MoE block the router picks experts for
every token; the tokens travel to the ranks that hold their experts and back in two all-to-alls
(:mod:`labkit.parallel.expert_parallel`; Lepikhin et al. 2020, GShard). Capacity, dropped tokens and
the load-balancing loss are computed from the routing of the *whole* global batch (all-reduced), so
the run takes the steps one process takes. Non-expert gradients are averaged over every rank, expert
gradients over the ranks that hold the same experts (``world / ep`` data-parallel replicas).
"""
from __future__ import annotations

from contextlib import nullcontext
from dataclasses import asdict
from typing import Any

import torch
import torch.nn as nn

from labkit.memory.calculator import ModelStates
from labkit.train.plans import Plan


def _routing(model: nn.Module) -> list[dict] | None:
    """Each MoE block's routing in the last forward, as plain numbers (None for a dense model)."""
    stats = model.moe_stats() if hasattr(model, "moe_stats") else []
    return [{"routed": s.routed, "kept": s.kept, "dropped": s.dropped, "tokens": s.tokens, "capacity": s.capacity,
             "aux": s.aux} for s in stats] or None


class ExpertParallelPlan(Plan):
    @property
    def ep(self) -> int:
        return self.cfg.ep or self.world

    @property
    def layout(self) -> str:
        return f"ep={self.ep}"

    def check_run(self) -> None:
        if not self.model_cfg.moe_experts:
            raise ValueError("strategy='ep' needs a mixture-of-experts model: set moe_experts (--moe-experts E, "
                             "a multiple of ep)")
        if self.ep > self.world or self.world % self.ep:
            raise ValueError(f"ep={self.ep} must divide world_size={self.world}: each group of ep ranks holds all "
                             "the experts, the world_size/ep groups are data parallel")
        if self.model_cfg.moe_experts % self.ep:
            raise ValueError(f"moe_experts={self.model_cfg.moe_experts} must be a multiple of ep={self.ep}: each "
                             "rank of a group holds moe_experts/ep experts")
        super().check_run()

    def wrap(self, model: nn.Module) -> nn.Module:
        from labkit.parallel.expert_parallel import ExpertParallel

        self.routing: list[list[dict] | None] = []
        self.a2a: list[int | None] = []
        return ExpertParallel(model, self.ep)

    def finish_backward(self) -> None:
        self.model.finish_gradient_sync()

    def clip(self, max_norm: float) -> None:
        from labkit.parallel.clipping import clip_grad_norm_

        clip_grad_norm_(self.params, max_norm, self.model.groups_of)

    def step(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        from labkit.parallel.expert_parallel import record_all_to_all

        with record_all_to_all() if self.counting else nullcontext() as log:
            loss = super().step(x, y)
        self.a2a.append(log["bytes"] if self.counting else None)
        self.routing.append(_routing(self.module))
        return loss

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        return self.model.full_state_dict()

    def predicted_model_states(self, n_params: int) -> dict[str, int]:
        held = sum(p.numel() for p in self.model.parameters())  # the shared weights and this rank's experts
        return asdict(ModelStates(4 * held, 4 * held, 8 * held))

    def rank_figures(self) -> dict[str, Any]:
        return {**super().rank_figures(), "all_to_all_bytes_per_step": self.a2a, "routing_per_step": self.routing}

    def result_fields(self, ranks: list[dict]) -> dict[str, Any]:
        return {"ep": self.ep, "dp": self.world // self.ep}


class MoEPlan(Plan):
    """One process training a mixture-of-experts GPT (or any dense model): the reference for ``ep``."""

    def wrap(self, model: nn.Module) -> nn.Module:
        self.routing: list[list[dict] | None] = []
        return model

    def step(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        loss = super().step(x, y)
        self.routing.append(_routing(self.module))
        return loss

    def rank_figures(self) -> dict[str, Any]:
        return {**super().rank_figures(), **({"routing_per_step": self.routing} if any(self.routing) else {})}
