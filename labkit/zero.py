"""DeepSpeed ZeRO stages 1-3 behind labkit's strategy names ``zero1``, ``zero2``, ``zero3``.

ZeRO (Rajbhandari et al. 2020) as DeepSpeed implements it: ``deepspeed.initialize`` wraps the plain
GPT and the client ``torch.optim.AdamW`` (no fused-Adam build needed) with a generated config. The
engine then owns backward, gradient clipping, the optimizer step and zeroing the gradients.

On CPU DeepSpeed selects its CPU accelerator and gloo, and compiles a small shared-memory
communication op the first time a process group starts (about a minute, needs g++); the build is
cached in ``TORCH_EXTENSIONS_DIR``, which the Makefile points into ``_build/``.
"""
from __future__ import annotations

import contextlib
import os
from typing import TYPE_CHECKING

import torch
import torch.nn as nn

if TYPE_CHECKING:
    from deepspeed import DeepSpeedEngine
    from torch.optim.lr_scheduler import LRScheduler

    from labkit.memory import ModelStates

STAGES = {"zero1": 1, "zero2": 2, "zero3": 3}


def deepspeed_config(stage: int, micro_batch: int, world_size: int, grad_accum: int = 1,
                     grad_clip: float = 1.0, precision: str = "fp32", offload_optimizer: bool = False) -> dict:
    """The DeepSpeed config for one ZeRO stage (DeepSpeed docs, "DeepSpeed Configuration JSON")."""
    if stage not in (1, 2, 3):
        raise ValueError(f"stage={stage!r} is unknown; valid ZeRO stages for DeepSpeed: [1, 2, 3]")
    if precision not in ("fp32", "bf16"):
        raise ValueError(f"precision={precision!r} is not supported with DeepSpeed here; valid: ['fp32', 'bf16']")
    # DeepSpeed's default reduces gradient buckets with a full all-reduce and keeps its own slice
    # (use_multi_rank_bucket_allreduce): 2 Psi for what ZeRO does with Psi. Reduce each slice to
    # its owner instead, the paper's reduce-scatter.
    zero: dict = {"stage": stage, "use_multi_rank_bucket_allreduce": False}
    if stage == 3:
        # On a small model DeepSpeed would keep every parameter gathered ("persistent") and reuse
        # gathered parameters between forward and backward; turn both off so the lab sees ZeRO-3.
        zero.update(stage3_param_persistence_threshold=0, stage3_max_reuse_distance=0,
                    stage3_prefetch_bucket_size=0)
    if offload_optimizer:
        zero["offload_optimizer"] = {"device": "cpu"}
    return {
        # With offload DeepSpeed insists on its own DeepSpeedCPUAdam (a compiled op); the client
        # torch.optim.AdamW keeps every strategy on the same optimizer and runs as is on the CPU.
        **({"zero_force_ds_cpu_optimizer": False} if offload_optimizer else {}),
        "train_micro_batch_size_per_gpu": micro_batch,
        "gradient_accumulation_steps": grad_accum,
        "train_batch_size": micro_batch * grad_accum * world_size,
        "gradient_clipping": grad_clip,
        "zero_optimization": zero,
        "bf16": {"enabled": precision == "bf16"},
        "steps_per_print": 10**9,  # keep DeepSpeed's progress logging out of the labs
        "wall_clock_breakdown": False,
    }


def initialize(model: nn.Module, optimizer: torch.optim.Optimizer, config: dict,
               lr_scheduler: LRScheduler | None = None) -> DeepSpeedEngine:
    """``deepspeed.initialize`` with errors that say what to do; returns the engine.

    A client ``lr_scheduler`` is stepped by ``engine.step()`` and saved in the engine's checkpoints."""
    os.environ.setdefault("DS_ACCELERATOR", "cuda" if torch.cuda.is_available() else "cpu")
    try:
        import deepspeed
    except ImportError as e:
        raise RuntimeError(
            "strategies zero1/zero2/zero3 need DeepSpeed: install the pinned requirements "
            "(make venv), or `DS_BUILD_OPS=0 pip install --no-build-isolation deepspeed==0.19.8` "
            f"after torch ({e})") from None
    try:
        deepspeed.init_distributed(dist_backend="nccl" if torch.cuda.is_available() else "gloo",
                                   auto_mpi_discovery=False)
    except Exception as e:  # the CPU comm op is compiled here on first use
        raise RuntimeError(
            "DeepSpeed could not start its process group; on CPU it compiles a small C++ op at first "
            "use: check that g++ is installed and TORCH_EXTENSIONS_DIR is writable "
            f"({type(e).__name__}: {e})") from None
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=config, lr_scheduler=lr_scheduler)
    return engine


def train_step(engine: DeepSpeedEngine, micros: list,
               measure: bool = False) -> tuple[torch.Tensor, ModelStates | None]:
    """One optimizer step over ``micros`` (input, target) micro-batches: DeepSpeed accumulates and
    steps at the boundary itself. Returns the mean loss and, with ``measure``, the model states held
    after the first backward (while accumulating: where ZeRO-1 and ZeRO-2 differ)."""
    loss, states = torch.zeros((), device=micros[0][0].device), None
    for i, (x, y) in enumerate(micros):
        micro_loss = engine(x, y)[1]
        engine.backward(micro_loss)
        if measure and i == 0:
            states = model_states(engine)
        engine.step()
        loss += micro_loss.detach() / len(micros)
    return loss, states


def full_state_dict(module: nn.Module, zero3: bool = False) -> dict:
    """Every parameter and buffer whole, on the CPU: DTensor shards (FSDP2) and ZeRO-3 partitions are
    gathered, so every rank must call it."""
    gather = contextlib.nullcontext()
    if zero3:
        import deepspeed

        gather = deepspeed.zero.GatheredParameters(list(module.parameters()))
    with gather:
        return {k: (v.full_tensor() if hasattr(v, "full_tensor") else v).detach().cpu().clone()
                for k, v in module.state_dict().items()}


def model_states(engine: DeepSpeedEngine) -> ModelStates:
    """Per-rank parameter, gradient and optimizer-state bytes of a DeepSpeed ZeRO engine.

    Call it between ``engine.backward`` and ``engine.step`` (gradients are freed by the step).
    DeepSpeed keeps parameters partitioned in ``ds_tensor`` under stage 3, reduced gradient
    partitions (stages 2-3; stage 1 too at an accumulation boundary) or full ``.grad`` (stage 1
    while accumulating), and an fp32 master copy of each partition even when training in fp32.
    Bytes are counted per storage: a partition that is a view into a reduction bucket counts the
    bucket, which is what the rank really holds.
    """
    from labkit.memory import ModelStates
    from labkit.memory_probe import unique_storage_bytes

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
    from labkit.memory import ModelStates

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
