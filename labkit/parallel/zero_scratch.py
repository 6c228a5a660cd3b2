"""ZeRO stage 1 written by hand, for teaching; ``tests/`` hold it against DeepSpeed's ``zero1``.

Rajbhandari et al. 2020, section 5.1 (P_os): every rank keeps the full parameters and computes full
gradients, but owns the optimizer states of only its 1/N slice of the (flattened) parameters. Per
step: reduce-scatter the gradients so each rank gets the averaged gradients of its slice (Psi
bytes of payload), update that slice with Adam, all-gather the updated slices (Psi): 2 Psi in
all, the same volume as DDP's all-reduce, for 1/N of the optimizer memory.

The parameters are re-pointed into one flat buffer, so a rank's slice is a view and updating it
updates the model; the buffer is padded to a multiple of N so every slice has the same size.
"""
from __future__ import annotations

from typing import Callable

import torch
import torch.distributed as dist
import torch.nn as nn


class ZeroOneAdamW(torch.optim.Optimizer):
    """AdamW with ZeRO-1 optimizer-state sharding; clips the global gradient norm itself (the loop
    must not clip the un-reduced local gradients: :attr:`labkit.train.setup.Setup.optimizer_clips`)."""

    def __init__(self, model: nn.Module, lr: float, betas: tuple[float, float] = (0.9, 0.95),
                 weight_decay: float = 0.0, eps: float = 1e-8, grad_clip: float = 0.0) -> None:
        self.world, self.rank = dist.get_world_size(), dist.get_rank()
        self.params = [p for p in model.parameters() if p.requires_grad]
        numel = sum(p.numel() for p in self.params)
        self.chunk = -(-numel // self.world)  # ceil: pad so every rank's slice is equal
        ref = self.params[0]
        self.flat = torch.zeros(self.chunk * self.world, dtype=ref.dtype, device=ref.device)
        offset = 0
        for p in self.params:
            n = p.numel()
            self.flat[offset:offset + n].copy_(p.data.view(-1))
            p.data = self.flat[offset:offset + n].view_as(p)  # the model now lives in the buffer
            offset += n
        dist.broadcast(self.flat, src=0)  # replicas start identical, as DDP's constructor ensures
        self.shard = self.flat[self.rank * self.chunk:(self.rank + 1) * self.chunk]
        self.grad_clip = grad_clip
        self.inner = torch.optim.AdamW([self.shard], lr=lr, betas=betas, weight_decay=weight_decay, eps=eps)
        # The groups hold the full parameters, whose .grad a loss scaler unscales before the step; the
        # learning rate a schedule sets there reaches the inner AdamW at every step.
        super().__init__(self.params, {"lr": lr})
        self.state = self.inner.state  # Adam's moments: for this rank's slice only

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> None:
        flat_grad = torch.zeros_like(self.flat)
        offset = 0
        for p in self.params:
            if p.grad is not None:
                flat_grad[offset:offset + p.numel()].copy_(p.grad.view(-1))
            offset += p.numel()
        shard_grad = torch.empty_like(self.shard)
        dist.reduce_scatter_tensor(shard_grad, flat_grad)  # sum of my slice over ranks
        shard_grad /= self.world
        if self.grad_clip:  # the global norm from every rank's slice
            sq = shard_grad.pow(2).sum()
            dist.all_reduce(sq)
            shard_grad *= torch.clamp(self.grad_clip / (sq.sqrt() + 1e-6), max=1.0)
        self.shard.grad = shard_grad
        self.inner.param_groups[0]["lr"] = self.param_groups[0]["lr"]
        self.inner.step()
        self.shard.grad = None
        dist.all_gather_into_tensor(self.flat, self.shard.clone())  # everyone gets every slice
        return None

    def zero_grad(self, set_to_none: bool = True) -> None:
        for p in self.params:
            p.grad = None
