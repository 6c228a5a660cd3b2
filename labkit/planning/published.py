"""Published training runs whose layout, model, hardware and batch are public, and what they measured.

The step-time model (:mod:`labkit.planning.step_model`) is held against these, each run's own layout
fed in. What each source measured, in its own units and FLOP convention:

* **Megatron-LM** (Narayanan et al. 2021, Table 1): GPT models of 1.7B to 1T parameters on up to 3,072
  A100s of NVIDIA's Selene, sequence 2048, vocabulary 51,200, achieved TFLOP/s per GPU counted by their
  equation 3, ``96 B s l h^2 (1 + s/6h + V/16lh)`` per iteration, which counts the recomputed forward.
  Not in the table, assumed here: micro-batch 1, the 1F1B schedule, full recomputation (section 5.1),
  no FlashAttention (2021), fp32 gradients all-reduced after the backward, not overlapped.
* **Llama 3 405B** (Dubey et al. 2024, Table 4): H100s, TP 8 x CP x PP 16 x DP, 16M tokens per step,
  TFLOP/s per GPU (BF16 MFU). The FLOP convention is not stated; PaLM's is used (Chowdhery et al.
  2022, appendix B). The 128k-token row lists DP 4, yet 16,384 GPUs and 16M tokens per step need DP 8:
  8 is used. Assumed: micro-batch 1, the interleaved schedule with 2 chunks per rank (section 3.3.2),
  no recomputation, and FSDP that shards optimizer states and gradients (section 3.3.2), its gradients
  reduce-scattered once a step after the last micro-batch, as a pipeline accumulates them: the
  communication of ZeRO-1 (``zero=1``), not DeepSpeed's ZeRO-2, which reduces every micro-batch's.
* **torchtitan** (Liang et al. 2025; ``docs/performance.md``): Llama 3.1 8B, FSDP2 on 8 and 128 H100s
  (96 GB HBM2e, 500 W: slower than the SXM datasheet the model uses, by an amount the doc says it does
  not know), local batch 2, sequence 8192, its selective "op" recomputation, eager (the rows without
  ``torch.compile``), tokens per second per GPU, bf16 rows only (the Float8 rows use another peak). And an earlier page of the same doc: Llama 3 8B and 70B
  and Llama 2 13B on 64 A100s with FSDP2 (the network is not stated: InfiniBand HDR is assumed).

Peak memory is published by torchtitan alone (Tables 1 and 3, the FSDP rows): its logger's
``max_reserved`` (``torch.cuda.max_memory_reserved``), what the caching allocator held at its fullest,
which is more than the tensors alive at any moment (:func:`peak_memory` predicts those).
"""
from __future__ import annotations

import statistics
from dataclasses import dataclass, replace

from labkit.memory.architecture import MODELS, ModelShape
from labkit.memory.calculator import estimate_memory
from labkit.planning.hardware import HARDWARE, Hardware
from labkit.planning.step_model import Plan, model_flops_per_token, predict


@dataclass(frozen=True)
class Run:
    name: str
    source: str
    shape: ModelShape
    device: str
    plan: Plan
    unit: str  # "tflops" (per GPU, in the source's convention) or "tokens" (per second per GPU)
    measured: float
    convention: str = "palm"  # how the source counts FLOPs: "megatron" (eq. 3) or "palm"


def _gpt(n_b: float, heads: int, hidden: int, layers: int) -> ModelShape:
    return ModelShape.from_dims("gpt", hidden, layers, heads, 51200, 2048, note=f"{n_b}B, Narayanan et al. 2021")


def _llama(hidden, layers, heads, kv, ffn, vocab, seq, note):
    return ModelShape.from_dims("llama", hidden, layers, heads, vocab, seq, kv, ffn, note=note)


_MEGATRON = [  # billions, heads, hidden, layers, TP, PP, GPUs, batch, TFLOP/s per GPU (Table 1)
    (1.7, 24, 2304, 24, 1, 1, 32, 512, 137), (3.6, 32, 3072, 30, 2, 1, 64, 512, 138),
    (7.5, 32, 4096, 36, 4, 1, 128, 512, 142), (18.4, 48, 6144, 40, 8, 1, 256, 1024, 135),
    (39.1, 64, 8192, 48, 8, 2, 512, 1536, 138), (76.1, 80, 10240, 60, 8, 4, 1024, 1792, 140),
    (145.6, 96, 12288, 80, 8, 8, 1536, 2304, 148), (310.1, 128, 16384, 96, 8, 16, 1920, 2160, 155),
    (529.6, 128, 20480, 105, 8, 35, 2520, 2520, 163), (1008.0, 160, 25600, 128, 8, 64, 3072, 3072, 163),
]
MEGATRON_2021 = "Narayanan et al. 2021, Table 1"
LLAMA3 = "Dubey et al. 2024 (The Llama 3 Herd of Models), Table 4"
TITAN_H100 = "torchtitan docs/performance.md (Dec 2024), Tables 1 and 3"
TITAN_A100 = "torchtitan docs/performance.md (mid 2024), 64 A100s"


def runs() -> list[Run]:
    out = []
    for n_b, a, h, L, tp, pp, gpus, batch, tflops in _MEGATRON:
        plan = Plan(tp=tp, pp=pp, dp=gpus // (tp * pp), global_batch=batch, zero=0, recompute="full",
                    flash=False, dp_overlap=False)
        out.append(Run(f"GPT {n_b}B", MEGATRON_2021, _gpt(n_b, a, h, L), "a100-80gb", plan, "tflops", tflops,
                       "megatron"))
    l405 = {s: replace(MODELS["llama3-405b"], seq_len=s) for s in (8192, 131072)}
    for gpus, cp, dp, seq, per_dp, tflops in ((8192, 1, 64, 8192, 32, 430), (16384, 1, 128, 8192, 16, 400),
                                              (16384, 16, 8, 131072, 16, 380)):
        plan = Plan(tp=8, pp=16, cp=cp, dp=dp, global_batch=per_dp * dp, zero=1, schedule="interleaved", chunks=2)
        out.append(Run(f"Llama 3 405B, {gpus:,} GPUs, {seq // 1024}k", LLAMA3, l405[seq], "h100-80gb", plan,
                       "tflops", tflops))
    l8 = MODELS["llama3-8b"]
    for gpus, tps in ((8, 5762), (128, 5605)):
        plan = Plan(dp=gpus, micro_batch=2, global_batch=2 * gpus, zero=3, recompute="op", fused=False)
        out.append(Run(f"Llama 3.1 8B, FSDP {gpus}", TITAN_H100, l8, "h100-80gb", plan, "tokens", tps))
    l70 = MODELS["llama3-70b"]
    l2_13 = _llama(5120, 40, 40, 40, 13824, 32000, 4096, "Llama 2 13B")
    for name, shape, b, rec, tps in (("Llama 3 8B", l8, 1, "op", 2973), ("Llama 3 70B", l70, 1, "full", 331),
                                     ("Llama 2 13B", l2_13, 2, "none", 2162)):
        plan = Plan(dp=64, micro_batch=b, global_batch=64 * b, zero=3, recompute=rec, fused=False)
        out.append(Run(f"{name}, FSDP 64", TITAN_A100, shape, "a100-80gb", plan, "tokens", tps))
    return out


def megatron_flops(shape: ModelShape, sequences: int) -> float:
    """Narayanan et al. 2021, equation 3: FLOPs of one iteration with full recomputation."""
    B, s, l, h, V = sequences, shape.seq_len, shape.n_layer, shape.hidden, shape.vocab
    return 96 * B * s * l * h * h * (1 + s / (6 * h) + V / (16 * l * h))


def predicted(run: Run, hw: Hardware | None = None) -> dict:
    """The model's prediction for ``run`` in the unit the source measured, and the parts of its step."""
    hw = hw or HARDWARE[run.device]
    p = predict(run.shape, run.plan, hw)
    if run.unit == "tokens":
        value = p["tokens_per_s_per_device"]
    elif run.convention == "megatron":
        value = megatron_flops(run.shape, run.plan.global_batch) / p["total"] / run.plan.devices / 1e12
    else:
        value = p["tokens_per_s_per_device"] * model_flops_per_token(run.shape) / 1e12
    return {"value": value, "parts": p}


def compare() -> list[dict]:
    """One row per published run: measured, predicted, relative error, the predicted MFU."""
    rows = []
    for r in runs():
        pred = predicted(r)
        rows.append(dict(run=r.name, source=r.source, device=r.device, devices=r.plan.devices, unit=r.unit,
                         measured=r.measured, predicted=pred["value"],
                         error=(pred["value"] - r.measured) / r.measured, mfu=pred["parts"]["mfu"],
                         step_s=pred["parts"]["total"]))
    return rows


def median_abs_error(rows: list[dict]) -> float:
    return statistics.median(abs(r["error"]) for r in rows)


@dataclass(frozen=True)
class MemoryRun:
    name: str
    source: str
    shape: ModelShape
    devices: int  # FSDP ranks (ZeRO-3 over all of them)
    micro_batch: int
    recompute: str
    measured_gib: float  # torchtitan's max_reserved, GiB


def memory_runs() -> list[MemoryRun]:
    l8 = MODELS["llama3-8b"]
    return [MemoryRun(f"Llama 3.1 8B, FSDP {n}", TITAN_H100, l8, n, 2, "op", gib) for n, gib in ((8, 82.4), (128, 67.0))]


def peak_memory(shape: ModelShape, devices: int, micro_batch: int, recompute: str) -> dict[str, float]:
    """Bytes alive at a FSDP2 run's peak, by part, on one of ``devices`` ranks: the calculator's model
    states (ZeRO-3), kept activations and head (:func:`labkit.memory.estimate_memory`), and what the
    calculator does not keep because it is transient, at the start of the backward:

    * the loss's gradients: an fp32 loss over the vocabulary (torchtitan upcasts the logits) keeps
      its log-softmax (in the calculator's head); backward then holds the loss's gradient with
      respect to it and to its input beside it, ``2 x 4`` bytes per logit;
    * FSDP2's gathered parameters (Zhao et al. 2023): two blocks in bf16 (one prefetched), and the
      output layer's weight with its bf16 gradient before the reduce-scatter."""
    est = estimate_memory(shape, micro_batch, devices, 3, "mixed", recompute, device_memory_gb=1e6)
    logits = micro_batch * shape.seq_len * shape.vocab
    output_layer = shape.vocab * shape.hidden
    block = (shape.n_params - 2 * output_layer) / shape.n_layer
    parts = {"model states": est.params + est.grads + est.optimizer, "activations": est.activations,
             "head (kept)": est.head, "loss gradients": 8 * logits, "FSDP gathered": 2 * 2 * block + 2 * 2 * output_layer}
    return {**parts, "total": sum(parts.values())}


def compare_memory() -> list[dict]:
    """One row per run that published its peak memory: predicted (GiB), measured, relative error."""
    rows = []
    for r in memory_runs():
        parts = peak_memory(r.shape, r.devices, r.micro_batch, r.recompute)
        gib = parts["total"] / 2 ** 30
        rows.append(dict(run=r.name, source=r.source, devices=r.devices, recompute=r.recompute,
                         measured_gib=r.measured_gib, predicted_gib=gib, error=gib / r.measured_gib - 1,
                         parts_gib={k: v / 2 ** 30 for k, v in parts.items()}))
    return rows
