"""FP8 training, emulated on any device with torch's float8 dtypes.

Two 8-bit formats (Micikevicius et al. 2022, "FP8 formats for deep learning", arXiv:2209.05433):
**E4M3** (4 exponent, 3 mantissa bits, largest finite 448) for weights and activations, **E5M2**
(largest 57,344, one mantissa bit fewer) for gradients, whose range is wider. A tensor is divided by
a *scale* so that its largest magnitude lands at the format's largest value, cast (torch rounds to
nearest), and multiplied back after the matmul. What the scale is shared over is the recipe:

* ``tensor``: one scale per tensor (torchao's "tensorwise", which torchtitan uses; Transformer
  Engine's per-tensor recipes);
* ``row``: one per row of each GEMM's operands along its contraction, a token's activations or an
  output channel's weights in the forward ("rowwise", torchao's "axiswise" scaling);
* ``block``: DeepSeek-V3's fine-grained scaling (DeepSeek-AI 2024, arXiv:2412.19437, section 3.3.2):
  activations and gradients in 1 x 128 tiles, weights in 128 x 128 blocks, E4M3 everywhere.

A scale can only be applied outside a GEMM's sum if it is constant along the dimension the GEMM
contracts (or, in DeepSeek's kernels, along each 128-long run of it). Each of a linear's three GEMMs
contracts a different dimension, so each quantises its operands along its own: the weight gradient
``g.T @ x`` sums over tokens, and takes ``x`` and ``g`` in 128 x 1 tiles where the forward took
1 x 128 (DeepSeek-V3 section 3.3.3 converts the FP8 activations the same way, from the FP8 copy;
every recipe here re-tiles that copy, where torchao's axiswise recipe quantises the high-precision
activation again, one rounding fewer).
An outlier then only coarsens its own tile. The emulation quantises and dequantises (the values an
FP8 GEMM sees) and multiplies in fp32; :func:`torch._scaled_mm` is the library's FP8 GEMM, and the
tests hold each of the three GEMMs' scales (which scale goes with which rows and columns) against it.
"""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch import Tensor

from labkit.core.checks import one_of

FORMATS = {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}
# recipe -> the scaling tile of each GEMM's two operands (0 spans the whole dimension), as stored:
# forward x [t, k] @ w[n, k].T, input gradient g [t, n] @ w [n, k], weight gradient g.T @ x; and the
# gradients' format. Every tile is constant along the GEMM's contraction (k, n and t in turn).
RECIPES = {
    "tensor": {"forward": ((0, 0), (0, 0)), "input_grad": ((0, 0), (0, 0)), "weight_grad": ((0, 0), (0, 0)),
               "grad_format": "e5m2"},
    "row": {"forward": ((1, 0), (1, 0)), "input_grad": ((1, 0), (0, 1)), "weight_grad": ((0, 1), (0, 1)),
            "grad_format": "e5m2"},
    "block": {"forward": ((1, 128), (128, 128)), "input_grad": ((1, 128), (128, 128)),
              "weight_grad": ((128, 1), (128, 1)), "grad_format": "e4m3"},
}


def _tile(x: Tensor, tile: tuple[int, int]) -> tuple[int, int]:
    return tuple(min(t or n, n) for t, n in zip(tile, x.shape))


def quantize(x: Tensor, fmt: str = "e4m3", tile: tuple[int, int] = (0, 0)) -> tuple[Tensor, Tensor]:
    """``x`` (2-D) in FP8, and the fp32 scales of its tiles (``x ~ q * scale`` tile by tile).

    ``tile``: rows x columns sharing one scale, 0 meaning the whole dimension: (0, 0) per tensor,
    (1, 0) per row, (1, 128) DeepSeek-V3's activation tiles, (128, 128) its weight blocks. Tiles at
    the edges may be smaller (the tensor is padded with zeros, which never set a scale)."""
    dtype = FORMATS[one_of("fmt", fmt, sorted(FORMATS), "formats")]
    if x.dim() != 2:
        raise ValueError(f"quantize takes a 2-D tensor, got shape {tuple(x.shape)}")
    (rows, cols), (r, c) = x.shape, _tile(x, tile)
    R, C = -(-rows // r), -(-cols // c)
    blocks = F.pad(x.float(), (0, C * c - cols, 0, R * r - rows)).reshape(R, r, C, c)
    amax = blocks.abs().amax(dim=(1, 3), keepdim=True).clamp_min(1e-12)
    scale = amax / torch.finfo(dtype).max
    q = (blocks / scale).to(dtype).reshape(R * r, C * c)[:rows, :cols]
    return q, scale.reshape(R, C)


def dequantize(q: Tensor, scale: Tensor, tile: tuple[int, int] = (0, 0)) -> Tensor:
    """``q`` in fp32, each tile times its scale (``tile`` as :func:`quantize` was given it)."""
    (rows, cols), (r, c) = q.shape, _tile(q, tile)
    R, C = scale.shape
    full = F.pad(q.float(), (0, C * c - cols, 0, R * r - rows)).reshape(R, r, C, c)
    return (full * scale[:, None, :, None]).reshape(R * r, C * c)[:rows, :cols]


def fake_quantize(x: Tensor, fmt: str = "e4m3", tile: tuple[int, int] = (0, 0)) -> Tensor:
    """``x`` as an FP8 GEMM sees it: quantised and scaled back, in fp32."""
    return dequantize(*quantize(x, fmt, tile), tile)


def relative_error(x: Tensor, fmt: str = "e4m3", tile: tuple[int, int] = (0, 0)) -> float:
    """``||x - fp8(x)|| / ||x||`` under the format and scaling tile."""
    x2 = x.reshape(-1, x.shape[-1]).float()
    return ((fake_quantize(x2, fmt, tile) - x2).norm() / x2.norm()).item()


class _FP8Matmul(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor, w: Tensor, recipe: str) -> Tensor:
        tx, tw = RECIPES[recipe]["forward"]
        xq, wq = fake_quantize(x, "e4m3", tx), fake_quantize(w, "e4m3", tw)
        ctx.save_for_backward(xq, w)  # the activation as FP8 (on a GPU a quarter of fp32's bytes)
        ctx.recipe = recipe
        return (xq @ wq.t()).to(x.dtype)

    @staticmethod
    def backward(ctx, g: Tensor) -> tuple[Tensor | None, ...]:
        xq, w = ctx.saved_tensors
        r = RECIPES[ctx.recipe]
        (tg, tw), (tg2, tx) = r["input_grad"], r["weight_grad"]
        dx = fake_quantize(g, r["grad_format"], tg) @ fake_quantize(w, "e4m3", tw)
        # the weight gradient re-tiles the forward's FP8 activation along tokens (DeepSeek-V3 3.3.3)
        dw = fake_quantize(g, r["grad_format"], tg2).t() @ fake_quantize(xq, "e4m3", tx)
        return dx.to(g.dtype), dw.to(g.dtype), None


class FP8Linear(nn.Linear):
    """``nn.Linear`` whose three GEMMs (forward, input gradient, weight gradient) see FP8 operands."""

    recipe = "tensor"

    def forward(self, x: Tensor) -> Tensor:
        y = _FP8Matmul.apply(x.reshape(-1, x.shape[-1]), self.weight, self.recipe)
        y = y.reshape(*x.shape[:-1], self.out_features)
        return y if self.bias is None else y + self.bias


def to_fp8(model: nn.Module, recipe: str = "tensor", skip: tuple[str, ...] = ("head", "lm_head")) -> nn.Module:
    """Every ``nn.Linear`` of ``model`` as :class:`FP8Linear` under ``recipe``, in place, except those
    named in ``skip`` (the output layer stays in high precision, as DeepSeek-V3 keeps it; torchtitan's
    ``filter_fqns`` does the same). Weights are not copied: the module's class changes."""
    one_of("recipe", recipe, sorted(RECIPES), "recipes")
    for name, mod in model.named_modules():
        if type(mod) is nn.Linear and name.rsplit(".", 1)[-1] not in skip:
            mod.__class__ = FP8Linear
            mod.recipe = recipe
    return model


def scaled_mm(x: Tensor, w: Tensor) -> Tensor:
    """``x @ w.T`` through the library's FP8 GEMM, ``torch._scaled_mm``, with per-tensor scales."""
    xq, sx = quantize(x, "e4m3")
    wq, sw = quantize(w, "e4m3")
    return torch._scaled_mm(xq, wq.t(), scale_a=sx.reshape(()), scale_b=sw.reshape(()), out_dtype=torch.float32)


def has_fp8_units(device: str) -> bool:
    """Whether ``device`` multiplies FP8 in hardware: NVIDIA's compute capability 8.9 (Ada) and later
    (Hopper, Blackwell) have FP8 tensor cores; a CPU, or an older GPU, emulates the format."""
    return device.startswith("cuda") and torch.cuda.is_available() and torch.cuda.get_device_capability(device) >= (8, 9)


def scaled_mm_runs(device: str) -> bool:
    """Whether :func:`torch._scaled_mm` has a kernel for ``device``: torch's CPU kernel emulates it; on
    CUDA it needs FP8 tensor cores, and on an older GPU (an A100, compute capability 8.0) it raises."""
    return not device.startswith("cuda") or has_fp8_units(device)


def gemm_speed(n: int, device: str = "cpu", dtype: torch.dtype = torch.float32, repeats: int = 5) -> dict:
    """An ``n`` x ``n`` x ``n`` GEMM in ``dtype`` and through :func:`torch._scaled_mm` on E4M3 operands
    (per-tensor scales, the output in ``dtype``, fast accumulation as torchao's forward uses it):
    FLOP/s each, and whether the device has FP8 units. Where ``_scaled_mm`` has no kernel (a GPU
    without FP8 units) the FP8 GEMM is the emulation, the E4M3 operands scaled back up to ``dtype``
    (``"fp8_gemm"`` says which): what FP8 saves there is bytes, not time."""
    from labkit.device.fusion import best_seconds

    g = torch.Generator(device=device).manual_seed(0)
    a, b = (torch.randn(n, n, device=device, dtype=dtype, generator=g) for _ in range(2))
    (aq, sa), (bq, sb) = quantize(a), quantize(b)
    bt, sa, sb = bq.t(), sa.reshape(()), sb.reshape(())  # bq.t(): column-major, as the GEMM wants it
    flops = 2 * n ** 3
    plain = best_seconds(torch.matmul, a, b.t(), repeats=repeats)
    library = scaled_mm_runs(device)
    if library:
        def gemm(*_):
            return torch._scaled_mm(aq, bt, scale_a=sa, scale_b=sb, out_dtype=dtype, use_fast_accum=True)
    else:
        def gemm(*_):
            return (aq.to(dtype) * sa.to(dtype)) @ (bt.to(dtype) * sb.to(dtype))
    fp8 = best_seconds(gemm, a, repeats=repeats)
    return {"n": n, "dtype": str(dtype).removeprefix("torch."), "flops_per_s": flops / plain,
            "fp8_flops_per_s": flops / fp8, "fp8_units": has_fp8_units(device),
            "fp8_gemm": "torch._scaled_mm" if library else f"emulated (E4M3 scaled up to {dtype})"}


def fsdp_bytes_per_step(n_params: float, world: int, gather_bytes: int, grad_bytes: int = 4) -> dict[str, float]:
    """Bytes one rank sends per step under FSDP: the parameters all-gathered for forward and again for
    backward at ``gather_bytes`` per value (2 in bf16; 1 in FP8, torchtitan's float8 all-gather), the
    gradients reduce-scattered at ``grad_bytes``; each a ring's (N - 1) / N of the whole (Rajbhandari
    et al. 2020, section 7). FP8's per-tensor scales add a few bytes, left out."""
    share = (world - 1) / world
    gather, scatter = 2 * gather_bytes * n_params * share, grad_bytes * n_params * share
    return {"all_gather": gather, "reduce_scatter": scatter, "total": gather + scatter}
