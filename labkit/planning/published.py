"""Published training runs whose layout, model, hardware and batch are public, and what they measured.

The step-time model (:mod:`labkit.planning.step_model`) is held against these, each run's own layout
fed in; its memory model (:mod:`labkit.planning.stage_memory`) against the peaks torchtitan logged.
What each source measured, in its own units and FLOP convention, and what is assumed where it is
silent (each row's ``note`` says it too):

* **Megatron-LM 2021** (Narayanan et al. 2021, Table 1): GPT models of 1.7B to 1T parameters on up
  to 3,072 A100s of NVIDIA's Selene, sequence 2048, vocabulary 51,200, TFLOP/s per GPU by their
  equation 3, ``96 B s l h^2 (1 + s/6h + V/16lh)`` an iteration, which counts the recomputed forward.
  Assumed: micro-batch 1, 1F1B, full recomputation (section 5.1), no FlashAttention (2021), fp32
  gradients all-reduced after the backward, not overlapped.
* **Megatron-LM 2022** (Korthikanti et al. 2022, Tables 3 and 5): 22B to 1T on 8 to 512 A100s, TP 8,
  no data parallelism, the interleaved schedule with 3 chunks for 175B and 530B; iteration times
  with full recomputation (TP alone) and with sequence parallelism and selective recomputation of
  the attention core, in TFLOP/s per GPU by their appendix A, ``72 B L s h^2 (1 + s/6h + V/12hL)``.
* **Llama 3 405B** (Dubey et al. 2024, Table 4): H100 SXM (700 W, 80 GB HBM3), TP 8 x CP x PP 16 x DP,
  16M tokens a step, TFLOP/s per GPU; PaLM's convention (Chowdhery et al. 2022, appendix B) assumed.
  The 128k row prints DP 4 in some copies, 8 in others: 16,384 GPUs and 16M tokens need 8. From
  section 3.3.2: no activation checkpointing at 8K, one layer fewer on the first and last stage and
  "the first model chunk on the first stage has only the embedding" (so chunks of one layer: 8 per
  rank), FSDP that does not reshard after forward, CP by all-gathering K and V. Assumed: micro-batch 1.
* **torchtitan** (``benchmarks/llama3_h100_202412_torchtitan.md``, once ``docs/performance.md``, and
  its asyncTP page): Meta's Grand Teton H100s, "96GB HBM2e with 2.4 TB/sec", "the default 500W power
  limit", a peak "between SXM and NVL ... we don't know its exact value": the model takes the NVL's
  835 TFLOP/s (:data:`TITAN_H100_CARD`). Llama 3.1 8B, FSDP2 on 8 and 128, eager, the "op" policy;
  70B, FSDP 32 x TP 8 on 256, compiled, full recomputation, vanilla TP, bf16. Sequence 8192 from the
  configs of the day. Tokens per second per GPU. The Float8 rows are left out (the model has no FP8
  GEMMs), and so is the Aug 2024 405B row (FSDP 16 x TP 8), which the Dec 2024 page replaced. And 64
  A100s with FSDP2 (mid 2024), HDR assumed.
* **NVIDIA's DGX H100 benchmarks** (``NVIDIA/dgxc-benchmarking``, tag v25.04, ``llama3.1/README.md``):
  Llama 3.1 70B (TP 4 x PP 4 x CP 2, 5 chunks a rank) on 64 H100s and 405B (TP 8 x PP 8 x CP 2, 8
  chunks) on 512, BF16, micro-batch 1, 64 micro-batches, sequence 8192, their MFU of 54.32% and
  55.47% (of 989 TFLOP/s, attention counted whole, as PaLM). Assumed: Megatron-Core's distributed
  optimizer (ZeRO-1), no recomputation, 405B's stages split with the embedding and output counted as
  a layer each (126 + 2 layers in 64 chunks).
* **Megatron-Core MoE** (``megatron/core/transformer/moe/README.md``, v0.9): Mixtral 8x7B, bf16,
  dropless, 468 TFLOP/s per GPU on its reference mapping, 64 H100s, TP 1 x EP 8 x PP 4 with 8
  chunks a rank, global batch 256 of 4096. The README states the figure and the mapping apart.
  Assumed: the distributed optimizer (ZeRO-1), no recomputation.

Not here: DeepSeek-V3 (its MLA attention, shared experts, FP8 GEMMs and DualPipe's overlap are beyond
this model), MegaScale (its rows mix in model changes), the NeMo tables (FP8).
"""
from __future__ import annotations

import statistics
from dataclasses import dataclass, replace

from labkit.memory.architecture import MODELS, ModelShape
from labkit.planning.hardware import HARDWARE, Hardware
from labkit.planning.stage_memory import peak_rank
from labkit.planning.step_model import Plan, model_flops_per_token, predict

# Grand Teton's H100: SXM, 96 GB HBM2e at 2.4 TB/s, capped at 500 W; its peak "between SXM and NVL"
TITAN_H100_CARD = replace(HARDWARE["h100-80gb"], name="NVIDIA H100 SXM 96GB HBM2e, 500 W", peak_tflops=835.0,
                          hbm_gb_per_s=2400.0, source="torchtitan benchmarks (Dec 2024): 2.4 TB/s HBM2e, 500 W; "
                          "peak between SXM (989) and NVL (835) TFLOP/s, NVL's taken")
CARDS = {**HARDWARE, "h100-titan": TITAN_H100_CARD}


@dataclass(frozen=True)
class Run:
    name: str
    source: str
    shape: ModelShape
    device: str  # a key of CARDS
    plan: Plan
    unit: str  # "tflops" (per GPU, in the source's convention) or "tokens" (per second per GPU)
    measured: float
    convention: str = "palm"  # how the source counts FLOPs: "megatron" (eq. 3), "korthikanti" or "palm"


def _gpt(n_b: float, heads: int, hidden: int, layers: int, note: str = "Narayanan et al. 2021") -> ModelShape:
    return ModelShape.from_dims("gpt", hidden, layers, heads, 51200, 2048, note=f"{n_b}B, {note}")


def _llama(hidden, layers, heads, kv, ffn, vocab, seq, note):
    return ModelShape.from_dims("llama", hidden, layers, heads, vocab, seq, kv, ffn, note=note)


_MEGATRON = [  # billions, heads, hidden, layers, TP, PP, GPUs, batch, TFLOP/s per GPU (Table 1)
    (1.7, 24, 2304, 24, 1, 1, 32, 512, 137), (3.6, 32, 3072, 30, 2, 1, 64, 512, 138),
    (7.5, 32, 4096, 36, 4, 1, 128, 512, 142), (18.4, 48, 6144, 40, 8, 1, 256, 1024, 135),
    (39.1, 64, 8192, 48, 8, 2, 512, 1536, 138), (76.1, 80, 10240, 60, 8, 4, 1024, 1792, 140),
    (145.6, 96, 12288, 80, 8, 8, 1536, 2304, 148), (310.1, 128, 16384, 96, 8, 16, 1920, 2160, 155),
    (529.6, 128, 20480, 105, 8, 35, 2520, 2520, 163), (1008.0, 160, 25600, 128, 8, 64, 3072, 3072, 163),
]
# Korthikanti et al. 2022: name, heads, hidden, layers, PP, chunks, GPUs = batch, micro-batch, seconds an
# iteration with full recomputation (TP alone) and with sequence parallelism + selective (Tables 3, 5)
_KORTHIKANTI = [("22B", 64, 6144, 48, 1, 1, 8, 4, 4, 1.42, 1.10), ("175B", 96, 12288, 96, 8, 3, 64, 64, 1, 18.13, 13.75),
                ("530B", 128, 20480, 105, 35, 3, 280, 280, 1, 49.05, 37.83),
                ("1T", 160, 25600, 128, 64, 1, 512, 512, 1, 94.42, 71.49)]
MEGATRON_2021 = "Narayanan et al. 2021, Table 1"
MEGATRON_2022 = "Korthikanti et al. 2022, Tables 3 and 5"
LLAMA3 = "Dubey et al. 2024 (The Llama 3 Herd of Models), Table 4"
TITAN_H100 = "torchtitan benchmarks, Grand Teton H100 (Dec 2024; 405B: Aug 2024; 70B: asyncTP page)"
TITAN_A100 = "torchtitan docs/performance.md (mid 2024), 64 A100s"
MCORE_MOE = "Megatron-Core MoE README (v0.9)"
DGXC = "NVIDIA dgxc-benchmarking v25.04, llama3.1 (NeMo 25.02), BF16"


def korthikanti_flops(shape: ModelShape, sequences: int) -> float:
    """Korthikanti et al. 2022, appendix A: model FLOPs of one iteration, ``72 B L s h^2 (1 + s/6h + V/12hL)``."""
    B, s, L, h, V = sequences, shape.seq_len, shape.n_layer, shape.hidden, shape.vocab
    return 72 * B * L * s * h * h * (1 + s / (6 * h) + V / (12 * h * L))


def runs() -> list[Run]:
    out = []
    for n_b, a, h, L, tp, pp, gpus, batch, tflops in _MEGATRON:
        plan = Plan(tp=tp, pp=pp, dp=gpus // (tp * pp), global_batch=batch, zero=0, recompute="full",
                    flash=False, dp_overlap=False, sequence_parallel=False)
        out.append(Run(f"GPT {n_b}B", MEGATRON_2021, _gpt(n_b, a, h, L), "a100-80gb", plan, "tflops", tflops,
                       "megatron"))
    for name, a, h, L, pp, v, gpus, batch, mb, full_s, sel_s in _KORTHIKANTI:
        shape = _gpt(name, a, h, L, "Korthikanti et al. 2022")
        for label, rec, sp, seconds in (("full recompute", "full", False, full_s), ("SP + selective", "selective", True,
                                                                                    sel_s)):
            plan = Plan(tp=8, pp=pp, dp=1, micro_batch=mb, global_batch=batch, zero=0, recompute=rec, flash=False,
                        schedule="interleaved" if v > 1 else "1f1b", chunks=v, sequence_parallel=sp)
            out.append(Run(f"GPT {name}, {label}", MEGATRON_2022, shape, "a100-80gb", plan, "tflops",
                           korthikanti_flops(shape, batch) / seconds / gpus / 1e12, "korthikanti"))
    l405 = {s: replace(MODELS["llama3-405b"], seq_len=s) for s in (8192, 131072)}
    for gpus, cp, dp, seq, per_dp, tflops in ((8192, 1, 64, 8192, 32, 430), (16384, 1, 128, 8192, 16, 400),
                                              (16384, 16, 8, 131072, 16, 380)):
        plan = Plan(tp=8, pp=16, cp=cp, dp=dp, global_batch=per_dp * dp, zero=3, schedule="interleaved", chunks=8,
                    first_less=1, last_less=1, cp_impl="allgather")
        out.append(Run(f"Llama 3 405B, {gpus:,} GPUs, {seq // 1024}k", LLAMA3, l405[seq], "h100-80gb", plan,
                       "tflops", tflops))
    l8, l70 = MODELS["llama3-8b"], MODELS["llama3-70b"]
    for gpus, tps in ((8, 5762), (128, 5605)):
        plan = Plan(dp=gpus, micro_batch=2, global_batch=2 * gpus, zero=3, recompute="op", fused=False)
        out.append(Run(f"Llama 3.1 8B, FSDP {gpus}", TITAN_H100, l8, "h100-titan", plan, "tokens", tps))
    plan = Plan(tp=8, dp=32, micro_batch=16, global_batch=512, zero=3, recompute="full")
    out.append(Run("Llama 3.1 70B, FSDP 32 x TP 8", TITAN_H100, l70, "h100-titan", plan, "tokens", 597.3))
    l2_13 = _llama(5120, 40, 40, 40, 13824, 32000, 4096, "Llama 2 13B")
    for name, shape, b, rec, tps in (("Llama 3 8B", l8, 1, "op", 2973), ("Llama 3 70B", l70, 1, "full", 331),
                                     ("Llama 2 13B", l2_13, 2, "none", 2162)):
        plan = Plan(dp=64, micro_batch=b, global_batch=64 * b, zero=3, recompute=rec, fused=False)
        out.append(Run(f"{name}, FSDP 64", TITAN_A100, shape, "a100-80gb", plan, "tokens", tps))
    for name, shape, tp, pp, v, edge, gpus, batch, tflops in (
            ("Llama 3.1 70B, TP 4 x PP 4 x CP 2", l70, 4, 4, 5, 0, 64, 128, 989 * 0.5432),
            ("Llama 3.1 405B, TP 8 x PP 8 x CP 2", MODELS["llama3-405b"], 8, 8, 8, 1, 512, 256, 989 * 0.5547)):
        plan = Plan(tp=tp, pp=pp, cp=2, dp=gpus // (tp * pp * 2), global_batch=batch, zero=1, schedule="interleaved",
                    chunks=v, first_less=edge, last_less=edge)
        out.append(Run(name, DGXC, shape, "h100-80gb", plan, "tflops", tflops))
    mixtral = replace(MODELS["mixtral-8x7b"], seq_len=4096)
    plan = Plan(pp=4, dp=16, ep=8, global_batch=256, zero=1, schedule="interleaved", chunks=8)
    out.append(Run("Mixtral 8x7B, EP 8 x PP 4", MCORE_MOE, mixtral, "h100-80gb", plan, "tflops", 468))
    return out


def megatron_flops(shape: ModelShape, sequences: int) -> float:
    """Narayanan et al. 2021, equation 3: FLOPs of one iteration with full recomputation."""
    B, s, l, h, V = sequences, shape.seq_len, shape.n_layer, shape.hidden, shape.vocab
    return 96 * B * s * l * h * h * (1 + s / (6 * h) + V / (16 * l * h))


_CONVENTIONS = {"megatron": megatron_flops, "korthikanti": korthikanti_flops}


def predicted(run: Run, hw: Hardware | None = None) -> dict:
    """The model's prediction for ``run`` in the unit the source measured, and the parts of its step."""
    hw = hw or CARDS[run.device]
    p = predict(run.shape, run.plan, hw)
    if run.unit == "tokens":
        value = p["tokens_per_s_per_device"]
    elif run.convention in _CONVENTIONS:
        value = _CONVENTIONS[run.convention](run.shape, run.plan.global_batch) / p["total"] / run.plan.devices / 1e12
    else:
        value = p["tokens_per_s_per_device"] * model_flops_per_token(run.shape) / 1e12
    return {"value": value, "parts": p}


def kind(plan: Plan) -> str:
    """What a layout combines, for comparing like with like: ``"TP + PP + FSDP"``, ``"DP"``..."""
    dims = [d for d, on in (("TP", plan.tp > 1), ("PP", plan.pp > 1), ("CP", plan.cp > 1), ("EP", plan.ep > 1),
                            ("FSDP", plan.zero == 3 and plan.dp > 1)) if on]
    return " + ".join(dims) or "DP"


def compare() -> list[dict]:
    """One row per published run: measured, predicted, relative error, the predicted MFU."""
    rows = []
    for r in runs():
        pred = predicted(r)
        rows.append(dict(run=r.name, source=r.source, device=r.device, devices=r.plan.devices, unit=r.unit,
                         measured=r.measured, predicted=pred["value"], kind=kind(r.plan),
                         error=(pred["value"] - r.measured) / r.measured, mfu=pred["parts"]["mfu"],
                         step_s=pred["parts"]["total"]))
    return rows


def median_abs_error(rows: list[dict]) -> float:
    return statistics.median(abs(r["error"]) for r in rows)


def spread(plan: Plan, rows: list[dict] | None = None) -> dict:
    """The errors of the published runs of ``plan``'s kind (:func:`kind`): the range to read a
    prediction with. Of the same kind if any was published, else of every run that shares most of
    its dimensions."""
    rows = rows if rows is not None else compare()
    mine = set(kind(plan).split(" + "))
    score = {r["run"]: len(mine & set(r["kind"].split(" + "))) - len(set(r["kind"].split(" + ")) ^ mine) for r in rows}
    best = max(score.values())
    like = [r for r in rows if score[r["run"]] == best]
    errors = [r["error"] for r in like]
    return {"kind": kind(plan), "n": len(like), "low": min(errors), "high": max(errors),
            "same_kind": all(r["kind"] == kind(plan) for r in like), "runs": [r["run"] for r in like]}


@dataclass(frozen=True)
class MemoryRun:
    name: str
    source: str
    shape: ModelShape
    plan: Plan
    measured_gib: float  # torchtitan's max_reserved, GiB


def memory_runs() -> list[MemoryRun]:
    l8 = MODELS["llama3-8b"]
    return [MemoryRun(f"Llama 3.1 8B, FSDP {n}", TITAN_H100, l8,
                      Plan(dp=n, micro_batch=2, global_batch=2 * n, zero=3, recompute="op", fused=False), gib)
            for n, gib in ((8, 82.4), (128, 67.0))]


def compare_memory() -> list[dict]:
    """One row per run that published its peak memory: the fullest rank's bytes by
    :mod:`labkit.planning.stage_memory` (GiB), measured, relative error. torchtitan's logger reports
    ``max_reserved`` (``torch.cuda.max_memory_reserved``): what the caching allocator held at its
    fullest, more than the tensors alive at any moment, which the model counts."""
    rows = []
    for r in memory_runs():
        top = peak_rank(r.shape, r.plan)
        parts = {"model states": top.states, "activations": top.activations, "loss": top.loss,
                 "FSDP buffers": top.buffers}
        gib = top.total / 2 ** 30
        rows.append(dict(run=r.name, source=r.source, devices=r.plan.devices, recompute=r.plan.recompute,
                         measured_gib=r.measured_gib, predicted_gib=gib, error=gib / r.measured_gib - 1,
                         parts_gib={**{k: v / 2 ** 30 for k, v in parts.items()}, "total": gib}))
    return rows
