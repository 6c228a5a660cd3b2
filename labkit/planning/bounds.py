"""When each parallelism is communication-bound, in closed form: the step model's own terms, solved.

Austin et al. 2025 (*How to Scale Your Model*, "How to Parallelize a Transformer for Training" and
"How to Think About GPUs") reduce each parallelism to one inequality: the time its collectives take
against the time of the compute that could hide them, both linear in the tokens or the width, so
that the break-even is a ratio of FLOP/s ``C`` to bytes/s ``W``. Here the same algebra is done on
:mod:`labkit.planning.step_model`'s terms (the achieved GEMM rate ``C = hw.matmul_flops``, each
group's bus bandwidth from :mod:`labkit.planning.collectives`, rail-optimised nodes), leaving out
latencies, attention and element-wise work, so each threshold is a round number to reason with; a
test holds each against the step model's exact crossover.

* **Data parallelism** (DDP, ZeRO-1/2): fp32 gradients of ``P`` parameters all-reduced,
  ``2 (n-1)/n 4P / W``, hidden behind the last micro-batch's backward, ``4 P b / C`` for ``b``
  tokens on a device: hidden when ``b >= 2 (n-1)/n C / W`` (ZeRO-1's reduce-scatter and bf16
  gather: ``1.5 (n-1)/n C / W``). The book's ``B/X > C/W`` for bf16 gradients.
* **FSDP**: per layer, a bf16 gather in forward (``2 P_l (n-1)/n / W`` against ``2 P_l b / C``) and
  a gather and an fp32 reduce-scatter in backward (``6 P_l`` against ``4 P_l b``): the backward binds,
  ``b >= 1.5 (n-1)/n C / W`` tokens per micro-batch.
* **Tensor parallelism**: four collectives of ``b h`` bf16 values a layer, ``2 (t-1)/t`` of each sent,
  not overlapped, against the layer's matmuls split ``t`` ways, ``6 N_l b / (t C)`` with ``N_l`` the
  block's matmul weights (``12 h^2`` for GPT's): equal when ``N_l / h = 8 (t-1) C / (3 W)``; for GPT's
  block, ``h = (2/9)(t-1) C / W``. Wider layers than that spend less on TP's collectives than on
  their matmuls (the book's ``F > Y C / W`` with the overlap it assumes).
* **Context parallelism**: each layer passes K and V (``2 b_c kv`` bf16 values of a rank's ``b_c``
  tokens) ``3 (cp - 1)`` times round the ring, hidden behind attention, ``7 b_c s h / C_attn`` FLOPs
  forward and backward (causal): hidden when ``s >= (12/7) (cp-1) (kv/h) C_attn / W``. Grouped-query
  attention's small ``kv`` is why a ring hides at a few hundred tokens a rank.
* **Expert parallelism**: four all-to-alls of a token's ``k`` routed copies (``2 h`` bytes each) a
  layer, of which ``(n-k_node)/n`` leave the node through the rank's own NIC, against the experts'
  matmuls, ``6 x 3 h f k`` FLOPs a token: the all-to-alls cost less than the experts' GEMMs when
  ``f >= (4/9) (n-k_node)/n C / W_nic`` (the book's ``F > 8 C/W`` for EP over many nodes).
"""
from __future__ import annotations

from labkit.memory.architecture import ModelShape, linear_layers
from labkit.planning import collectives as C
from labkit.planning.hardware import Hardware


def _bw(hw: Hardware, n: int, stride: int) -> float:
    """Bus bandwidth of a ring of ``n`` ranks ``stride`` apart, bytes/s (collectives' ``_bandwidth``)."""
    return C._bandwidth(hw, C.group(n, stride, hw.devices_per_node))


def dp_tokens(hw: Hardware, n: int, zero: int = 0, stride: int = 1) -> float:
    """Tokens per micro-batch on a device above which data parallelism's gradients hide behind backward."""
    ratio = 2.0 if zero == 0 else 1.5
    return ratio * (n - 1) / n * hw.matmul_flops / _bw(hw, n, stride)


def fsdp_tokens(hw: Hardware, n: int, stride: int = 1) -> float:
    """Tokens per micro-batch on a device above which FSDP's per-layer collectives hide behind compute."""
    return 1.5 * (n - 1) / n * hw.matmul_flops / _bw(hw, n, stride)


def block_matmul_weights(shape: ModelShape) -> float:
    """``N_l``: the weights a token is multiplied by in one block (its routed experts only)."""
    return sum(k * n * (shape.experts_per_token if c > 1 else 1) for k, n, c in linear_layers(shape).values())


def tp_ratio(hw: Hardware, shape: ModelShape, t: int, stride: int = 1) -> float:
    """TP's collectives over the block's matmuls, one layer: above 1 communication-bound."""
    return 8 * (t - 1) * hw.matmul_flops * shape.hidden / (3 * block_matmul_weights(shape) * _bw(hw, t, stride))


def tp_hidden(hw: Hardware, t: int, stride: int = 1) -> float:
    """The hidden size of a GPT block (``12 h^2`` weights) whose TP collectives take as long as its matmuls."""
    return 2 / 9 * (t - 1) * hw.matmul_flops / _bw(hw, t, stride)


def cp_tokens(hw: Hardware, shape: ModelShape, cp: int, stride: int = 1) -> float:
    """The sequence length above which CP's K/V ring hides behind attention."""
    kv = shape.n_kv_heads * shape.d_head
    across = C.group(cp, stride, hw.devices_per_node).nodes > 1
    link = (hw.network if across else hw.node).busbw_gb_per_s * 1e9
    return 12 / 7 * (cp - 1) * kv / (shape.heads * shape.d_head) * hw.attention_flops / link


def ep_ffn(hw: Hardware, n: int, stride: int = 1) -> float:
    """The expert width ``f`` above which EP's all-to-alls take less than the experts' matmuls."""
    g = C.group(n, stride, hw.devices_per_node)
    k = min(g.per_node, g.n)
    inside = (k - 1) / n / (hw.node.busbw_gb_per_s * 1e9)
    leaving = (n - k) / n / (hw.network.busbw_gb_per_s * 1e9)
    return 4 / 9 * hw.matmul_flops * max(inside, leaving)


def crossover(exposed, guess: float, span: float = 16.0) -> float:
    """The size at which ``exposed(size)`` (positive: communication-bound) turns non-positive, by
    bisection in log space around ``guess``: the step model's own break-even, latencies included."""
    lo, hi = guess / span, guess * span
    if not exposed(lo) > 0 >= exposed(hi):
        raise ValueError(f"no crossover between {lo:.3g} and {hi:.3g}")
    for _ in range(40):
        mid = (lo * hi) ** 0.5
        lo, hi = (mid, hi) if exposed(mid) > 0 else (lo, mid)
    return hi


def cp_crossover(hw: Hardware, shape: ModelShape, cp: int, stride: int = 1) -> float:
    """The sequence length above which the step model's ring hides behind attention, per-hop latency
    included (which :func:`cp_tokens` leaves out, and which dominates grouped-query attention's small
    K and V)."""
    from dataclasses import replace

    from labkit.planning.step_model import Plan, step_time

    def exposed(seq: float) -> float:
        s = 2 * cp * max(1, int(seq / (2 * cp)))
        return step_time(replace(shape, seq_len=s), Plan(cp=cp, tp=stride, dp=1, global_batch=1, zero=3),
                         hw)["context_parallel"]

    return crossover(exposed, cp_tokens(hw, shape, cp, stride))
