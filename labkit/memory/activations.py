"""Bytes one transformer layer keeps for backward: Korthikanti et al. 2022's accounting, generalised.

Korthikanti et al. 2022, "Reducing Activation Recomputation in Large Transformer Models", section 4:
sbh(34 + 5as/h) bytes per layer with 16-bit activations, with tensor parallelism sbh(10 + 24/t +
5as/(ht)), with sequence parallelism (sbh/t)(34 + 5as/h). The general form below also covers other
activation widths, SwiGLU blocks with grouped-query attention, no dropout, flash attention (Dao et al.
2022), which never stores the s x s scores, recomputation policies and fused kernels, so the labs'
measurements can be held against it term by term. :mod:`labkit.memory.calculator` builds a whole
model's estimate on it; :mod:`labkit.planning.stage_memory` a pipeline rank's.
"""
from __future__ import annotations

import math
from fractions import Fraction

from labkit.core.checks import positive_count

RECOMPUTE = ("none", "selective", "full")
# + torchtitan's "op" AC (labkit.train's "selective:alternate"): keeps the 1st, 3rd... matmul outputs and attention's
POLICIES = RECOMPUTE + ("op",)


def _count(name: str, value) -> int:  # counts here may come as floats: 1e9 parameters
    return positive_count(name, value, accept_float=True)


def activation_bytes_per_layer(seq_len: int, micro_batch: int, hidden: int, heads: int, tp: int = 1,
                               sequence_parallel: bool = False, recompute: str = "none",
                               dtype_bytes: int = 2, dropout: bool = True,
                               flash_attention: bool = False, kv_dim: int | None = None,
                               ffn: int | None = None, swiglu: bool = False, kv_len: int | None = None,
                               fused: bool = False) -> int:
    """Bytes one transformer layer keeps for backward (Korthikanti et al. 2022, Table 2).

    With the defaults (16-bit activations, dropout, attention scores stored) this is exactly the
    paper's sbh(34 + 5as/h), sbh(10 + 24/t + 5as/(ht)) under tensor parallelism and
    (sbh/t)(34 + 5as/h) with sequence parallelism. Terms, in elements of ``dtype_bytes``:
    per layer 4sbh are never split by tensor parallelism (two LayerNorm inputs, the attention and
    MLP inputs), 12sbh are split (Q, K, V, the projection input, two 4h MLP activations); each
    dropout keeps a 1-byte mask (two of sbh, one of as^2b); the scores keep the softmax output
    (and the dropout output). Flash attention keeps an fp32 log-sum-exp of asb instead of scores.
    ``recompute="selective"`` recomputes what is cheap to compute and dear to store (Korthikanti et
    al. 2022, section 5): with the scores stored, the score term; with ``flash_attention``, which never
    stores them, the element-wise ops, as labkit's ``selective`` policy does
    (:mod:`labkit.parallel.activation_checkpointing`): the block keeps its input, every matmul's
    output and attention's output and log-sum-exp, and recomputes norms, the activation function and
    residual adds (11 h for GPT's block, 5h + 2 kv + 2 ffn for a SwiGLU block, measured in the tests).
    ``"full"`` keeps only the layer input, ``"op"`` (torchtitan's policy, :data:`POLICIES`) the input,
    the 1st, 3rd... matmul outputs and attention's.

    A LLaMA-style block (``swiglu``, grouped-query ``kv_dim``, its ``ffn`` width) keeps, split by
    TP, Q (h), K and V (``kv_dim`` each), the projection input (h) and four ffn-wide tensors of its
    SwiGLU MLP as PyTorch saves them (gate, SiLU(gate), up, and the down projection's input): 40.5sbh
    for a Llama-2-70B layer instead of GPT's 34sbh. GPT's split 12sbh is the same count with
    ``kv_dim = h`` and two 4h tensors. ``fused``: SwiGLU as one kernel (Megatron-Core's fused
    ``bias_swiglu``), which keeps its 2 ffn input and recomputes SiLU(gate) x up: three ffn-wide
    tensors with the down projection's input.
    """
    s, b = _count("seq_len", seq_len), _count("micro_batch", micro_batch)
    h, a, t = _count("hidden", hidden), _count("heads", heads), _count("tp", tp)
    if recompute not in POLICIES:
        raise ValueError(f"recompute={recompute!r} is unknown; valid modes: {list(POLICIES)}")
    if dtype_bytes not in (1, 2, 4):
        raise ValueError(f"dtype_bytes must be 1, 2 or 4, got {dtype_bytes!r}")
    sp = t if sequence_parallel else 1
    sbh, d, m = s * b * h, dtype_bytes, 1 if dropout else 0
    if recompute == "full":
        return math.ceil(Fraction(d * sbh, sp))
    kv, f = kv_dim or h, ffn or 4 * h
    if recompute == "op":  # the block's input, every second matmul's output, attention's output and LSE
        # (width, split by TP) of each matmul's output in forward order
        mms = ([(h, 1), (kv, 1), (kv, 1), (h, 0), (f, 1), (f, 1), (h, 0)] if swiglu else
               [(h + 2 * kv, 1), (h, 0), (f, 1), (h, 0)])
        kept = [mms[i] for i in range(0, len(mms), 2)] + [(h, 1)]
        values = sum(Fraction(w * s * b, t if split else sp) for w, split in kept) + Fraction(sbh, sp)
        return math.ceil(d * values + Fraction(4 * a * s * b, t))
    if recompute == "selective" and flash_attention:  # input, matmul and attention outputs (+ LSE)
        kept = Fraction(d * 3 * sbh, sp) + Fraction(d * s * b * (2 * h + 2 * kv + (2 if swiglu else 1) * f), t)
        return math.ceil(kept + Fraction(4 * a * s * b, t))  # dropout recomputed too: no masks
    unsplit = Fraction((4 * d + 2 * m) * sbh, sp)
    split = Fraction(d * s * b * (2 * h + 2 * kv + ((3 if fused else 4) if swiglu else 2) * f), t)
    if recompute == "selective":
        scores = 0
    elif flash_attention:
        scores = Fraction(4 * a * s * b, t)
    else:
        keys = _count("kv_len", kv_len) if kv_len is not None else s  # CP: s/C queries against all s keys
        scores = Fraction((2 * d + m if dropout else d) * a * s * keys * b, t)
    return math.ceil(unsplit + split + scores)


def autocast_extra_bytes_per_layer(seq_len: int, micro_batch: int, hidden: int) -> int:
    """What ``torch.autocast`` keeps on top of pure 16-bit activations, per layer.

    Autocast runs LayerNorm in fp32, so the two LayerNorm inputs (the fp32 residual stream) are
    saved at 4 bytes instead of 2 (+4sbh), and it caches the bf16 copy of each weight, which the
    matmuls save for backward (+2 bytes x 12h^2 weights); each LayerNorm also keeps fp32 mean and
    rstd (+16sb). Measured exactly on the lab's GPT (see the tests).
    """
    s, b, h = (_count(n, v) for n, v in (("seq_len", seq_len), ("micro_batch", micro_batch), ("hidden", hidden)))
    return 4 * s * b * h + 24 * h * h + 16 * s * b
