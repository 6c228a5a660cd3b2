"""FSDP2: ZeRO stage 3 with ``torch.distributed.fsdp.fully_shard`` on every block, then on the root.

PyTorch docs, "FSDP2" (Zhao et al. 2023 for FSDP): parameters, gradients and optimizer states are
sharded over the ranks of a device mesh; each block's parameters are all-gathered for its forward
and again for its backward (unless ``reshard_after_forward=False``, which keeps them gathered
between the passes), and gradients are reduce-scattered.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn


def fully_shard_gpt(model: nn.Module, device: torch.device, reshard_after_forward: bool = True,
                    cpu_offload: bool = False, bf16_params: bool = False, mesh=None) -> nn.Module:
    """Shard every block of the GPT, then the root (embeddings, final norm, tied head), in place.

    ``mesh``: by default every rank in one shard group. A 2-D mesh whose dimensions are
    ``("replicate", "shard")`` gives hybrid sharding (HSDP, PyTorch's FSDP2 docs): each shard group
    holds one copy of the model, and gradient shards are all-reduced across the copies."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import (
        CPUOffloadPolicy,
        MixedPrecisionPolicy,
        fully_shard,
    )

    mesh = mesh if mesh is not None else init_device_mesh(device.type, (dist.get_world_size(),))
    kwargs = {"mesh": mesh, "reshard_after_forward": reshard_after_forward}
    if cpu_offload:
        # Pinned host memory makes the device copies asynchronous; it needs an accelerator to exist.
        kwargs["offload_policy"] = CPUOffloadPolicy(pin_memory=device.type == "cuda")
    if bf16_params:  # compute in bf16 on gathered copies, keep fp32 shards, reduce in fp32
        kwargs["mp_policy"] = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for block in model.blocks:  # one all-gather per block: only one block is ever unsharded
        fully_shard(block, **kwargs)
    return fully_shard(model, **kwargs)  # the root: embeddings, final norm, tied head
