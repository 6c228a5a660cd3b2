"""DeepSpeed ZeRO stages 1-3 behind labkit's strategy names ``zero1``, ``zero2``, ``zero3``.

ZeRO (Rajbhandari et al. 2020) as DeepSpeed implements it: ``deepspeed.initialize`` wraps the plain
GPT and the client ``torch.optim.AdamW`` (no fused-Adam build needed) with a generated config. The
engine then owns backward, gradient clipping, the optimizer step and zeroing the gradients.

On CPU DeepSpeed selects its CPU accelerator and gloo. It would compile a shared-memory op when its
process group starts (about a minute, g++); :func:`initialize` skips it, as ZeRO training never
uses it.
"""
from __future__ import annotations

import contextlib
import os
import sys
from typing import TYPE_CHECKING, Callable

import torch
import torch.nn as nn

if TYPE_CHECKING:
    from deepspeed import DeepSpeedEngine
    from torch.optim.lr_scheduler import LRScheduler


def deepspeed_config(stage: int, micro_batch: int, world_size: int, grad_accum: int = 1,
                     grad_clip: float = 1.0, precision: str = "fp32", offload_optimizer: bool = False) -> dict:
    """The DeepSpeed config for one ZeRO stage (DeepSpeed docs, "DeepSpeed Configuration JSON")."""
    if stage not in (1, 2, 3):
        raise ValueError(f"stage={stage!r} is unknown; valid ZeRO stages for DeepSpeed: [1, 2, 3]")
    if precision not in ("fp32", "bf16", "fp16"):
        raise ValueError(f"precision={precision!r} is not supported with DeepSpeed; valid: ['fp32', 'bf16', 'fp16']")
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
        # fp16 weights with fp32 master copies and DeepSpeed's dynamic loss scaler ("loss_scale": 0):
        # start at 2^16, halve on an overflow (skipping that step), double after 1000 clean steps.
        "fp16": {"enabled": precision == "fp16", "loss_scale": 0, "initial_scale_power": 16,
                 "loss_scale_window": 1000, "hysteresis": 2, "min_loss_scale": 1},
        "steps_per_print": 10**9,  # keep DeepSpeed's progress logging out of the labs
        "wall_clock_breakdown": False,
    }


def use_accelerator(device: torch.device) -> None:
    """Make DeepSpeed compute where the run does. Left to itself DeepSpeed picks CUDA whenever CUDA
    exists, so a ``device=cpu`` run on a GPU host would move the model to the GPU while batches and
    gloo stay on the CPU. ``DS_ACCELERATOR`` is read once, when DeepSpeed first asks for it."""
    want = "cuda" if device.type == "cuda" else "cpu"
    os.environ["DS_ACCELERATOR"] = want
    if "deepspeed.accelerator" in sys.modules:
        from deepspeed.accelerator import get_accelerator

        got = get_accelerator().device_name()
        if got != want:
            raise RuntimeError(f"DeepSpeed already runs on {got!r} in this process, and this run asks for "
                               f"device={want!r}; run the {want} strategies in a fresh process")


def initialize(model: nn.Module, optimizer: torch.optim.Optimizer, config: dict, device: torch.device,
               lr_scheduler: LRScheduler | None = None) -> DeepSpeedEngine:
    """``deepspeed.initialize`` on ``device``'s accelerator, with errors that say what to do.

    A client ``lr_scheduler`` is stepped by ``engine.step()`` and saved in the engine's checkpoints."""
    init_distributed(device)
    import deepspeed

    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=config, lr_scheduler=lr_scheduler)
    return engine


def init_distributed(device: torch.device) -> None:
    """DeepSpeed's process group on ``device``'s accelerator and backend, without the op it would compile
    on CPU."""
    use_accelerator(device)
    try:
        import deepspeed
    except ImportError as e:
        raise RuntimeError(
            "strategies zero1/zero2/zero3 need DeepSpeed: install the pinned requirements "
            "(make venv), or `DS_BUILD_OPS=0 pip install --no-build-isolation deepspeed==0.19.8` "
            f"after torch ({e})") from None
    if device.type == "cpu":
        # On CPU, DeepSpeed compiles a shared-memory op when its group starts (40-60 s, needs g++); the
        # op serves only its inference all-reduce (deepspeed/comm/torch.py, inference_all_reduce), and
        # ZeRO training reduces through torch.distributed. Marked incompatible, it is never built.
        import deepspeed.ops

        deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
    try:
        deepspeed.init_distributed(dist_backend="nccl" if device.type == "cuda" else "gloo",
                                   auto_mpi_discovery=False)
    except Exception as e:  # noqa: BLE001 - the message says what to check
        raise RuntimeError(
            "DeepSpeed could not start its process group: check that the ranks can reach each other and, "
            "if DeepSpeed builds ops here, that g++ is installed and TORCH_EXTENSIONS_DIR is writable "
            f"({type(e).__name__}: {e})") from None


def engine_step(engine: DeepSpeedEngine, micros: list,
               after_first_backward: Callable[[DeepSpeedEngine], None] | None = None) -> torch.Tensor:
    """One optimizer step over ``micros`` (input, target) micro-batches: DeepSpeed accumulates and
    steps at the boundary itself. Returns the mean loss. ``after_first_backward(engine)`` runs between
    the first backward and its step, while the gradients exist (while accumulating, that is where
    ZeRO-1 and ZeRO-2 differ; :func:`labkit.memory.deepspeed_states.model_states` measures there)."""
    loss = torch.zeros((), device=micros[0][0].device)
    for i, (x, y) in enumerate(micros):
        micro_loss = engine(x, y)[1]
        engine.backward(micro_loss)
        if after_first_backward is not None and i == 0:
            after_first_backward(engine)
        engine.step()
        loss += micro_loss.detach() / len(micros)
    return loss


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
