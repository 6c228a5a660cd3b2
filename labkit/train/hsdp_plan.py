"""Hybrid sharded data parallelism: FSDP2 on a ``replicate x shard`` device mesh.

Zhao et al. 2023 (PyTorch FSDP, its "hybrid sharding" strategy): shard the model over the ranks of a
group that a fast link joins (a node's GPUs over NVLink), keep one such sharded copy per group, and
all-reduce the gradient shards across the copies over the slower link between groups. Per step and
rank, with S = world/replicas ranks per shard group and Psi the gradient bytes:

* inside the shard group, as FSDP: all-gathers of 2 Psi (forward and backward) and a reduce-scatter
  of Psi, each rank sending (S-1)/S of each;
* across the replicas: an all-reduce of the rank's Psi/S gradient shard, 2(R-1)/R of it sent.

FSDP over all N ranks would send 3 Psi (N-1)/N, most of it over the slow link; HSDP sends only
2(R-1)/R Psi/S there, for S/N times the memory saving (each rank holds 1/S of the model, not 1/N).
"""
from __future__ import annotations

from contextlib import nullcontext
from dataclasses import asdict
from typing import Any

import torch
import torch.nn as nn

from labkit.comm.counter import CommCounter
from labkit.memory.calculator import model_state_breakdown
from labkit.train.plans import FSDPPlan


def hsdp_formula(psi_bytes: int, world: int, replicas: int) -> dict[str, dict[str, float]]:
    """Payload bytes per step on each mesh dimension (what the counter counts) and the bytes one rank
    sends under ring collectives, for HSDP and for FSDP over all ``world`` ranks."""
    s = world // replicas
    return {"shard": {"payload": 3 * psi_bytes, "sent": 3 * psi_bytes * (s - 1) / s},
            "replicate": {"payload": psi_bytes / s, "sent": 2 * (replicas - 1) / replicas * psi_bytes / s},
            "fsdp": {"payload": 3 * psi_bytes, "sent": 3 * psi_bytes * (world - 1) / world}}


class HSDPPlan(FSDPPlan):
    def check_run(self) -> None:
        super().check_run()
        r = self.cfg.replicas
        if r > self.world or self.world % r:
            raise ValueError(f"replicas={r} must divide world_size={self.world}: each of the replicas holds a copy "
                             f"sharded over world_size/replicas ranks")

    @property
    def layout(self) -> str:
        return f"replicas={self.cfg.replicas}"

    def wrap(self, model: nn.Module) -> nn.Module:
        from torch.distributed.device_mesh import init_device_mesh

        from labkit.parallel.fsdp import fully_shard_gpt

        r = self.cfg.replicas
        self.mesh = init_device_mesh(self.device.type, (r, self.world // r), mesh_dim_names=("replicate", "shard"))
        self.dims = {self.mesh.get_group(d).group_name: d for d in ("replicate", "shard")}
        self.by_dim: list[dict | None] = []
        return fully_shard_gpt(model, self.device, self.cfg.reshard_after_forward, mesh=self.mesh)

    def step(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        with CommCounter() if self.counting else nullcontext() as c:
            loss = super().step(x, y)
        self.by_dim.append({self.dims.get(g, "other"): dict(ops) for g, ops in c.by_group.items()}
                           if self.counting else None)
        return loss

    def predicted_model_states(self, n_params: int) -> dict[str, int]:
        return asdict(model_state_breakdown(n_params, self.world // self.cfg.replicas, 3, "fp32"))

    def rank_figures(self) -> dict[str, Any]:
        return {**super().rank_figures(), "comm_bytes_by_mesh_dim_per_step": self.by_dim}

    def result_fields(self, ranks: list[dict]) -> dict[str, Any]:
        psi = 4 * sum(p.numel() for p in self.module.parameters())  # fp32 gradients, whole model
        return {"replicas": self.cfg.replicas, "shard_group": self.world // self.cfg.replicas,
                "comm_formula": hsdp_formula(psi, self.world, self.cfg.replicas)}
