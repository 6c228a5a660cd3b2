"""Activation checkpointing: keep less of the forward pass, recompute the rest in backward.

Chen et al. 2016, "Training Deep Nets with Sublinear Memory Cost": keep only the inputs of
checkpointed segments and re-run each segment's forward during backward. Policies for the GPT:

* ``"none"``: autograd keeps everything backward needs.
* ``"full"``: every block is a segment; only block inputs are kept (Korthikanti et al.'s "full
  recomputation", 2sbh bytes per layer in 16 bits), at the price of one more forward pass.
* ``"every:k"``: blocks 0, k, 2k, ... are checkpointed; the rest keep their activations, so about
  (1 - 1/k) of the activations stay: a knob between "none" and "full". (Chen et al.'s sqrt(n)
  schedule instead checkpoints segments of several consecutive layers as one unit.)
* ``"selective"``: inside every block, keep the outputs of the compute-heavy ops (matmuls and the
  fused attention kernel) and recompute the cheap element-wise ones (LayerNorm, GELU, residual
  adds), as Korthikanti et al. 2022 recompute the cheap-to-compute, expensive-to-store parts; the
  op list follows torchtitan's op-level selective checkpointing.

Implemented with PyTorch's own machinery: non-reentrant ``torch.utils.checkpoint.checkpoint`` and
``create_selective_checkpoint_contexts``. The block's ``forward`` is replaced on the instance rather
than the block wrapped in another module, so parameter names, state dicts and FSDP/DDP wrapping
(apply before wrapping) are unchanged. ``backend="deepspeed"`` uses DeepSpeed's own
``deepspeed.checkpointing.checkpoint`` for "full" and "every:k" (it has no op-level selective policy).
"""
from __future__ import annotations

import functools
import time

import torch
import torch.nn as nn
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts
from torch.utils.flop_counter import FlopCounterMode

POLICIES = ("none", "full", "every:k", "selective")
_aten = torch.ops.aten
# Outputs worth keeping: expensive to recompute, and for attention the fused kernels' outputs.
SAVE_OPS = {_aten.mm.default, _aten.addmm.default, _aten.bmm.default, _aten.linear.default,
            _aten._scaled_dot_product_flash_attention.default,
            _aten._scaled_dot_product_efficient_attention.default,
            _aten._scaled_dot_product_cudnn_attention.default,
            _aten._scaled_dot_product_flash_attention_for_cpu.default}


def parse_policy(policy: str) -> tuple[str, int]:
    """``"every:3"`` -> ``("every", 3)``; clear errors for anything else."""
    if isinstance(policy, str) and policy.startswith("every:"):
        k = policy.split(":", 1)[1]
        if not k.isdigit() or int(k) < 1:
            raise ValueError(f"policy={policy!r}: k in 'every:k' must be a positive integer, e.g. 'every:2'")
        return "every", int(k)
    if policy not in ("none", "full", "selective"):
        raise ValueError(f"policy={policy!r} is unknown; valid policies: {list(POLICIES)} (e.g. 'every:2')")
    return policy, 1


def _selective_policy(ctx, op, *args, **kwargs):
    return CheckpointPolicy.MUST_SAVE if op in SAVE_OPS else CheckpointPolicy.PREFER_RECOMPUTE


def _checkpointed_forward(original, selective: bool, *args, **kwargs):
    context_fn = (functools.partial(create_selective_checkpoint_contexts, _selective_policy)
                  if selective else None)
    extra = {"context_fn": context_fn} if context_fn else {}
    return checkpoint(original, *args, use_reentrant=False, preserve_rng_state=True, **extra, **kwargs)


def _deepspeed_checkpoint(kind: str):
    import deepspeed.comm
    from deepspeed.runtime.activation_checkpointing import checkpointing as ds_checkpointing

    if kind == "selective":
        raise ValueError("policy='selective' has no DeepSpeed equivalent (DeepSpeed checkpoints whole "
                         "segments); use backend='torch' for it, or 'full' / 'every:k' with DeepSpeed")
    if not deepspeed.comm.is_initialized():
        raise RuntimeError("backend='deepspeed' needs DeepSpeed's process group: call "
                           "deepspeed.init_distributed() (after torchrun or labkit.launch) first")
    ds_checkpointing.configure(None, partition_activations=False, checkpoint_in_cpu=False)
    return ds_checkpointing.checkpoint


def apply(model: nn.Module, policy: str, backend: str = "torch") -> nn.Module:
    """Checkpoint ``model.blocks`` in place according to ``policy``; returns the model."""
    kind, k = parse_policy(policy)
    if backend not in ("torch", "deepspeed"):
        raise ValueError(f"backend={backend!r} is unknown; valid backends: ['torch', 'deepspeed']")
    ds_checkpoint = _deepspeed_checkpoint(kind) if backend == "deepspeed" and kind != "none" else None
    blocks = getattr(model, "blocks", None)
    if not isinstance(blocks, nn.ModuleList):
        raise TypeError("apply() needs a model with its transformer blocks in `.blocks` (an nn.ModuleList)")
    for i, block in enumerate(blocks):
        if getattr(block, "_labkit_checkpoint", None):
            raise RuntimeError(f"block {i} is already checkpointed ({block._labkit_checkpoint!r})")
        if kind == "none" or (kind == "every" and i % k):
            continue
        if ds_checkpoint is not None:  # reentrant, as DeepSpeed's is: the block input needs grad
            block.forward = functools.partial(ds_checkpoint, block.forward)
        else:
            block.forward = functools.partial(_checkpointed_forward, block.forward, kind == "selective")
        block._labkit_checkpoint = policy
    return model


def _count_cpu_attention_flops() -> None:
    """Give the CPU fused-attention kernels the FLOP formulas PyTorch registers for the CUDA ones.

    ``FlopCounterMode`` knows ``_scaled_dot_product_flash_attention`` (CUDA) but not its CPU twin,
    which would make attention, and its recomputation, cost zero FLOPs on CPU.
    """
    from torch.utils import flop_counter as fc

    for op, formula in ((_aten._scaled_dot_product_flash_attention_for_cpu, fc.sdpa_flop),
                        (_aten._scaled_dot_product_flash_attention_for_cpu_backward, fc.sdpa_backward_flop)):
        if op not in fc.flop_registry:
            fc.register_flop_formula(op, get_raw=True)(formula)  # formula already takes shapes


_count_cpu_attention_flops()


def measure_step(model: nn.Module, idx: torch.Tensor, targets: torch.Tensor, repeats: int = 3) -> dict:
    """One training step's activation bytes held for backward, peak bytes, FLOPs and wall time.

    Saved bytes come from the live-storage count of :mod:`labkit.memory_probe` (it also sees what
    selective checkpointing caches); the peak is CUDA's allocator peak on GPU, the saved figure on
    CPU. FLOPs are forward + backward from ``FlopCounterMode`` (matmuls and attention; element-wise
    ops count zero); time is the median of ``repeats`` after one warm-up step, with the spread
    (max - min) / median, so a reader can tell a difference from noise.
    """
    from labkit.memory_probe import saved_activation_bytes

    saved = saved_activation_bytes(model, idx, targets)["total"]
    with FlopCounterMode(display=False) as fc:
        model(idx, targets)[1].backward()
    flops = fc.get_total_flops()
    model.zero_grad(set_to_none=True)
    cuda = idx.device.type == "cuda"
    times, peak = [], saved
    for i in range(repeats + 1):  # the first run warms caches and the allocator, and is not timed
        if cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        t0 = time.perf_counter()
        model(idx, targets)[1].backward()
        if cuda:
            torch.cuda.synchronize()
            peak = torch.cuda.max_memory_allocated()
        if i:
            times.append(time.perf_counter() - t0)
        model.zero_grad(set_to_none=True)
    times.sort()
    median = times[len(times) // 2]
    return {"saved_bytes": saved, "peak_bytes": peak, "flops": flops, "seconds": median,
            "seconds_spread": (times[-1] - times[0]) / median}


def largest_fit(model, recompute: str, world_size: int = 8, device_memory_gb: float = 80.0,
                stage: int = 3, vary: str = "micro_batch", limit: int = 4096, headroom: float = 0.1) -> int:
    """The largest micro-batch, or number of layers, that fits per the memory calculator.

    ``vary="n_layer"`` grows the model at fixed width: parameters scale with depth (12 h^2 per
    layer plus the embeddings), so this answers "how much larger a model fits". ``headroom`` is
    kept free for temporaries, as :func:`labkit.choose.choose_strategy` does.
    """
    from dataclasses import replace

    from labkit.memory import estimate_memory, model_shape

    if vary not in ("micro_batch", "n_layer"):
        raise ValueError(f"vary={vary!r} is unknown; valid: ['micro_batch', 'n_layer']")
    shape = model_shape(model)
    embed = shape.n_params - 12 * shape.n_layer * shape.hidden ** 2

    def fits(x: int) -> bool:
        s, mb = shape, 1
        if vary == "n_layer":
            s = replace(shape, n_layer=x, n_params=embed + 12 * x * shape.hidden ** 2)
        else:
            mb = x
        e = estimate_memory(s, mb, world_size, stage, recompute=recompute, device_memory_gb=device_memory_gb)
        return e.total <= e.device_bytes * (1 - headroom)

    lo, hi = 0, 1
    while hi <= limit and fits(hi):
        lo, hi = hi, hi * 2
    hi = min(hi, limit + 1)
    while hi - lo > 1:  # largest x with fits(x), between lo (fits or 0) and hi (does not)
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    return lo
