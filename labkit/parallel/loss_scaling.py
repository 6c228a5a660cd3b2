"""fp16 loss scaling when the gradients are spread over ranks (Micikevicius et al. 2018, section 3.2).

fp16's narrow range flushes small gradients to zero, so the loss is multiplied by a scale before
backward and the gradients divided by it before the step; a step whose gradients hold an inf or NaN
is skipped and the scale halved (torch's ``GradScaler``). When each rank holds different gradients
(shards, tensor-parallel slices, pipeline stages) the ranks must agree on skipping a step, or their
replicas diverge and a sharded optimizer's collectives hang: torch's ``ShardedGradScaler``
all-reduces the verdict. :class:`GradScaler` is that, unscaling DTensor gradients through their
local shards, so plain and DTensor gradients (tensor parallelism) can share one optimizer.
"""
from __future__ import annotations

from types import SimpleNamespace

import torch
from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler


class GradScaler(ShardedGradScaler):
    """``ShardedGradScaler`` over every rank's local gradients; the inf/NaN verdict is all-reduced."""

    def _unscale_grads_(self, optimizer: torch.optim.Optimizer, inv_scale: torch.Tensor, found_inf: torch.Tensor,
                        allow_fp16: bool = True) -> dict[torch.device, torch.Tensor]:
        local = [SimpleNamespace(grad=p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad)
                 for group in optimizer.param_groups for p in group["params"]]
        # to_local() shares the DTensor's storage: unscaling the local view unscales the gradient
        return super()._unscale_grads_(SimpleNamespace(param_groups=[{"params": local}]), inv_scale, found_inf,
                                       allow_fp16)
