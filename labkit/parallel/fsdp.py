"""FSDP2: ZeRO stage 3 with ``torch.distributed.fsdp.fully_shard`` on every block, then on the root.

PyTorch docs, "FSDP2" (Zhao et al. 2023 for FSDP): parameters, gradients and optimizer states are
sharded over the ranks of a device mesh; each block's parameters are all-gathered for its forward
and again for its backward (unless ``reshard_after_forward=False``, which keeps them gathered
between the passes), and gradients are reduce-scattered. On a 2-D ``(replicate, shard)`` mesh the
shards are also all-reduced across the replicas (hybrid sharding, HSDP); with a shard dimension of
size 1 that is plain replication, the gradients all-reduced as DDP would.

This is the one place labkit calls ``fully_shard``: the training loop's layouts, the hand-checked
FSDP runs and the fake-tensor memory estimate all shard through :func:`apply_fsdp`.
"""
from __future__ import annotations

import torch
import torch.nn as nn

from labkit.core.model import blocks_of


def _experts(block: nn.Module) -> list[nn.Module]:
    """A mixture-of-experts block's experts on this rank (none for a dense block)."""
    experts = getattr(block.mlp, "experts", None)
    return list(experts.values()) if experts is not None else []


def apply_fsdp(parts: list[nn.Module], mesh, reshard_after_forward: bool = True, cpu_offload: bool = False,
               bf16_params: bool = False, expert_mesh=None, device: torch.device | None = None) -> list[nn.Module]:
    """Shard every block of each part (the GPT, or the pipeline stages this rank holds), then each
    part's root (embeddings, final norm, head), in place, over ``mesh`` (1-D: FSDP; 2-D: HSDP).

    Experts of MoE blocks are sharded on ``expert_mesh`` instead (the ranks holding the same experts),
    their gradients reduced over it; without an ``expert_mesh`` they are left out of FSDP. Either way
    every token rank's loss reached them through the all-to-all, not only their mesh's ranks, so the
    training loop sums gradients (:func:`sum_gradients`) of a loss already divided by the global
    token count, and nothing is missing from theirs."""
    from torch.distributed.fsdp import (
        CPUOffloadPolicy,
        MixedPrecisionPolicy,
        fully_shard,
    )

    kwargs = {"reshard_after_forward": reshard_after_forward}
    if cpu_offload:
        # Pinned host memory makes the device copies asynchronous; it needs an accelerator to exist.
        kwargs["offload_policy"] = CPUOffloadPolicy(pin_memory=device is not None and device.type == "cuda")
    if bf16_params:  # compute in bf16 on gathered copies, keep fp32 shards, reduce in fp32
        kwargs["mp_policy"] = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    ignored: set[nn.Parameter] = set()
    for part in parts:
        for block in blocks_of(part):  # one all-gather per block: only one block is ever unsharded
            for expert in _experts(block):
                if expert_mesh is None:
                    ignored |= set(expert.parameters())
                    continue
                fully_shard(expert, mesh=expert_mesh, **kwargs)
            fully_shard(block, mesh=mesh, ignored_params=ignored or None, **kwargs)
        fully_shard(part, mesh=mesh, ignored_params=ignored or None, **kwargs)  # the root: embeddings, head
    return parts


def cross_node_bytes(psi_bytes: float, nodes: int, per_node: int) -> dict[str, float]:
    """Bytes per step that leave one node, on rail-optimised nodes (one NIC per GPU), for FSDP over all
    ``nodes x per_node`` ranks and for HSDP sharded inside each node and replicated across nodes.

    A ring over ranks numbered node by node crosses each node's boundary once; NCCL runs one ring per
    channel, each on its own NIC, over a share of the buffer, so together they carry what one ring
    carries through the boundary: ``(N-1)/N`` of the buffer per pass. FSDP's three passes (two
    gathers, a reduce-scatter) push about ``3 Psi`` out of each node, which is ``1/per_node`` of what
    its ranks send in all: most of a rank's ring traffic stays on NVLink. HSDP's shard group never
    leaves the node; each rank all-reduces its ``Psi/S`` gradient shard across the ``R = nodes``
    replicas, ``2 (R-1)/R Psi/S`` sent per rank, ``2 (R-1)/R Psi`` per node (Zhao et al. 2023)."""
    world = nodes * per_node
    fsdp = 3 * psi_bytes * (world - 1) / world
    return {"fsdp": fsdp, "fsdp_all_ranks": 3 * psi_bytes * (world - 1) / world * per_node,
            "hsdp": 2 * psi_bytes * (nodes - 1) / nodes}


def hsdp_formula(psi_bytes: int, world: int, replicas: int) -> dict[str, dict[str, float]]:
    """Payload bytes per step on each mesh dimension (what the counter counts) and the bytes one rank
    sends under ring collectives, for HSDP and for FSDP over all ``world`` ranks (Zhao et al. 2023):
    inside a shard group of S = world/replicas ranks all-gathers of 2 Psi and a reduce-scatter of Psi,
    (S-1)/S of each sent; across the replicas an all-reduce of the rank's Psi/S shard."""
    s = world // replicas
    return {"shard": {"payload": 3 * psi_bytes, "sent": 3 * psi_bytes * (s - 1) / s},
            "replicate": {"payload": psi_bytes / s, "sent": 2 * (replicas - 1) / replicas * psi_bytes / s},
            "fsdp": {"payload": 3 * psi_bytes, "sent": 3 * psi_bytes * (world - 1) / world}}


def sum_gradients(parts: list[nn.Module]) -> None:
    """Every FSDP2 module of ``parts`` reduces gradients as a sum, not a mean: the loss each rank
    differentiates is already its tokens' share of the global batch's (divided by the global token
    count), as torchtitan's ``disable_fsdp_gradient_division`` arranges. Sum-only collectives (no
    NCCL ``PreMulSum``, no division after) are also the ones gloo has."""
    from torch.distributed.fsdp import FSDPModule

    for part in parts:
        for m in part.modules():
            if isinstance(m, FSDPModule):
                m.set_gradient_divide_factor(1.0)
                m.set_force_sum_reduction_for_comms(True)
