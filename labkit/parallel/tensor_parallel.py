"""Tensor parallelism: every weight matrix of a block split over ``tp`` ranks (Megatron-LM).

Shoeybi et al. 2019, "Megatron-LM", section 3: the MLP's first matrix is split by columns and its
second by rows, so the GELU between them needs no communication; attention is split by heads the
same way (Q, K, V by columns, the output projection by rows). Two conjugate operators carry the
communication: ``f`` is the identity in forward and an all-reduce in backward (before each
column-parallel matrix), ``g`` an all-reduce in forward and the identity in backward (after each
row-parallel one). Per layer and step that is four all-reduces of the ``b x s x h`` activations.

Two implementations of the same split, held against each other and against one process:

* :func:`parallelize_dtensor`, the production path: ``parallelize_module`` with
  ``ColwiseParallel`` / ``RowwiseParallel`` on a device mesh (PyTorch docs, "Tensor Parallelism"),
  optionally with sequence parallelism for the LayerNorms (Korthikanti et al. 2022, section 4.2.2);
  it composes with FSDP2 on a 2-D (data x tensor) mesh (strategy ``tp`` of :mod:`labkit.train`).
* :func:`parallelize_scratch`, for teaching: :class:`ColumnParallelLinear` and
  :class:`RowParallelLinear` with ``f`` and ``g`` written as autograd functions.

The model never imports this module: both paths rewrite a plain :class:`labkit.core.model.GPT`.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from labkit.core.checks import positive_int
from labkit.core.model import GPT, GPTConfig, blocks_of

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh


def check_tp(tp: int, model_cfg: GPTConfig, world_size: int | None = None) -> None:
    """A clear error when ``tp`` cannot split the heads (and so the hidden size) evenly."""
    valid = [d for d in range(1, model_cfg.n_head + 1) if model_cfg.n_head % d == 0]
    try:
        positive_int("tp", tp)
    except ValueError as e:
        raise ValueError(f"{e}; valid degrees for this model: {valid}") from None
    if model_cfg.n_head % tp or model_cfg.n_embd % tp:
        raise ValueError(f"tp={tp} must divide n_head={model_cfg.n_head} and n_embd={model_cfg.n_embd} (each rank "
                         f"takes whole heads and an equal slice of the hidden size); valid tp values: {valid}")
    if world_size is not None and world_size % tp:
        raise ValueError(f"tp={tp} must divide world_size={world_size} (data-parallel x tensor-parallel ranks); "
                         f"valid tp values here: {[d for d in valid if world_size % d == 0]}")


def parallelize_dtensor(model: nn.Module, mesh: DeviceMesh, sequence_parallel: bool = False) -> nn.Module:
    """Megatron's split with DTensor: ``ColwiseParallel`` before, ``RowwiseParallel`` after each GELU
    or attention. With ``sequence_parallel`` the LayerNorms run on ``s/tp`` tokens each
    (``SequenceParallel``); the all-reduces become all-gathers and reduce-scatters of equal volume.

    ``model``: the GPT, or one pipeline stage of it (:class:`labkit.parallel.pipeline.stages.GPTStage`):
    a stage without the embeddings receives, and one without the head sends, its sequence shard.
    A mixture-of-experts block keeps its experts whole (they are split over ranks by expert
    parallelism instead); only its attention is split."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        PrepareModuleInput,
        PrepareModuleOutput,
        RowwiseParallel,
        SequenceParallel,
        parallelize_module,
    )

    check_tp(mesh.size(), model.config)
    blocks = blocks_of(model)
    if not sequence_parallel:
        for block in blocks:
            plan = {"attn.qkv": ColwiseParallel(), "attn.proj": RowwiseParallel()}
            if hasattr(block.mlp, "fc"):  # the dense MLP
                plan.update({"mlp.fc": ColwiseParallel(), "mlp.proj": RowwiseParallel()})
            parallelize_module(block, mesh, plan)
        return model
    # The residual stream stays a DTensor sharded on the sequence (dim 1) between the TP regions;
    # attention and the MLP gather the full sequence at their input, and their row-parallel output
    # is reduce-scattered back to sequence shards (Korthikanti et al. 2022, Figure 5).
    # The gathered input stays a DTensor (use_local_output=False): the column-parallel matmul's input
    # gradient is then Partial and its way back to sequence shards is one reduce-scatter. Handed over
    # as a plain tensor it would be re-wrapped as Replicate, whose backward all-reduces the full
    # activations: twice the reduce-scatter's ring bytes (measured with the counter).
    def gather(n_args: int) -> PrepareModuleInput:  # the block calls attn(x, attn_mask), mlp(x)
        return PrepareModuleInput(input_layouts=(Shard(1),) + (None,) * (n_args - 1),
                                  desired_input_layouts=(Replicate(),) + (None,) * (n_args - 1),
                                  use_local_output=False)

    plan = {"ln_1": SequenceParallel(), "attn": gather(2), "attn.qkv": ColwiseParallel(),
            "attn.proj": RowwiseParallel(output_layouts=Shard(1), use_local_output=False),
            "ln_2": SequenceParallel(), "mlp": gather(1), "mlp.fc": ColwiseParallel(),
            "mlp.proj": RowwiseParallel(output_layouts=Shard(1), use_local_output=False)}
    for block in blocks:
        parallelize_module(block, mesh, plan)
    # Embeddings stay replicated (small here); their sum is cut into sequence shards before the
    # first block, and the last norm's output gathered again for the tied head.
    ends = {"drop": PrepareModuleInput(input_layouts=(Replicate(),), desired_input_layouts=(Shard(1),)),
            "ln_f": SequenceParallel(),
            "head": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),),
                                       use_local_output=True)}
    parallelize_module(model, mesh, {k: v for k, v in ends.items() if hasattr(model, k)})
    # Between pipeline stages the shard travels as a plain tensor, (rows, tokens / tp, hidden)
    if not hasattr(model, "wte"):
        parallelize_module(blocks[0], mesh, PrepareModuleInput(
            input_layouts=(Shard(1),), desired_input_layouts=(Shard(1),), use_local_output=False))
    if not hasattr(model, "head"):
        parallelize_module(blocks[-1], mesh, PrepareModuleOutput(
            output_layouts=Shard(1), desired_output_layouts=Shard(1), use_local_output=True))
        blocks[-1].register_forward_hook(_own_copy)  # after to_local's hook, before FSDP2's
    return model


def _own_copy(module: nn.Module, args: tuple, out: torch.Tensor) -> torch.Tensor:
    """A stage's outgoing shard as a tensor of its own. ``DTensor.to_local`` returns a view
    (torch/distributed/tensor/_api.py, ``_ToTorchTensor.forward``: ``local_tensor.view_as(local_tensor)``),
    and torch's zero-bubble schedules detach a stage's outputs in place once their input gradients
    are computed (torch/distributed/pipelining/_backward.py, ``stage_backward_input``), which a view
    refuses: "Can't detach views in-place". The same in-place op is what FSDP2's "returned a view
    tensor" warning is about (pytorch/pytorch#181832: it drops the pre-backward hook). One copy of the
    (rows, tokens / tp, hidden) shard per microbatch; the view's storage is freed with it."""
    return out.clone()


class CopyToTensorParallel(torch.autograd.Function):
    """The ``f`` operator of Megatron-LM (Shoeybi et al. 2019, Figure 3): identity in forward,
    all-reduce of the input gradient in backward (each rank's heads contributed part of it)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        grad = grad.contiguous().clone()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


class ReduceFromTensorParallel(torch.autograd.Function):
    """The ``g`` operator: all-reduce in forward (sum the ranks' partial outputs), identity in backward."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
        x = x.contiguous().clone()
        dist.all_reduce(x, group=group)
        return x

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad, None


def _shard(p: torch.Tensor | None, dim: int, tp: int, rank: int) -> nn.Parameter | None:
    if p is None:
        return None
    out = nn.Parameter(p.detach().chunk(tp, dim)[rank].clone())
    out.tp_shard_dim = dim  # read by full_state_dict and the gradient clipping
    return out


class ColumnParallelLinear(nn.Module):
    """``Y_r = f(X) A_r + b_r``: this rank's slice of the output features (Megatron's A = [A_1 ... A_t])."""

    def __init__(self, linear: nn.Linear, group: dist.ProcessGroup | None, tp: int, rank: int) -> None:
        super().__init__()
        self.group = group
        self.weight = _shard(linear.weight, 0, tp, rank)
        self.bias = _shard(linear.bias, 0, tp, rank)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(CopyToTensorParallel.apply(x, self.group), self.weight, self.bias)


class RowParallelLinear(nn.Module):
    """``Y = g(X_r B_r) + b``: this rank's slice of the input features; the bias is added once, after the sum."""

    def __init__(self, linear: nn.Linear, group: dist.ProcessGroup | None, tp: int, rank: int) -> None:
        super().__init__()
        self.group = group
        self.weight = _shard(linear.weight, 1, tp, rank)
        self.bias = linear.bias  # replicated: every rank adds the same bias to the summed output

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = ReduceFromTensorParallel.apply(F.linear(x, self.weight), self.group)
        return y if self.bias is None else y + self.bias


def parallelize_scratch(model: GPT, group: dist.ProcessGroup | None = None) -> GPT:
    """The same split as :func:`parallelize_dtensor`, with the hand-written layers and operators."""
    tp, rank = dist.get_world_size(group), dist.get_rank(group)
    check_tp(tp, model.config)
    for block in blocks_of(model):
        a, m = block.attn, block.mlp
        a.qkv, a.proj = ColumnParallelLinear(a.qkv, group, tp, rank), RowParallelLinear(a.proj, group, tp, rank)
        m.fc, m.proj = ColumnParallelLinear(m.fc, group, tp, rank), RowParallelLinear(m.proj, group, tp, rank)
    return model


def full_state_dict(model: nn.Module, tp: int, group: dist.ProcessGroup | None = None) -> dict[str, torch.Tensor]:
    """The unsplit GPT's state dict on every rank (a collective): shards gathered."""
    out = {}
    for name, t in model.state_dict(keep_vars=True).items():  # the Parameters, with tp_shard_dim
        if hasattr(t, "full_tensor"):
            t = t.full_tensor()
        elif getattr(t, "tp_shard_dim", None) is not None:
            parts = [torch.empty_like(t) for _ in range(tp)]
            dist.all_gather(parts, t.detach().contiguous(), group=group)
            t = torch.cat(parts, dim=t.tp_shard_dim)
        out[name] = t.detach().cpu().clone()
    return out


def params_per_rank(cfg: GPTConfig, tp: int) -> int:
    """Parameters one TP rank holds: block matrices (and the column-parallel biases) split by ``tp``,
    LayerNorms, row-parallel biases, embeddings and the tied head replicated."""
    check_tp(tp, cfg)
    C, b = cfg.n_embd, int(cfg.bias)
    ln = C * (1 + b)
    split = 3 * C * C + 3 * C * b + C * C + 4 * C * C + 4 * C * b + 4 * C * C
    replicated = 2 * ln + C * b + C * b
    return cfg.vocab_size * C + cfg.block_size * C + cfg.n_layer * (split // tp + replicated) + ln


def comm_bytes_per_layer(micro_batch: int, seq_len: int, hidden: int, dtype_bytes: int = 4) -> int:
    """Payload all-reduced per layer per training step: ``g`` twice in forward, ``f`` twice in
    backward, each ``b * s * h`` elements (Shoeybi et al. 2019, section 3; Korthikanti et al. 2022,
    section 4.2.2 for the same volume as all-gather + reduce-scatter under sequence parallelism)."""
    return 4 * micro_batch * seq_len * hidden * dtype_bytes
