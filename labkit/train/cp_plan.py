"""Context parallelism in the one loop: the sequence split over ``cp`` ranks, ring attention between them.

Each group of ``cp`` ranks trains the same rows of the global batch, every rank holding 2 of the 2cp
chunks of each sequence (the zig-zag split, :mod:`labkit.parallel.cp_layout`) with their true
positions; every block's attention becomes :func:`labkit.parallel.context_parallel.ring_attention`
over the group (Liu et al. 2023). The ``world / cp`` groups are data parallel. The parameters are
replicated on every rank, and DDP averages their gradients over all of them: each rank's loss is the
mean over its own tokens, all ranks hold equally many, so that average is the gradient of the global
batch's mean loss (the ring's backward has already brought every query's share to every key).
Activations per rank fall as 1/cp; each attention call sends the rank's K and V round the ring.
"""
from __future__ import annotations

from functools import partial
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn

from labkit.parallel.context_parallel import ring_attention
from labkit.parallel.cp_layout import cp_comm_bytes, cp_positions, zigzag_shard
from labkit.train.plans import DDPPlan


class ContextParallelPlan(DDPPlan):
    @property
    def cp(self) -> int:
        return self.cfg.cp or self.world

    @property
    def dp(self) -> int:
        return self.world // self.cp

    @property
    def data_rank(self) -> int:  # the ranks of a context-parallel group read the same rows
        return self.rank // self.cp

    @property
    def data_world(self) -> int:
        return self.dp

    @property
    def layout(self) -> str:
        return f"cp={self.cp} dp={self.dp}"

    @classmethod
    def check_config(cls, cfg, spec) -> None:
        if cfg.activation_checkpointing != "none":
            raise ValueError(f"activation_checkpointing={cfg.activation_checkpointing!r} is not supported with "
                             "strategy='cp': recomputing a block would run the ring's exchanges again inside "
                             "backward; use 'none' (context parallelism already divides activations by cp)")

    def check_run(self) -> None:
        if self.cp > self.world or self.world % self.cp:
            raise ValueError(f"cp={self.cp} must divide world_size={self.world}: groups of cp ranks share each "
                             "sequence, the world_size/cp groups are data parallel")
        super().check_run()
        T = self.model_cfg.block_size
        if T % (2 * self.cp):
            raise ValueError(f"block_size={T} must be divisible by 2 x cp = {2 * self.cp}: the zig-zag split "
                             "cuts each sequence into 2 x cp chunks")
        if self.model_cfg.dropout:
            raise ValueError(f"dropout={self.model_cfg.dropout} is not supported with strategy='cp': ring "
                             "attention has no attention dropout; use dropout=0")

    def wrap(self, model: nn.Module) -> nn.Module:
        from labkit.parallel.data_parallel import wrap_ddp

        cp = self.cp
        groups = [dist.new_group(list(range(d * cp, (d + 1) * cp))) for d in range(self.dp)]  # all ranks, every group
        group, self.cp_rank = groups[self.rank // cp], self.rank % cp
        self.kv_stats: dict[str, int] = {}
        self.kv_bytes: list[int | None] = []
        self.positions = cp_positions(self.model_cfg.block_size, cp, self.cp_rank).to(self.device)
        wrapped = wrap_ddp(model, self.device, self.cfg.bucket_cap_mb) if self.world > 1 else model
        # after DDP's bucket-priming forward (a one-token batch the ring cannot split)
        for block in model.blocks:
            block.attn.attend = partial(ring_attention, group=group, causal=True, layout="zigzag",
                                        stats=self.kv_stats)
        return wrapped

    def split(self, x: torch.Tensor, y: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
        return super().split(zigzag_shard(x, self.cp, self.cp_rank, dim=1),
                             zigzag_shard(y, self.cp, self.cp_rank, dim=1))

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return self.model(x, y, position_ids=self.positions.expand(x.shape[0], -1))[1]

    def step(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        self.kv_stats.clear()
        loss = super().step(x, y)
        self.kv_bytes.append(self.kv_stats.get("forward_bytes", 0) + self.kv_stats.get("backward_bytes", 0))
        return loss

    def rank_figures(self) -> dict[str, Any]:
        return {**super().rank_figures(), "kv_bytes_per_step": self.kv_bytes}

    def result_fields(self, ranks: list[dict]) -> dict[str, Any]:
        m = self.model_cfg
        rows = self.cfg.batch_size // self.dp
        per_call = cp_comm_bytes("ring", rows, m.n_head, m.block_size, m.n_embd // m.n_head, self.cp)
        return {"cp": self.cp, "dp": self.dp,
                "kv_formula_bytes_per_step": m.n_layer * (per_call["forward"] + per_call["backward"])}
