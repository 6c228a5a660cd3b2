"""The from-scratch ring attention held against PyTorch's own
(``torch.distributed.tensor.experimental.context_parallel``).

PyTorch's API shards named buffers along the sequence (its default causal load balancer is the same
head-tail / zig-zag split as :func:`labkit.parallel.context.layout.zigzag_indices`) and patches
``scaled_dot_product_attention`` with a ring over the DeviceMesh. It handles only the CUDA fused
kernels (flash, memory-efficient, cuDNN). On CPU (torch 2.13, gloo) SDPA dispatches to
``aten._scaled_dot_product_flash_attention_for_cpu``, which it does not handle: ``NotImplementedError:
Operator aten._scaled_dot_product_flash_attention_for_cpu.default does not have a sharding strategy
registered``; forcing the math backend fails on mixed Tensor/DTensor arguments. So on CPU the
from-scratch version is held against one process, and :func:`check_against_torch_cp` runs on GPUs
(``launch(check_against_torch_cp, world_size=N, device="cuda")``, N GPUs); on CPU it reports torch's error.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

from labkit.core.devices import comm_device
from labkit.parallel.context.ring import ring_attention
from labkit.parallel.context.layout import zigzag_shard


def _torch_cp(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
              positions: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """PyTorch's context parallelism on these full tensors: (this rank's output, dq, dk, dv, its positions)."""
    from torch.distributed.tensor.experimental import context_parallel

    from labkit.parallel.layout.mesh import Degrees, ParallelDims

    mesh = ParallelDims(Degrees(cp=dist.get_world_size()), q.device.type).submesh("cp")
    bufs = [t.detach().clone() for t in (q, k, v, g)] + [positions.clone()]
    with context_parallel(mesh, buffers=bufs, buffer_seq_dims=[2, 2, 2, 2, 0]):
        ql, kl, vl = (t.clone().requires_grad_() for t in bufs[:3])  # sharded buffers cannot require grad
        out = F.scaled_dot_product_attention(ql, kl, vl, is_causal=True)
        (out * bufs[3]).sum().backward()
        return out.detach(), ql.grad, kl.grad, vl.grad, bufs[4].clone()


def check_against_torch_cp(batch: int = 2, heads: int = 4, seq: int = 256, head_dim: int = 32,
                           dtype: torch.dtype = torch.float32, seed: int = 0) -> dict:
    """On every rank of the default group: causal attention by one process, by :func:`ring_attention`
    (zig-zag) and by PyTorch's ``context_parallel``; the largest deviation of each from one process
    (output and dq, dk, dv on this rank's positions), whether torch chose the zig-zag positions, and
    torch's error where it does not run (then ``torch_err`` is None)."""
    C, r, dev = dist.get_world_size(), dist.get_rank(), comm_device()
    gen = torch.Generator().manual_seed(seed)
    q, k, v, g = (torch.randn(batch, heads, seq, head_dim, generator=gen).to(dev, dtype) for _ in range(4))
    full = [t.clone().requires_grad_() for t in (q, k, v)]
    ref = F.scaled_dot_product_attention(*full, is_causal=True)
    (ref * g).sum().backward()
    want = [ref.detach()] + [t.grad for t in full]

    mine = [zigzag_shard(t, C, r, 2).requires_grad_() for t in (q, k, v)]
    out = ring_attention(*mine, causal=True, layout="zigzag")
    (out * zigzag_shard(g, C, r, 2)).sum().backward()
    got = [out.detach()] + [t.grad for t in mine]
    res = {"ours_err": max((a - zigzag_shard(b, C, r, 2)).abs().max().item() for a, b in zip(got, want)),
           "torch_err": None, "torch_error": None, "same_layout": None, "device": str(dev)}
    try:
        *theirs, pos = _torch_cp(q, k, v, g, torch.arange(seq, device=dev))
    except Exception as e:  # noqa: BLE001 - the report says what torch raised
        res["torch_error"] = f"{type(e).__name__}: {str(e).splitlines()[0]}"
        return res
    res["torch_err"] = max((a - b.index_select(2, pos)).abs().max().item() for a, b in zip(theirs, want))
    res["same_layout"] = bool(torch.equal(pos.cpu(), zigzag_shard(torch.arange(seq), C, r, 0)))
    return res
