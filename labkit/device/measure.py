"""A device's roofs measured, and each op of a transformer block timed against its roofline bound.

The roofs: the fastest of a few square matmuls (the compute roof this device reaches, not its
datasheet's) and a streaming copy (bytes read plus bytes written per second). Each op of
:func:`labkit.device.roofline.block_ops` is then run alone, eager, on tensors of its shape, and its
best time set against ``max(FLOPs / compute roof, bytes / bandwidth)``.
"""
from __future__ import annotations

import time
from typing import Callable

import torch
import torch.nn.functional as F

from labkit.device.fusion import best_seconds
from labkit.device.roofline import Op, Roof, attention_ops, block_ops, optimizer_op
from labkit.memory.architecture import ModelShape, linear_layers


def best(fn: Callable[[], object], repeats: int = 5) -> float:
    """The fastest of ``repeats`` calls of ``fn`` (host timing: for CPU work)."""
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def measure_rates(device: str = "cpu", dtype: torch.dtype = torch.float32,
                  sizes: tuple[int, ...] = (256, 512, 1024), copy_bytes: int = 64 << 20) -> dict[str, float]:
    """This process's matmul FLOP/s (the best of ``sizes``) and copy bandwidth (bytes moved per
    second, read plus written), on the threads and the device it has."""
    flops = 0.0
    for n in sizes:
        a, b = torch.randn(n, n, device=device, dtype=dtype), torch.randn(n, n, device=device, dtype=dtype)
        flops = max(flops, 2 * n ** 3 / best_seconds(torch.matmul, a, b, repeats=5))
    n = copy_bytes // 4
    src, dst = torch.randn(n, device=device), torch.empty(n, device=device)
    return {"matmul_flops": flops, "bytes_per_s": 2 * n * 4 / best_seconds(dst.copy_, src, repeats=5)}


def measured_roof(device: str = "cpu", dtype: torch.dtype = torch.float32, **kw) -> Roof:
    r = measure_rates(device, dtype, **kw)
    return Roof(f"this {device.upper()}, measured", r["matmul_flops"], r["bytes_per_s"],
                f"best {dtype} matmul and a streaming copy, timed here")


def _runners(shape: ModelShape, batch: int, seq: int, device: str, dtype: torch.dtype) -> dict[str, Callable]:
    """name -> a zero-argument call running that op on tensors of its shape."""
    T, h, ffn, H, d = batch * seq, shape.hidden, shape.ffn, shape.heads, shape.d_head
    r = lambda *s: torch.randn(*s, device=device, dtype=dtype)  # noqa: E731
    x, x2, w1, b1 = r(T, h), r(T, h), r(h).abs(), r(h)
    q, k, v = r(batch, H, seq, d), r(batch, H, seq, d), r(batch, H, seq, d)
    s = r(batch * H, seq, seq)
    a = r(T, ffn)
    run = {"norm 1": lambda: F.layer_norm(x, (h,), w1, b1), "norm 2": lambda: F.layer_norm(x, (h,), w1, b1),
           "attention": lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True),
           "scores QK^T": lambda: q.reshape(-1, seq, d) @ k.reshape(-1, seq, d).transpose(1, 2),
           "softmax": lambda: torch.softmax(s, -1), "probs @ V": lambda: s @ v.reshape(-1, seq, d),
           "residual 1": lambda: x + x2, "residual 2": lambda: x + x2, "GELU": lambda: F.gelu(a),
           "SwiGLU": lambda: F.silu(a) * a}
    for name, (kk, nn_, _) in linear_layers(shape).items():
        wt, inp = r(nn_, kk), (x if kk == h else a)
        run[name] = (lambda i, w: lambda: F.linear(i, w))(inp, wt)
    return run


def time_block_ops(shape: ModelShape, batch: int, seq: int, roof: Roof, device: str = "cpu",
                   dtype: torch.dtype = torch.float32, repeats: int = 5) -> list[dict]:
    """Every forward op of one block (attention fused and unfused) and AdamW over the block's
    parameters: FLOPs, bytes, intensity, the roofline bound and the measured best time."""
    vb = torch.finfo(dtype).bits // 8
    ops = block_ops(shape, batch, seq, vb, flash=True) + attention_ops(shape, batch, seq, vb, flash=False)
    run = _runners(shape, batch, seq, device, dtype)
    rows = []
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    for op in ops:
        fn = run[op.name]
        rows.append(_row(op, roof, best_seconds(lambda *_: fn(), torch.empty(0, device=device), repeats=repeats)))
    n = sum(k * n_ for k, n_, _ in linear_layers(shape).values())
    p = torch.nn.Parameter(torch.randn(n, device=device))
    p.grad = torch.randn_like(p)
    opt = torch.optim.AdamW([p], lr=1e-3, fused=True)  # one pass, as the bound counts (for-each: several)
    opt.step()  # creates the moments
    sync()
    # the timed AdamW holds an fp32 parameter and writes no low-precision copy, on any device
    rows.append(_row(_fp32_adamw(n), roof, best_seconds(lambda *_: opt.step(), p, repeats=repeats)))
    return rows


def _fp32_adamw(n: int) -> Op:
    """AdamW in fp32 with no low-precision copy: parameter, gradient, two moments read; three written."""
    base = optimizer_op(n)
    return Op(base.name, base.kind, base.flops, 28 * n)


def _row(op: Op, roof: Roof, seconds: float) -> dict:
    bound = roof.time(op)
    return {"name": op.name, "kind": op.kind, "flops": op.flops, "bytes": op.bytes, "intensity": op.intensity,
            "bound": roof.bound(op), "bound_s": bound, "seconds": seconds, "of_roofline": bound / seconds,
            "achieved_flops": op.flops / seconds}
