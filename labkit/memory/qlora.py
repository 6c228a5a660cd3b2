"""QLoRA: LoRA adapters over a frozen base stored in 4-bit NormalFloat with double quantisation.

Dettmers et al. 2023, "QLoRA: Efficient Finetuning of Quantized LLMs" (arXiv:2305.14314):

* **NF4**: each block of 64 weights is scaled by its absolute maximum into [-1, 1] and every value
  becomes the index (4 bits, two per byte) of the nearest of 16 levels, quantiles of a normal
  distribution (:data:`NF4_LEVELS`, the paper's Appendix E), so a normally distributed weight
  fills each level about equally.
* **Double quantisation**: the fp32 absmax of each block (32/64 = 0.5 bits per weight) is itself
  quantised, minus its mean, to 8 bits in blocks of 256 with one fp32 constant per block:
  8/64 + 32/(64 * 256) = 0.127 bits per weight, so ``4.127 / 8 = 0.5159`` bytes per weight in all
  (:func:`expected_nf4_bytes`).
* **Compute in bf16**: a layer dequantises its weight to bf16 for each matmul; only the bf16 LoRA
  adapters (:mod:`labkit.memory.lora`) train. Gradients flow through the frozen 4-bit base.

The storage is bitsandbytes' (``Linear4bit``, ``quant_type="nf4"``, ``compress_statistics=True``),
the QLoRA authors' library, which ``peft`` adapts with its own 4-bit LoRA layer. It runs on CPU:
its wheel carries a CPU library and PyTorch fallbacks (an optional faster CPU matmul it would fetch
through the ``kernels`` package is not needed). On a CPU with AVX512-BF16, a ``Linear4bit`` called
in eval mode on an input that needs no gradient repacks itself for a CPU kernel and undoes the
double quantisation (a 16/32-bit absmax per block again): measure storage in train mode.
"""
from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.nn as nn

from labkit.core.checks import one_of, positive_int
from labkit.memory.lora import DEFAULT_TARGETS, replace_module, apply_lora, target_linears

# The 16 NF4 levels, QLoRA Appendix E (the same table as bitsandbytes' ``get_4bit_type("nf4")``)
NF4_LEVELS: tuple[float, ...] = (
    -1.0, -0.6961928009986877, -0.5250730514526367, -0.39491748809814453, -0.28444138169288635,
    -0.18477343022823334, -0.09105003625154495, 0.0, 0.07958029955625534, 0.16093020141124725,
    0.24611230194568634, 0.33791524171829224, 0.44070982933044434, 0.5626170039176941,
    0.7229568362236023, 1.0,
)
NESTED_BLOCKSIZE = 256  # bitsandbytes' (and the paper's) block of 8-bit quantised absmax values
BLOCKSIZES = (32, 64, 128, 256, 512, 1024, 2048, 4096)


def nf4_linear(linear: nn.Linear, blocksize: int = 64, double_quant: bool = True,
               compute_dtype: torch.dtype = torch.bfloat16) -> nn.Module:
    """A frozen bitsandbytes ``Linear4bit`` holding ``linear``'s weight in NF4 (bias in ``compute_dtype``).

    The weight is cast to ``compute_dtype`` before quantising, so dequantisation gives that dtype.
    """
    import bitsandbytes as bnb

    one_of("blocksize", blocksize, BLOCKSIZES)
    q = bnb.nn.Linear4bit(linear.in_features, linear.out_features, bias=linear.bias is not None,
                          compute_dtype=compute_dtype, compress_statistics=double_quant,
                          quant_type="nf4", device="meta")
    q.weight = bnb.nn.Params4bit(linear.weight.detach().to(compute_dtype).cpu(), requires_grad=False,
                                 compress_statistics=double_quant, quant_type="nf4", blocksize=blocksize)
    if linear.bias is not None:
        q.bias = nn.Parameter(linear.bias.detach().to(compute_dtype).clone(), requires_grad=False)
    return q.to(linear.weight.device)  # Params4bit quantises on its first move to a real device


def quantize_nf4(model: nn.Module, targets: Iterable[str] = DEFAULT_TARGETS, blocksize: int = 64,
                 double_quant: bool = True, compute_dtype: torch.dtype = torch.bfloat16) -> nn.Module:
    """Store the targeted linears of ``model`` in NF4 and the rest in ``compute_dtype``; all frozen.

    Works in place and returns ``model``. The targeted weights are quantised from ``compute_dtype``.
    """
    names = target_linears(model, targets)
    model.requires_grad_(False)
    for name in names:
        replace_module(model, name, nf4_linear(model.get_submodule(name), blocksize, double_quant, compute_dtype))
    quantised = {id(model.get_submodule(n)) for n in names}
    for m in model.modules():  # everything else (embeddings, LayerNorms, the head) in compute_dtype
        if id(m) not in quantised:
            for p in m.parameters(recurse=False):
                p.data = p.data.to(compute_dtype)
    return model


def qlora(model: nn.Module, r: int = 8, alpha: float = 16.0, dropout: float = 0.0,
          targets: Iterable[str] = DEFAULT_TARGETS, blocksize: int = 64,
          compute_dtype: torch.dtype = torch.bfloat16) -> nn.Module:
    """QLoRA from the pieces: :func:`quantize_nf4` the base, then LoRA adapters in ``compute_dtype``."""
    quantize_nf4(model, targets, blocksize, True, compute_dtype)
    return apply_lora(model, r, alpha, dropout, targets, dtype=compute_dtype)


def nf4_roundtrip(w: torch.Tensor, blocksize: int = 64, double_quant: bool = True) -> torch.Tensor:
    """``w`` quantised to NF4 and back (bitsandbytes), in ``w``'s dtype: to see what 4 bits cost."""
    from bitsandbytes.functional import dequantize_4bit, quantize_4bit

    one_of("blocksize", blocksize, BLOCKSIZES)
    packed, state = quantize_4bit(w.detach(), blocksize=blocksize, compress_statistics=double_quant,
                                  quant_type="nf4")
    return dequantize_4bit(packed, state)


def expected_nf4_bytes(numel: int, blocksize: int = 64, double_quant: bool = True) -> dict[str, int]:
    """Exact bytes bitsandbytes stores for ``numel`` NF4 weights, by part (lookup tables aside).

    ``packed`` two 4-bit codes per byte; ``absmax`` one per block of ``blocksize``: 1 byte (8-bit)
    with double quantisation, else 4 (fp32); then per 256 absmax one fp32 constant (``nested_absmax``)
    and one fp32 mean for the whole tensor (``offset``).
    """
    positive_int("numel", numel)
    blocks = -(-numel // blocksize)
    parts = {"packed": -(-numel // 2), "absmax": blocks * (1 if double_quant else 4),
             "nested_absmax": 4 * -(-blocks // NESTED_BLOCKSIZE) if double_quant else 0,
             "offset": 4 if double_quant else 0}
    return {**parts, "total": sum(parts.values())}


def nf4_bytes(module: nn.Module) -> dict[str, int]:
    """Bytes a ``Linear4bit``'s weight holds now, keyed as :func:`expected_nf4_bytes`, plus ``tables``.

    ``tables`` are the lookup tables (16 fp32 NF4 levels, 256 fp32 8-bit levels), fixed in size
    whatever the layer; ``total`` leaves them out, as the per-weight formula does.
    """
    w = module.weight
    s = w.quant_state
    nested = bool(s.nested)
    parts = {"packed": w.untyped_storage().nbytes(), "absmax": s.absmax.untyped_storage().nbytes(),
             "nested_absmax": s.state2.absmax.untyped_storage().nbytes() if nested else 0,
             "offset": s.offset.untyped_storage().nbytes() if nested else 0}
    tables = s.code.untyped_storage().nbytes() + (s.state2.code.untyped_storage().nbytes() if nested else 0)
    return {**parts, "total": sum(parts.values()), "tables": tables}


def quant_state_tensors(model: nn.Module) -> list[torch.Tensor]:
    """The quantisation constants of every 4-bit weight of ``model``: tensors ``parameters()`` misses."""
    out = []
    for m in model.modules():
        s = getattr(getattr(m, "weight", None), "quant_state", None)
        if s is not None:
            out += [s.absmax, s.code]
            if s.nested:
                out += [s.state2.absmax, s.state2.code, s.offset]
    return out
