"""Placing a model on DP x TP x PP devices: every layout, its memory per device and its bubble.

Narayanan et al. 2021 ("Efficient Large-Scale Language Model Training on GPU Clusters Using
Megatron-LM", section 3) reason about the three degrees together: tensor parallelism inside a node,
pipeline stages across nodes, data parallelism over what is left. :func:`layouts` lists every such
split of ``n_devices`` with the memory calculator's per-device bytes and the 1F1B bubble;
:func:`choose_layout` picks the one that fits with the smallest bubble.
"""
from __future__ import annotations

from dataclasses import dataclass

from labkit.comm.ring import ring_bytes_per_rank
from labkit.core.model import GPTConfig
from labkit.memory.calculator import (
    GB,
    MemoryEstimate,
    ModelShape,
    estimate_memory,
    model_shape,
)
from labkit.parallel.pipeline_timeline import bubble_formula
from labkit.parallel.tensor_parallel import comm_bytes_per_layer
from labkit.planning.accelerators import accelerator, interconnect


@dataclass(frozen=True)
class Layout:
    """One way to place a model on ``tp x pp x dp`` devices, its per-device memory and pipeline bubble."""

    tp: int
    pp: int
    dp: int
    microbatches: int  # per pipeline per step: global batch / (dp x micro batch)
    bubble: float  # (p - 1) / (m + p - 1) of every step
    estimate: MemoryEstimate
    usable_bytes: int

    @property
    def fits(self) -> bool:
        return self.estimate.total <= self.usable_bytes


def layouts(model: str | float | GPTConfig | ModelShape, n_devices: int, global_batch: int,
            micro_batch: int = 1, devices_per_node: int = 8, device_memory_gb: float = 80.0, stage: int = 1,
            recompute: str = "full", headroom: float = 0.1) -> list[Layout]:
    """Every DP x TP x PP layout of ``n_devices`` (Narayanan et al. 2021, section 3) with the memory
    calculator's per-device bytes: tensor parallel within a node (sequence parallel on), 1F1B
    pipelines, ZeRO ``stage`` over the data-parallel ranks (Megatron's distributed optimizer is 1).
    The global batch bounds data parallelism: each of the ``dp`` pipelines needs whole micro-batches.
    """
    shape = model_shape(model)
    if global_batch % micro_batch:
        raise ValueError(f"micro_batch={micro_batch} must divide global_batch={global_batch}")
    out = []
    for tp in (t for t in range(1, devices_per_node + 1) if devices_per_node % t == 0 and shape.heads % t == 0):
        for pp in (p for p in range(1, shape.n_layer + 1) if n_devices % (tp * p) == 0):
            dp = n_devices // (tp * pp)
            if global_batch % (dp * micro_batch) or global_batch // (dp * micro_batch) < pp:
                continue
            m = global_batch // (dp * micro_batch)
            est = estimate_memory(shape, micro_batch, n_devices, stage, "mixed", recompute, tp,
                                  sequence_parallel=tp > 1, device_memory_gb=device_memory_gb, pp=pp)
            out.append(Layout(tp, pp, dp, m, bubble_formula(pp, m), est, int(device_memory_gb * GB * (1 - headroom))))
    return out


def choose_layout(options: list[Layout]) -> Layout | None:
    """The layout that fits with the smallest bubble; ties go to less tensor parallelism (fewer
    all-reduces per layer), then fewer stages. None when nothing fits."""
    fitting = [o for o in options if o.fits]
    return min(fitting, key=lambda o: (round(o.bubble, 6), o.tp, o.pp)) if fitting else None


def tensor_parallel_link_times(model: str | float | GPTConfig | ModelShape, tp: int, micro_batch: int,
                               device: str, mfu: float, links: tuple[str, ...] = ("nvlink4", "ib-ndr")) -> list[dict]:
    """Why tensor parallelism stays inside a node: per layer and rank, the time of its all-reduces over
    each link against the time of the layer's compute at ``mfu`` of ``device``'s bf16 peak.

    Traffic: Megatron-LM's four all-reduces of ``b x s x h`` bf16 activations per layer
    (:func:`labkit.parallel.tensor_parallel.comm_bytes_per_layer`), 2(t-1)/t of it sent per rank.
    Compute: 6 x 12h^2 FLOPs per token per layer (forward and backward over the layer's weights,
    Kaplan et al. 2020), split over ``tp`` ranks.
    """
    shape = model_shape(model)
    payload = comm_bytes_per_layer(micro_batch, shape.seq_len, shape.hidden, dtype_bytes=2)
    sent = ring_bytes_per_rank(payload, tp)
    flops = 72 * micro_batch * shape.seq_len * shape.hidden ** 2 / tp
    compute_ms = flops / (accelerator(device).peak_bf16_tflops * 1e12 * mfu) * 1e3
    rows = []
    for key in links:
        link = interconnect(key)
        comm_ms = sent / (link.gb_per_s * 1e9) * 1e3
        rows.append(dict(link=link.name, GB_per_s=link.gb_per_s, comm_ms=comm_ms, compute_ms=compute_ms,
                         ratio=comm_ms / compute_ms, bytes_per_rank=sent))
    return rows
