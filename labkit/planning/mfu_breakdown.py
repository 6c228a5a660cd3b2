"""Why MFU is 40% and not 100%: one step's time split into where it goes.

From the step model's own terms (:func:`labkit.planning.step_model.step_time`), the compute split
further with the roofline (:mod:`labkit.device.roofline`): the matmuls' time at the datasheet peak
and what their achieved efficiency adds; attention; the memory-bound element-wise ops and the
loss's softmax (which do no model FLOPs at all); recomputation; communication the overlap leaves
exposed; the pipeline bubble; the optimizer step. MFU is PaLM's (Chowdhery et al. 2022, appendix
B): model FLOPs per second over the peak.
"""
from __future__ import annotations

from labkit.device.roofline import matmul
from labkit.memory.architecture import ModelShape, linear_layers
from labkit.planning.hardware import Hardware
from labkit.planning.step_model import ROW_PARALLEL, Plan, elementwise_bytes, layer_compute, predict

COMM = ("tensor_parallel", "context_parallel", "expert_parallel", "pipeline_p2p", "fsdp", "data_parallel")
PARTS = ("matmuls at peak", "matmuls below peak", "attention", "memory-bound ops", "recomputation",
         "communication exposed", "pipeline bubble", "optimizer and overheads")


def _matmul_flops(shape: ModelShape, plan: Plan, tokens: float) -> float:
    """One rank's dense matmul FLOPs per micro-batch, forward and backward, its layers and the head."""
    per_layer = sum(matmul(n, tokens, k / (plan.tp if n in ROW_PARALLEL else 1),
                           m / (1 if n in ROW_PARALLEL else plan.tp)).flops * copies
                    for n, (k, m, copies) in linear_layers(shape).items())
    return 3 * (per_layer * shape.n_layer / plan.pp + matmul("head", tokens, shape.hidden, shape.vocab / plan.tp).flops)


def breakdown(shape: ModelShape, plan: Plan, hw: Hardware) -> dict[str, float]:
    """Seconds of one step by :data:`PARTS` (they sum to the step), and ``total``, ``mfu``."""
    if shape.experts > 1:
        raise ValueError("breakdown covers dense models; a mixture of experts routes only part of its matmuls")
    p = predict(shape, plan, hw)
    m, layers = plan.microbatches, shape.n_layer / plan.pp
    tokens = plan.micro_batch * shape.seq_len / plan.cp
    lay = layer_compute(shape, plan, hw)
    elem = layers * 3 * tokens * elementwise_bytes(shape, plan.fused) * plan.value_bytes / 2 / plan.tp
    memory = m * (elem + 24 * tokens * shape.vocab / plan.tp) / hw.bytes_per_s
    attention = m * layers * lay["attention"]
    recompute = m * layers * lay["recompute"]
    matmuls = p["compute"] - attention - memory - recompute
    at_peak = m * _matmul_flops(shape, plan, tokens) / (hw.peak_tflops * 1e12)
    parts = {"matmuls at peak": at_peak, "matmuls below peak": matmuls - at_peak, "attention": attention,
             "memory-bound ops": memory, "recomputation": recompute,
             "communication exposed": sum(p[k] for k in COMM), "pipeline bubble": p["bubble"],
             "optimizer and overheads": p["optimizer"] + p["overhead"]}
    return {**parts, "total": p["total"], "mfu": p["mfu"]}


def examples() -> dict[str, tuple[ModelShape, Plan]]:
    """GPT-2 small, Llama-2 7B and 70B at the layouts torchtitan's and Megatron-LM's recipes use on
    H100s: DDP on 8; FSDP on 8 with torchtitan's selective recomputation, eager element-wise ops;
    TP 8 x PP 4 x DP 4 on 128 (ZeRO-1, as Megatron-LM's distributed optimizer) with full recomputation and 1F1B over 32 micro-batches."""
    gpt2 = ModelShape.from_dims("gpt", 768, 12, 12, 50257, 1024, note="GPT-2 small")
    l7 = ModelShape.from_dims("llama", 4096, 32, 32, 32000, 4096, note="Llama-2 7B")
    l70 = ModelShape.from_dims("llama", 8192, 80, 64, 32000, 4096, kv_heads=8, intermediate=28672, note="Llama-2 70B")
    return {"GPT-2 small, 8 GPUs, DDP": (gpt2, Plan(dp=8, micro_batch=16, global_batch=128, zero=0, fused=False)),
            "Llama-2 7B, 8 GPUs, FSDP": (l7, Plan(dp=8, micro_batch=2, global_batch=16, zero=3, recompute="op",
                                                  fused=False)),
            "Llama-2 70B, 128 GPUs, TP8 PP4 DP4": (l70, Plan(tp=8, pp=4, dp=4, micro_batch=1, global_batch=128,
                                                               zero=1, recompute="full"))}
