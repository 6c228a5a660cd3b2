"""What recomputation buys and costs: bytes kept for backward, FLOPs and time of a step, measured,
and how much larger a batch or a model the memory calculator says then fits.

The policies themselves live in :mod:`labkit.parallel.activation_checkpointing`; the measurement
holds them against Chen et al. 2016 and Korthikanti et al. 2022 (full recomputation adds one
forward pass: about 4/3 of the FLOPs of a step without it).
"""
from __future__ import annotations

import time
from dataclasses import replace

import torch
import torch.nn as nn
from torch.utils.flop_counter import FlopCounterMode

from labkit.memory.calculator import estimate_memory, model_shape
from labkit.memory.probe import saved_activation_bytes

_aten = torch.ops.aten


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

    Saved bytes come from the live-storage count of :mod:`labkit.memory.probe` (it also sees what
    selective checkpointing caches); the peak is CUDA's allocator peak on GPU, the saved figure on
    CPU. FLOPs are forward + backward from ``FlopCounterMode`` (matmuls and attention; element-wise
    ops count zero); time is the median of ``repeats`` after one warm-up step, with the spread
    (max - min) / median, so a reader can tell a difference from noise.
    """
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
    kept free for temporaries, as :func:`labkit.planning.choose.choose_strategy` does.
    """
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
