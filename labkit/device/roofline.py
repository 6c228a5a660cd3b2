"""The roofline: how fast one op can go on one device (Williams, Waterman & Patterson 2009,
"Roofline: an insightful visual performance model for multicore architectures", CACM 52(4)).

An op that does ``F`` floating-point operations and moves ``B`` bytes between memory and the compute
units takes at least ``max(F / peak FLOP/s, B / memory bandwidth)``. Its *arithmetic intensity*
``I = F / B`` against the device's *ridge point* (peak / bandwidth) says which roof bounds it: below
the ridge it is memory-bound and faster arithmetic buys nothing. Bytes here are the op's compulsory
traffic (each input read once, each output written once), the least any kernel can move; a real
kernel moves at least that, so the bound is a floor on time.

One source of truth: :mod:`labkit.planning.step_model` prices its GEMMs and its memory-bound ops with
:meth:`Roof.seconds`, and the planner's accelerators give their roofs through
:meth:`labkit.planning.hardware.Hardware.roof`.

FLOPs per element of the memory-bound ops are approximate (they never decide a bound: those ops sit
two orders of magnitude below any ridge): a norm about 5 (LayerNorm's mean, variance, normalise,
scale, shift), GELU's tanh form about 8, a residual add 1, softmax about 5, AdamW about 12 per
parameter (Loshchilov & Hutter 2019, Algorithm 2: two moment updates, bias corrections, the
square root, the division, the decay).
"""
from __future__ import annotations

from dataclasses import dataclass

from labkit.memory.architecture import ModelShape, linear_layers

# AdamW with fp32 master weights reads the parameter, its gradient and two moments and writes three
# of them back (28 bytes), plus the bf16 copy the next forward reads (2): 30 bytes per parameter.
ADAMW_BYTES_PER_PARAM = 30
ADAMW_FLOPS_PER_PARAM = 12


@dataclass(frozen=True)
class Roof:
    """A device's two roofs: FLOP/s and bytes/s (peak from a datasheet, or achieved, or measured)."""

    name: str
    flops_per_s: float
    bytes_per_s: float
    source: str = ""

    @property
    def ridge(self) -> float:
        """FLOPs per byte where the two roofs meet: ops of lower intensity are memory-bound."""
        return self.flops_per_s / self.bytes_per_s

    def seconds(self, flops: float, nbytes: float) -> float:
        """The least time an op of ``flops`` FLOPs moving ``nbytes`` bytes can take."""
        return max(flops / self.flops_per_s, nbytes / self.bytes_per_s)

    def attainable(self, intensity: float) -> float:
        """FLOP/s an op of this intensity can reach: min(peak, intensity x bandwidth)."""
        return min(self.flops_per_s, intensity * self.bytes_per_s)

    def time(self, op: "Op") -> float:
        return self.seconds(op.flops, op.bytes)

    def bound(self, op: "Op") -> str:
        return "compute" if op.intensity >= self.ridge else "memory"


@dataclass(frozen=True)
class Op:
    """One op: its FLOPs and its compulsory bytes. ``kind``: matmul, attention or memory."""

    name: str
    kind: str
    flops: float
    bytes: float

    @property
    def intensity(self) -> float:
        return self.flops / self.bytes


def matmul(name: str, m: float, k: float, n: float, value_bytes: int = 2, batch: float = 1) -> Op:
    """``[m, k] @ [k, n]``, ``batch`` times: 2mkn FLOPs each; A and B read, C written once."""
    return Op(name, "matmul", batch * 2 * m * k * n, batch * value_bytes * (m * k + k * n + m * n))


def elementwise(name: str, read: float, written: float, flops_per_element: float, value_bytes: int = 2) -> Op:
    """An op over ``written`` output elements that reads ``read`` elements."""
    return Op(name, "memory", flops_per_element * written, value_bytes * (read + written))


def attention_ops(shape: ModelShape, batch: int, seq: int, value_bytes: int = 2, flash: bool = True,
                  causal: bool = True) -> list[Op]:
    """Attention's score work for ``batch`` sequences of ``seq`` tokens. Fused (FlashAttention, Dao et
    al. 2022): one op reading Q, K, V and writing O, ``4 s^2 d`` FLOPs per head, half when causal (its
    paper's count). Unfused: the scores written and read back through memory, in ``value_bytes``."""
    h, kv, d = shape.heads, shape.n_kv_heads, shape.d_head
    tokens = batch * seq
    if flash:
        flops = 4 * batch * h * seq * seq * d * (0.5 if causal else 1.0)
        return [Op("attention", "attention", flops, value_bytes * tokens * d * (2 * h + 2 * kv))]
    bh = batch * h
    return [matmul("scores QK^T", seq, d, seq, value_bytes, bh),
            elementwise("softmax", bh * seq * seq, bh * seq * seq, 5, value_bytes),
            matmul("probs @ V", seq, seq, d, value_bytes, bh)]


def block_ops(shape: ModelShape, batch: int, seq: int | None = None, value_bytes: int = 2, flash: bool = True,
              causal: bool = True) -> list[Op]:
    """The forward ops of one transformer block of ``shape`` on ``batch`` sequences of ``seq`` tokens
    (default: the shape's): the projections of :func:`labkit.memory.architecture.linear_layers`, the
    attention, the two norms, the MLP's activation and the two residual adds, unfused."""
    seq = seq or shape.seq_len
    tokens, h, ffn = batch * seq, shape.hidden, shape.ffn
    lin = linear_layers(shape)
    ops = [elementwise("norm 1", tokens * h, tokens * h, 5, value_bytes)]
    ops += [matmul(name, tokens, k, n, value_bytes) for name, (k, n, _) in lin.items() if name in ("qkv", "q", "k", "v")]
    ops += attention_ops(shape, batch, seq, value_bytes, flash, causal)
    ops += [matmul("o", tokens, *lin["o"][:2], value_bytes),
            elementwise("residual 1", 2 * tokens * h, tokens * h, 1, value_bytes),
            elementwise("norm 2", tokens * h, tokens * h, 5, value_bytes)]
    ops += [matmul(name, tokens, *lin[name][:2], value_bytes) for name in ("gate", "up") if name in lin]
    gated = "gate" in lin
    ops += [elementwise("SwiGLU" if gated else "GELU", (2 if gated else 1) * tokens * ffn, tokens * ffn, 8,
                        value_bytes),
            matmul("down", tokens, *lin["down"][:2], value_bytes),
            elementwise("residual 2", 2 * tokens * h, tokens * h, 1, value_bytes)]
    return ops


def optimizer_op(n_params: float) -> Op:
    """AdamW over ``n_params`` parameters (fp32 states, a bf16 copy written for the next forward)."""
    return Op("AdamW step", "memory", ADAMW_FLOPS_PER_PARAM * n_params, ADAMW_BYTES_PER_PARAM * n_params)
