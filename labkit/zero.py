"""DeepSpeed ZeRO stages 1-3 behind labkit's strategy names ``zero1``, ``zero2``, ``zero3``.

ZeRO (Rajbhandari et al. 2020) as DeepSpeed implements it: ``deepspeed.initialize`` wraps the plain
GPT and the client ``torch.optim.AdamW`` (no fused-Adam build needed) with a generated config. The
engine then owns backward, gradient clipping, the optimizer step and zeroing the gradients.

On CPU DeepSpeed selects its CPU accelerator and gloo, and compiles a small shared-memory
communication op the first time a process group starts (about a minute, needs g++); the build is
cached in ``TORCH_EXTENSIONS_DIR``, which the Makefile points into ``_build/``.
"""
from __future__ import annotations

import os

import torch
import torch.nn as nn

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
        "train_micro_batch_size_per_gpu": micro_batch,
        "gradient_accumulation_steps": grad_accum,
        "train_batch_size": micro_batch * grad_accum * world_size,
        "gradient_clipping": grad_clip,
        "zero_optimization": zero,
        "bf16": {"enabled": precision == "bf16"},
        "steps_per_print": 10**9,  # keep DeepSpeed's progress logging out of the labs
        "wall_clock_breakdown": False,
    }


def initialize(model: nn.Module, optimizer: torch.optim.Optimizer, config: dict):
    """``deepspeed.initialize`` with errors that say what to do; returns the engine."""
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
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=config)
    return engine


def model_states(engine):
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
        if getattr(opt, "grads_in_partition", None) is not None:
            grads.append(opt.grads_in_partition)
        grads += [p.grad for p in module_params if p.grad is not None]
        masters = list(opt.single_partition_of_fp32_groups)
    states = [v for s in opt.optimizer.state.values() for v in s.values() if isinstance(v, torch.Tensor)]
    return ModelStates(params=unique_storage_bytes(params), grads=unique_storage_bytes(grads),
                       optimizer=unique_storage_bytes(masters) + unique_storage_bytes(states))
