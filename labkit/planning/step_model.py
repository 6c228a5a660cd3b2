"""A training step's time, term by term, for any DP x TP x PP x CP layout of a transformer.

The model the planner ranks layouts with (:mod:`labkit.planning.search`), held against published
runs (:mod:`labkit.planning.published`). Every rate it uses is a named constant of
:mod:`labkit.planning.hardware`. Per micro-batch, on the slowest pipeline stage (the last: its layers
plus the output layer and the loss), one rank computes:

* **GEMMs**: each projection of a block (:func:`labkit.memory.architecture.linear_layers`), split by
  TP as Megatron-LM splits it (Shoeybi et al. 2019), at the roofline ``max(FLOPs / matmul rate,
  bytes / memory bandwidth)`` (Williams et al. 2009); forward once, backward twice (the input's and
  the weight's gradients). Small matrices fall onto the bandwidth roof by themselves.
* **attention scores**: with FlashAttention (Dao 2022, 2023) ``4 b s_q s_k d`` FLOPs per head
  forward, half of it when causal, 2.5 times that in backward, at its measured efficiency. Without
  it (Megatron-LM 2021) the batched GEMMs at the matmul rate, plus the ``s x s`` score matrix through
  memory: 13 bytes per score forward (written, scaled-masked-softmaxed, dropped out, read), twice that
  backward.
* **element-wise ops** (norms, residual adds, the MLP's activation, rotary embeddings, dropout):
  bytes over bandwidth, shared by TP (sequence parallelism shards what TP does not).
* **the output layer and the loss**: a ``T x h x V/tp`` GEMM and the fp32 softmax over the vocabulary.
* **full recomputation** runs every block's forward again, its TP all-reduces too (Korthikanti et
  al. 2022, section 5); selective recomputation only the score matrix, nothing under FlashAttention;
  torchtitan's selective "op" policy every second matmul and every element-wise op.

Communication (:mod:`labkit.planning.collectives`): TP's four all-reduces of ``b s h`` per layer
(with sequence parallelism, all-gathers and reduce-scatters of the same total), not overlapped; CP's
ring of K and V (Liu et al. 2023), hidden behind the attention it feeds as far as it lasts; PP's
activations and their gradients, point to point, per micro-batch; the data-parallel gradients once
per step (fp32, as Megatron-LM and torchtitan reduce them), hidden behind the last micro-batch's
backward when overlapped (ZeRO-2's partitioned gradients after every micro-batch's backward, and the
updated parameters all-gathered once); ZeRO-3/FSDP's gathers of bf16 parameters per micro-batch forward and backward,
prefetched behind compute, one per layer (each its own latency), and their reduce-scatters
(Rajbhandari et al. 2020; Zhao et al. 2023); under HSDP over the shard group only, the shards'
gradients then all-reduced across replicas. Expert parallelism (Lepikhin et al. 2021): a rank holds
``experts / ep`` of each layer's experts and runs four all-to-alls of its routed tokens per layer.

Then the pipeline: ``(m + p - 1)`` micro-batch times for GPipe and 1F1B, ``m + (p - 1)/v`` for the
interleaved schedule with ``v`` chunks per rank (Narayanan et al. 2021, section 2.2), and the
optimizer step: AdamW reads and writes 30 bytes per parameter it owns
(:func:`labkit.device.roofline.optimizer_op`). Every op is priced by :class:`labkit.device.roofline.Roof`.
"""
from __future__ import annotations

from dataclasses import dataclass

from labkit.device.roofline import matmul, optimizer_op
from labkit.memory.architecture import ModelShape, linear_layers
from labkit.planning import collectives as C
from labkit.planning.hardware import Hardware

ROW_PARALLEL = ("o", "down")  # split on their input by TP; the others on their output
SCHEDULES = ("1f1b", "gpipe", "interleaved")


@dataclass(frozen=True)
class Plan:
    """One layout and how it runs. ``dp`` counts model replicas (FSDP shards included); CP ranks are
    not among them. ``zero``: 0 DDP, 1 and 2 optimizer states (and gradients) sharded, 3 FSDP."""

    tp: int = 1
    pp: int = 1
    cp: int = 1
    dp: int = 1
    ep: int = 1  # expert-parallel ranks, carved out of dp (each holds experts / ep)
    replicas: int = 1  # HSDP (zero 3): dp = replicas x a shard group; 1 is FSDP over all dp ranks
    micro_batch: int = 1
    global_batch: int = 1  # sequences per step
    zero: int = 1
    recompute: str = "none"  # none | selective | full | op (torchtitan's: every second matmul)
    schedule: str = "1f1b"
    chunks: int = 1  # virtual stages per rank (interleaved)
    flash: bool = True
    value_bytes: int = 2  # of weights and activations: 2 in bf16 training, 4 in fp32
    fused: bool = True  # element-wise ops fused (Megatron-LM, torch.compile) or eager
    dp_overlap: bool = True  # DDP's buckets and FSDP's prefetch hidden behind compute

    @property
    def devices(self) -> int:
        return self.tp * self.pp * self.cp * self.dp

    @property
    def microbatches(self) -> int:
        return max(1, self.global_batch // (self.dp * self.micro_batch))


@dataclass(frozen=True)
class Operators:
    """Operators one rank launches, counted (:class:`labkit.comm.counter.CommCounter` counts them in
    a run): per micro-batch's forward and backward, and per optimizer step; those on DTensors apart,
    as each pays DTensor's sharding propagation on the host. What an overhead-bound step (a small
    model, a CPU) is made of; on a GPU, kernels queue ahead of the host and these cost nothing."""

    micro_batch: float = 0.0
    micro_batch_dtensor: float = 0.0
    step: float = 0.0
    step_dtensor: float = 0.0

    def seconds(self, hw: Hardware, which: str) -> float:
        plain, dtensor = (self.micro_batch, self.micro_batch_dtensor) if which == "micro_batch" else (
            self.step, self.step_dtensor)
        return plain * hw.op_overhead_s + dtensor * hw.dtensor_op_overhead_s


NO_OPERATORS = Operators()


def _gemm(hw: Hardware, tokens: float, k: float, n: float, value_bytes: int = 2) -> float:
    return hw.roof().time(matmul("gemm", tokens, k, n, value_bytes))


def elementwise_bytes(shape: ModelShape, fused: bool = True) -> float:
    """Bytes one token's element-wise ops move through memory in one block's forward.

    Fused (Megatron-LM's kernels, or ``torch.compile``): each norm reads and writes ``h`` values, each
    residual add reads two and writes one, the MLP's activation reads its inputs and writes its output
    once (SwiGLU 3 x ffn; GELU 2 x ffn, plus GPT's two dropouts), rotary embeddings read and write Q
    and K; 2 bytes each. Eager PyTorch, as a Llama block is written (torchtitan's): RMSNorm upcasts to
    fp32 and runs five kernels (42 h bytes), SwiGLU three (10 ffn), rotary embeddings in complex fp32
    24 bytes per Q and K value: counted from the kernels each op launches."""
    h, q_kv = shape.hidden, (shape.heads + shape.n_kv_heads) * shape.d_head
    llama = shape.family != "gpt"
    if fused:
        act = 3 * shape.ffn if llama else 2 * shape.ffn + 5 * h
        return 2 * (10 * h + act + (2 * q_kv if llama else 0))
    act = 10 * shape.ffn if llama else 4 * shape.ffn + 10 * h
    return 84 * h + 12 * h + act + (24 * q_kv if llama else 0)


def layer_compute(shape: ModelShape, plan: Plan, hw: Hardware, causal: bool = True) -> dict[str, float]:
    """Seconds of one block's forward and backward on one rank, for one micro-batch, by part."""
    tp, s_local = plan.tp, shape.seq_len / plan.cp
    tokens = plan.micro_batch * s_local
    gemm = 0.0
    for name, (k, n, copies) in linear_layers(shape).items():
        routed = tokens * shape.experts_per_token / shape.experts if copies > 1 else tokens
        per_rank = copies / plan.ep if copies > 1 else 1
        kk, nn = (k / tp, n) if name in ROW_PARALLEL else (k, n / tp)
        gemm += per_rank * _gemm(hw, routed * (plan.ep if copies > 1 else 1), kk, nn, plan.value_bytes)
    heads = shape.heads / tp
    scores = plan.micro_batch * heads * s_local * shape.seq_len  # this rank's queries x every key
    if plan.flash:
        attn_fwd = 4 * scores * shape.d_head * (0.5 if causal else 1.0) / hw.attention_flops
        attention = (attn_fwd, 2.5 * attn_fwd)
        recompute_attn = 0.0
    else:
        mm = 4 * scores * shape.d_head / hw.matmul_flops
        traffic = 13 * scores / hw.bytes_per_s
        attention = (mm + traffic, 2 * (mm + traffic))
        recompute_attn = mm + traffic
    elem_fwd = tokens * elementwise_bytes(shape, plan.fused) * plan.value_bytes / 2 / tp / hw.bytes_per_s
    forward = gemm + attention[0] + elem_fwd
    extra = {"full": forward, "selective": recompute_attn, "op": gemm / 2 + elem_fwd}.get(plan.recompute, 0.0)
    return {"forward": forward, "backward": 2 * gemm + attention[1] + 2 * elem_fwd, "recompute": extra,
            "attention": attention[0] + attention[1]}


def head_compute(shape: ModelShape, plan: Plan, hw: Hardware) -> float:
    """Seconds of the output layer and the fp32 loss, forward and backward, per micro-batch."""
    tokens = plan.micro_batch * shape.seq_len / plan.cp
    logits = tokens * shape.vocab / plan.tp
    return 3 * _gemm(hw, tokens, shape.hidden, shape.vocab / plan.tp, plan.value_bytes) + 24 * logits / hw.bytes_per_s


def _strides(plan: Plan) -> dict[str, int]:
    # Ranks numbered tp fastest, then cp, dp, pp (Megatron-LM's order; Llama 3's puts pp inside dp).
    return {"tp": 1, "cp": plan.tp, "dp": plan.tp * plan.cp, "pp": plan.tp * plan.cp * plan.dp}


def step_time(shape: ModelShape, plan: Plan, hw: Hardware, causal: bool = True,
              ops: Operators = NO_OPERATORS) -> dict[str, float]:
    """The parts of one step, in seconds, and ``total``; per the module docstring. ``ops``: the
    operators a rank launches (:class:`Operators`), each costing ``hw.op_overhead_s`` (on a DTensor
    ``hw.dtensor_op_overhead_s``)."""
    if plan.schedule not in SCHEDULES:
        raise ValueError(f"schedule={plan.schedule!r} is unknown; valid: {list(SCHEDULES)}")
    st, dpn = _strides(plan), hw.devices_per_node
    groups = {d: C.group(getattr(plan, d), st[d], dpn) for d in st}
    m, layers = plan.microbatches, shape.n_layer / plan.pp
    tokens = plan.micro_batch * shape.seq_len / plan.cp
    lay = layer_compute(shape, plan, hw, causal)
    compute = layers * (lay["forward"] + lay["backward"] + lay["recompute"]) + head_compute(shape, plan, hw)
    vb = plan.value_bytes
    act_bytes = vb * tokens * shape.hidden
    tp_calls = 4 + (2 if plan.recompute == "full" else 0)
    tp = layers * tp_calls * C.all_reduce(hw, groups["tp"], act_bytes)
    kv = 2 * vb * tokens * shape.n_kv_heads * shape.d_head / plan.tp  # K and V of this rank's chunk
    ring = 3 * (plan.cp - 1) * C.send(hw, kv, groups["cp"].nodes > 1)  # forward once, backward twice
    cp = layers * max(0.0, ring - lay["attention"]) if plan.cp > 1 else 0.0
    ep = 0.0
    if shape.experts > 1 and plan.ep > 1:  # four all-to-alls of the routed tokens per layer
        ep = layers * 4 * C.all_to_all(hw, C.group(plan.ep, 1, dpn), act_bytes * shape.experts_per_token)
    across = plan.pp > 1 and st["pp"] >= dpn
    p2p = 2 * plan.chunks * C.send(hw, act_bytes / plan.tp, across) if plan.pp > 1 else 0.0
    experts = expert_params(shape)
    params = (shape.n_params - experts + experts / plan.ep) / (plan.tp * plan.pp)  # what a rank's layers hold
    # data-parallel ranks, CP's included; under HSDP the shard group, the fastest of them
    shard = C.group(plan.dp * plan.cp // plan.replicas, plan.tp, dpn)
    replicate = C.group(plan.replicas, plan.tp * plan.cp * plan.dp // plan.replicas, dpn)
    fsdp = 0.0
    if plan.zero == 3:  # one gather per layer (each its own latency), the next prefetched behind this one
        one = C.all_gather(hw, shard, vb * params / layers)
        hidden = layers * lay["forward"] if plan.dp_overlap else 0.0
        fsdp = 2 * max(one, layers * one - hidden) + layers * C.reduce_scatter(hw, shard, 4 * params / layers)
    overhead = ops.seconds(hw, "micro_batch")
    per_mb = compute + overhead + tp + cp + ep + p2p + fsdp
    if plan.pp == 1:
        pipeline, bubble = m * per_mb, 0.0
    elif plan.schedule == "interleaved":
        pipeline, bubble = (m + (plan.pp - 1) / plan.chunks) * per_mb, (plan.pp - 1) / plan.chunks * per_mb
    else:
        pipeline, bubble = (m + plan.pp - 1) * per_mb, (plan.pp - 1) * per_mb
    grads = 0.0
    hide = layers * lay["backward"] if plan.dp_overlap else 0.0
    if plan.zero in (0, 1):  # gradients accumulated locally, reduced once a step
        sync = (C.all_reduce(hw, shard, 4 * params) if plan.zero == 0 else
                C.reduce_scatter(hw, shard, 4 * params) + C.all_gather(hw, shard, vb * params))
        grads = max(0.0, sync - hide)
    elif plan.zero == 2:  # partitioned gradients: reduce-scattered after every micro-batch's backward
        rs = max(0.0, C.reduce_scatter(hw, shard, 4 * params) - hide)
        grads = m * rs + C.all_gather(hw, shard, vb * params)
    elif plan.replicas > 1:  # HSDP: the reduce-scattered shards all-reduced across the replicas
        grads = max(0.0, C.all_reduce(hw, replicate, 4 * params / shard.n) - hide)
    owned = params / (plan.dp * plan.cp // plan.replicas) if plan.zero >= 1 else params
    optimizer = hw.roof().time(optimizer_op(owned)) + ops.seconds(hw, "step")
    total = pipeline + grads + optimizer
    return {"compute": m * compute, "overhead": m * overhead, "tensor_parallel": m * tp, "context_parallel": m * cp,
            "expert_parallel": m * ep, "pipeline_p2p": m * p2p, "fsdp": m * fsdp, "bubble": bubble,
            "data_parallel": grads, "optimizer": optimizer, "total": total}


def expert_params(shape: ModelShape) -> float:
    """Parameters in the experts' MLPs, all layers (0 for a dense model)."""
    if shape.experts <= 1:
        return 0.0
    return shape.n_layer * sum(k * n * copies for k, n, copies in linear_layers(shape).values() if copies > 1)


def matmul_weights_per_token(shape: ModelShape) -> float:
    """The weights one token is multiplied by: every block's projections (of the experts it is routed
    to, not all of them) and the output layer, tied to the token embedding or not. The embedding is a
    lookup; norms and biases are a rounding error."""
    per_layer = sum(k * n * (shape.experts_per_token if copies > 1 else copies)
                    for k, n, copies in linear_layers(shape).values())
    return shape.n_layer * per_layer + shape.vocab * shape.hidden


def model_flops_per_token(shape: ModelShape, causal: bool = False) -> float:
    """The MFU convention of PaLM (Chowdhery et al. 2022, appendix B): 6 per weight of every matrix
    multiply (:func:`matmul_weights_per_token`: torchtitan's non-embedding parameters, with a tied
    output layer counted, which multiplies all the same) plus 12 L h s for the attention scores, all
    of them (``causal`` halves that term, as FlashAttention's FLOP count does). For a GPT this is
    :func:`labkit.planning.cost.flops_per_token`, the count training's MFU uses."""
    attention = 12 * shape.n_layer * shape.heads * shape.d_head * shape.seq_len * (0.5 if causal else 1.0)
    return 6 * matmul_weights_per_token(shape) + attention


def predict(shape: ModelShape, plan: Plan, hw: Hardware, ops: Operators = NO_OPERATORS,
            causal: bool = True) -> dict[str, float]:
    """Step time and its parts, tokens per second per device, and MFU (PaLM's convention)."""
    parts = step_time(shape, plan, hw, causal, ops)
    tokens = plan.global_batch * shape.seq_len
    tps = tokens / parts["total"] / plan.devices
    mfu = tps * model_flops_per_token(shape) / (hw.peak_tflops * 1e12)
    return {**parts, "tokens_per_s_per_device": tps, "mfu": mfu}
