"""Dropless experts: every routed row computed, the rows sorted by expert and multiplied in one grouped
GEMM per projection (MegaBlocks, Gale et al. 2023, section 5: "dMoE" never drops tokens and never pads;
its default MLP runs ``grouped_gemm``'s ``gmm`` over the experts' row counts, as here).

:func:`run_experts` takes rows already sorted by expert (``counts[e]`` rows for expert e, in order) and
returns each row's expert output in the same order. Two implementations of the same product:

* ``"grouped"``: ``torch._grouped_mm(x, W, offs=...)`` multiplies row block e of ``x`` by ``W[e]`` in
  one call, for ``fc`` and then ``proj`` (the weights stacked ``(E, in, out)``; ``offs`` the running
  row ends, int32). torch 2.13 has it on CPU for fp32, bf16 and fp16 with every row 16-byte aligned;
  CUDA builds have it where their kernels do (bf16 on recent GPUs). :func:`grouped_mm_works` asks
  the build itself, once per device and dtype, with a tiny product.
* ``"loop"``: one ``nn.Linear`` call per expert on its slice: the same sums, one GEMM per expert. It is
  what runs where the grouped kernel is missing, and whenever an expert is not a plain ``nn.Linear``
  pair of plain tensors: FP8 linears (:mod:`labkit.device.fp8`) and FSDP2-sharded experts
  (:mod:`labkit.parallel.fsdp` shards each expert apart and gathers it when the expert is *called*;
  stacking its weights would read the shards). torchtitan stores its experts stacked for this reason;
  here each expert stays its own module so that expert parallelism and FSDP place it by name.

``"auto"`` (the default) picks ``"grouped"`` where it can run. The weights are stacked at each call
(one copy of the local experts' weights; the stack's backward hands each expert its own gradient).
"""
from __future__ import annotations

from functools import lru_cache
from typing import Sequence

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils import flop_counter
from torch.utils._python_dispatch import _disable_current_modes

IMPLS = ("auto", "grouped", "loop")


@lru_cache(maxsize=None)
def grouped_mm_works(device: str, dtype: torch.dtype) -> bool:
    """Whether this build runs ``torch._grouped_mm`` on ``device`` in ``dtype`` (a 2 x 2-expert probe)."""
    if not hasattr(torch, "_grouped_mm"):
        return False
    # Outside any dispatch mode: a FlopCounterMode would count the probe, a FakeTensorMode (the memory
    # trackers) would make it fail and cache the failure for real tensors too.
    with _disable_current_modes():
        try:
            x = torch.ones(4, 8, device=device, dtype=dtype)
            w = torch.ones(2, 8, 8, device=device, dtype=dtype)
            offs = torch.tensor([1, 4], device=device, dtype=torch.int32)
            return bool(torch._grouped_mm(x, w, offs=offs).sum().item() == 4 * 8 * 8)
        except (RuntimeError, NotImplementedError):
            return False


def _plain(experts: Sequence[nn.Module]) -> bool:
    """Every expert two plain ``nn.Linear`` of plain tensors (no FP8 subclass, no FSDP shard, no DTensor)."""
    for e in experts:
        for lin in (e.fc, e.proj):
            if type(lin) is not nn.Linear or type(lin.weight.data) is not torch.Tensor:
                return False
    return True


def can_group(experts: Sequence[nn.Module], x: torch.Tensor) -> bool:
    """Whether :func:`run_experts` may take the grouped path for these experts and rows."""
    if not experts or not _plain(experts):
        return False
    dtype = x.dtype
    if torch.is_autocast_enabled(x.device.type):
        dtype = torch.get_autocast_dtype(x.device.type)
    widths = (experts[0].fc.in_features, experts[0].fc.out_features)
    aligned = all(w * torch.finfo(dtype).bits // 8 % 16 == 0 for w in widths)  # the kernel's row alignment
    return aligned and grouped_mm_works(str(x.device), dtype)


def _grouped(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, offs: torch.Tensor,
             counts: torch.Tensor) -> torch.Tensor:
    y = torch._grouped_mm(x, w, offs=offs)
    if y.requires_grad:
        # torch 2.13's CPU backward of _grouped_mm refuses a gradient with zero strides (an expanded
        # one, as ``y.sum().backward()`` gives): hand it a dense copy.
        y.register_hook(lambda g: g.contiguous())
    return y if b is None else y + b.repeat_interleave(counts, dim=0, output_size=x.shape[0])


def run_experts(experts: Sequence[nn.Module], x: torch.Tensor, counts: Sequence[int],
                impl: str = "auto") -> torch.Tensor:
    """Rows of ``x`` sorted by expert (``counts[e]`` for ``experts[e]``) through their experts, in order."""
    if impl not in IMPLS:
        raise ValueError(f"impl={impl!r} is unknown; valid: {list(IMPLS)}")
    if impl == "loop" or (impl == "auto" and not can_group(experts, x)):
        return torch.cat([e(chunk) for e, chunk in zip(experts, x.split(list(counts)))])
    if not _plain(experts):
        raise ValueError("impl='grouped' needs every expert as plain nn.Linear weights (not FP8, not sharded)")
    dtype = torch.get_autocast_dtype(x.device.type) if torch.is_autocast_enabled(x.device.type) else x.dtype
    n = torch.tensor(list(counts), device=x.device)
    offs = n.cumsum(0).to(torch.int32)
    with torch.autocast(x.device.type, enabled=False):  # one dtype for both operands, as autocast would pick
        w1 = torch.stack([e.fc.weight for e in experts]).transpose(1, 2).to(dtype)  # (E, in, hidden)
        w2 = torch.stack([e.proj.weight for e in experts]).transpose(1, 2).to(dtype)  # (E, hidden, in)
        b1 = torch.stack([e.fc.bias for e in experts]).to(dtype) if experts[0].fc.bias is not None else None
        b2 = torch.stack([e.proj.bias for e in experts]).to(dtype) if experts[0].proj.bias is not None else None
        h = F.gelu(_grouped(x.to(dtype), w1, b1, offs, n))
        y = _grouped(h, w2, b2, offs, n)
    return experts[0].drop(y)  # dropout after proj, as Expert.forward (one draw for all rows)


def per_token_reference(block: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """The dense per-token reference of a dropless block: for each token alone, ``sum_j g_j E_j(x)``
    over its chosen experts, one expert call at a time (plus the shared experts); no sorting, no
    grouping. Same shape as ``x``."""
    h = x.reshape(-1, x.shape[-1])
    _, choice, gates = block.route(h)
    out = torch.zeros_like(h)
    for t in range(h.shape[0]):
        for j in range(choice.shape[0]):
            out[t] += gates[j, t].to(h.dtype) * block.experts[str(int(choice[j, t]))](h[t:t + 1])[0]
        if getattr(block, "shared", None) is not None:
            out[t] += block.shared(h[t:t + 1])[0]
    return out.view(x.shape)


if hasattr(torch.ops.aten, "_grouped_mm") and torch.ops.aten._grouped_mm not in flop_counter.flop_registry:
    # FlopCounterMode (torch 2.13) has no formula for _grouped_mm and would count it as 0. Each of its
    # three uses (forward; backward for the input; backward for the weights, grouped over the
    # contraction) multiplies every element of its first operand by a row of the second's last width.
    @flop_counter.register_flop_formula(torch.ops.aten._grouped_mm)
    def _grouped_mm_flop(a_shape, b_shape, *args, out_shape=None, **kwargs) -> int:
        return 2 * int(torch.Size(a_shape).numel()) * int(b_shape[-1])
