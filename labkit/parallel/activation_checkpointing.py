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
  adds), as Korthikanti et al. 2022 recompute the cheap-to-compute, expensive-to-store parts.
* ``"selective:alternate"``: the same, but every second matmul of a block is recomputed too: the
  op-level policy torchtitan ships (its ``_op_sac_save_list`` with the ``mm`` count), half way
  between keeping every matmul output and recomputing the block.

Implemented with PyTorch's own machinery: non-reentrant ``torch.utils.checkpoint.checkpoint`` and
``create_selective_checkpoint_contexts``. The block's ``forward`` is replaced on the instance rather
than the block wrapped in another module, so parameter names, state dicts and FSDP/DDP wrapping
(apply before wrapping) are unchanged. ``backend="deepspeed"`` uses DeepSpeed's own
``deepspeed.checkpointing.checkpoint`` for "full" and "every:k" (it has no op-level selective policy).
"""
from __future__ import annotations

import functools

import torch
import torch.nn as nn
from torch.utils.checkpoint import (
    CheckpointPolicy,
    checkpoint,
    create_selective_checkpoint_contexts,
)

POLICIES = ("none", "full", "every:k", "selective", "selective:alternate")
_aten = torch.ops.aten
# Outputs worth keeping: expensive to recompute, and for attention the fused kernels' outputs.
SAVE_OPS = {_aten.mm.default, _aten.addmm.default, _aten.bmm.default, _aten.linear.default,
            _aten._scaled_dot_product_flash_attention.default,
            _aten._scaled_dot_product_efficient_attention.default,
            _aten._scaled_dot_product_cudnn_attention.default,
            _aten._scaled_dot_product_flash_attention_for_cpu.default}
MATMULS = {_aten.mm.default, _aten.addmm.default}  # what the linear layers run as


def parse_policy(policy: str) -> tuple[str, int]:
    """``"every:3"`` -> ``("every", 3)``; clear errors for anything else."""
    if isinstance(policy, str) and policy.startswith("every:"):
        k = policy.split(":", 1)[1]
        if not (k.isascii() and k.isdigit()) or int(k) < 1:  # '²'.isdigit() is True; int('²') fails
            raise ValueError(f"policy={policy!r}: k in 'every:k' must be a positive integer, e.g. 'every:2'")
        return "every", int(k)
    if policy == "selective:alternate":
        return "alternate", 1
    if policy not in ("none", "full", "selective"):
        raise ValueError(f"policy={policy!r} is unknown; valid policies: {list(POLICIES)} (e.g. 'every:2')")
    return policy, 1


def _selective_policy(ctx, op, *args, **kwargs):
    return CheckpointPolicy.MUST_SAVE if op in SAVE_OPS else CheckpointPolicy.PREFER_RECOMPUTE


def _alternate_contexts():
    """Save every first matmul and recompute every second, counted separately in forward and in the
    recomputation, so that both make the same choice for the same op (torchtitan's op-level policy)."""
    seen = {False: 0, True: 0}  # matmuls met, by ctx.is_recompute

    def policy(ctx, op, *args, **kwargs):
        if op in MATMULS:
            seen[ctx.is_recompute] += 1
            if seen[ctx.is_recompute] % 2 == 0:
                return CheckpointPolicy.PREFER_RECOMPUTE
        return _selective_policy(ctx, op)

    return create_selective_checkpoint_contexts(policy)


def _checkpointed_forward(original, kind: str, *args, **kwargs):
    context_fn = {"selective": functools.partial(create_selective_checkpoint_contexts, _selective_policy),
                  "alternate": _alternate_contexts}.get(kind)
    extra = {"context_fn": context_fn} if context_fn else {}
    return checkpoint(original, *args, use_reentrant=False, preserve_rng_state=True, **extra, **kwargs)


def _deepspeed_checkpoint(kind: str):
    import deepspeed.comm
    from deepspeed.runtime.activation_checkpointing import (
        checkpointing as ds_checkpointing,
    )

    if kind in ("selective", "alternate"):
        raise ValueError(f"policy={kind!r} (op level) has no DeepSpeed equivalent (DeepSpeed checkpoints whole "
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
    if not isinstance(getattr(model, "blocks", None), (nn.ModuleList, nn.ModuleDict)):
        raise TypeError("apply() needs a model with its transformer blocks in `.blocks` (an nn.ModuleList, or a "
                        "pipeline stage's nn.ModuleDict)")
    blocks = model.blocks  # a stage's ModuleDict is keyed by the GPT's block index: "every:k" counts those
    indexed = ((int(k), b) for k, b in blocks.items()) if isinstance(blocks, nn.ModuleDict) else enumerate(blocks)
    for i, block in indexed:
        if getattr(block, "_labkit_checkpoint", None):
            raise RuntimeError(f"block {i} is already checkpointed ({block._labkit_checkpoint!r})")
        if kind == "none" or (kind == "every" and i % k):
            continue
        if ds_checkpoint is not None:  # reentrant, as DeepSpeed's is: the block input needs grad
            block.forward = functools.partial(ds_checkpoint, block.forward)
        else:
            block.forward = functools.partial(_checkpointed_forward, block.forward, kind)
        block._labkit_checkpoint = policy
    return model
