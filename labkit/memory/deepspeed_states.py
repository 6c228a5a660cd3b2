"""DeepSpeed's ZeRO model states to the byte: measured on a live engine, and predicted from the sizes.

The ZeRO paper's model (:func:`labkit.memory.calculator.model_state_breakdown`) divides Psi by N;
DeepSpeed pads its flat buffers and keeps whole the parameters that straddle a partition's edge.
:func:`predicted_model_states` models those details exactly, :func:`model_states` reads what an
engine holds, and the zero_fsdp lab holds the two equal on every rank.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from labkit.memory.calculator import ModelStates
from labkit.memory.probe import unique_storage_bytes

if TYPE_CHECKING:
    from deepspeed import DeepSpeedEngine


def model_states(engine: DeepSpeedEngine) -> ModelStates:
    """Per-rank parameter, gradient and optimizer-state bytes of a DeepSpeed ZeRO engine.

    Call it between ``engine.backward`` and ``engine.step`` (gradients are freed by the step).
    DeepSpeed keeps parameters partitioned in ``ds_tensor`` under stage 3, reduced gradient
    partitions (stages 2-3; stage 1 too at an accumulation boundary) or full ``.grad`` (stage 1
    while accumulating), and an fp32 master copy of each partition even when training in fp32.
    Bytes are counted per storage: a partition that is a view into a reduction bucket counts the
    bucket, which is what the rank really holds.
    """
    opt, stage = engine.optimizer, engine.zero_optimization_stage()
    module_params = list(engine.module.parameters())
    params = [getattr(p, "ds_tensor", p) for p in module_params]
    if stage == 3:
        grads = [opt.grad_partitions_flat_buffer]
        masters = list(opt.fp32_partitioned_groups_flat)
    else:  # the reduced gradients of this rank's partition, per parameter group
        grads = [g for group in opt.averaged_gradients.values() if group is not None
                 for g in (group if isinstance(group, (list, tuple)) else [group])]
        # ZeRO-2 between micro-batches: the reduced gradients of this rank's parameters
        grads += [g for group in getattr(opt, "all_grad_tensors", {}).values() if group is not None for g in group]
        if getattr(opt, "grads_in_partition", None) is not None:
            grads.append(opt.grads_in_partition)
        grads += [p.grad for p in module_params if p.grad is not None]
        masters = list(opt.single_partition_of_fp32_groups)
    states = [v for s in opt.optimizer.state.values() for v in s.values() if isinstance(v, torch.Tensor)]
    return ModelStates(params=unique_storage_bytes(params), grads=unique_storage_bytes(grads),
                       optimizer=unique_storage_bytes(masters) + unique_storage_bytes(states))


def predicted_model_states(param_numels: list[int], world_size: int, rank: int, stage: int,
                           accumulating: bool = False, bytes_per_elem: int = 4) -> ModelStates:
    """What a DeepSpeed ZeRO rank holds in fp32 training, to the byte, from the parameter sizes.

    The ZeRO paper's model (``labkit.memory.model_state_breakdown`` with "fp32_master") plus the
    places DeepSpeed departs from Psi/N. Stages 1-2 pad the flat parameter buffer to a multiple of
    2N elements (``nccl_start_alignment_factor``), so a partition is ceil(Psi/2N)*2 elements; stage
    3 partitions each parameter on its own, ceil(numel/N) elements apiece. And
    stages 1-2 keep the reduced gradient of every parameter that *overlaps* the rank's partition
    whole (``copy_grads_in_partition`` sizes its buffer by full ``numel``), so the two parameters
    straddling the partition's edges are counted entirely. ZeRO-1 holds full gradients only
    between micro-batches of an accumulation; at the boundary it keeps its partition like ZeRO-2.
    """
    if stage not in (1, 2, 3):
        raise ValueError(f"stage={stage!r} is unknown; valid ZeRO stages for DeepSpeed: [1, 2, 3]")
    if not 0 <= rank < world_size:
        raise ValueError(f"rank={rank!r} must be in [0, world_size={world_size})")
    psi = sum(param_numels)
    align = 2 * world_size
    part = -(-psi // align) * align // world_size  # elements per partition, padding included
    lo, hi = rank * part, (rank + 1) * part
    overlap, start = 0, 0
    for n in param_numels:  # whole parameters touching [lo, hi)
        if start < hi and start + n > lo:
            overlap += n
        start += n
    if stage == 3:  # each parameter is partitioned separately, padded to N pieces
        part = sum(-(-n // world_size) for n in param_numels)
        params, grads = part, part
    else:  # the flat fp16/fp32 parameter buffer every rank keeps whole, padding included
        params = part * world_size
        grads = psi if (stage == 1 and accumulating) else overlap
    # fp32 master partition + Adam's two moments; Adam's step counter is a 4-byte scalar tensor
    optimizer = 3 * part * bytes_per_elem + 4
    return ModelStates(params=params * bytes_per_elem, grads=grads * bytes_per_elem, optimizer=optimizer)
