"""A training step's time, term by term, for any DP x TP x PP x CP x EP layout of a transformer.

The one model every ranking in the course prices layouts with (:mod:`labkit.planning.search`; the
chooser of ``python -m labkit.planning memory`` and the strategy lab call that search), held against
published runs (:mod:`labkit.planning.published`). Every rate is a named constant of
:mod:`labkit.planning.hardware`. Per micro-batch, one pipeline rank computes for each of its layers:

* **GEMMs**: each projection of a block (:func:`labkit.memory.architecture.linear_layers`), split by
  TP as Megatron-LM splits it (Shoeybi et al. 2019), at the roofline ``max(FLOPs / matmul rate,
  bytes / memory bandwidth)`` (Williams et al. 2009); forward once, backward twice (the input's
  gradient and the weight's, kept apart for the zero-bubble schedule).
* **attention scores**: with FlashAttention (Dao 2022, 2023) ``4 b s_q s_k d`` FLOPs per head
  forward, half of it when causal, 2.5 times that in backward, at its measured efficiency. Without
  it (Megatron-LM 2021) the batched GEMMs at the matmul rate, plus the ``s x s`` score matrix through
  memory: 13 bytes per score forward (written, scaled-masked-softmaxed, dropped out, read), twice that
  backward.
* **element-wise ops** (norms, residual adds, the MLP's activation, rotary embeddings, dropout):
  bytes over bandwidth, shared by TP (sequence parallelism shards what TP does not).
* **the output layer and the loss** on the rank of the last chunk: a ``T x h x V/tp`` GEMM and the
  fp32 softmax over the vocabulary.
* **recomputation**: full runs every block's forward again, its TP collectives too (Korthikanti et
  al. 2022, section 5); selective, under FlashAttention, the element-wise ops (labkit's policy:
  norms, the activation, residual adds), without it the score matrix; torchtitan's "op" policy
  every second matmul and every element-wise op.

Communication (:mod:`labkit.planning.collectives`), each group placed by the mesh's order
(:mod:`labkit.parallel.layout.mesh`: TP fastest, then CP, the data-parallel shard, its replicas, PP), so
which links a dimension crosses follows from the layout: TP's collectives of ``b s h`` (two
forward, two backward: Shoeybi et al. 2019, section 3; with sequence parallelism all-gathers and
reduce-scatters of the same volume), not overlapped; CP's ring of K and V (Liu et al. 2023) hidden
behind the attention it feeds as far as it lasts (or Llama 3's all-gather of K and V, exposed "in the
critical path", Dubey et al. 2024 section 3.3.2: gathered for forward and again for backward, their
gradients reduce-scattered); EP's four all-to-alls of the routed tokens per
layer (Lepikhin et al. 2021), at their true cross-node cost; PP's activations and gradients, point
to point, per chunk and micro-batch. Data parallelism: gradients once a step (fp32), hidden behind
the last micro-batch's backward when overlapped (ZeRO-2: reduce-scattered after every
micro-batch's backward; ZeRO-1/2: the updated parameters gathered once); FSDP2 (Zhao et al. 2023)
gathers each layer's bf16 parameters one layer ahead, in forward and in backward, and reduce-scatters
each layer's gradients while the layer below computes its backward: exposed are the first gather,
the last reduce-scatter and whatever a layer's collectives take beyond its compute. Under a
pipeline FSDP gathers once a step and reduce-scatters once, after the last micro-batch (torchtitan
turns ``reshard_after_forward`` off with PP), adding every micro-batch's bf16 gradients into fp32
ones in between (10 bytes a parameter through memory). HSDP reduce-scatters in its shard group, then
all-reduces the shards across replicas.

Then the pipeline (:mod:`labkit.planning.pipeline_model`: uneven stages, 1F1B, GPipe, interleaved
with any number of chunks, ZB-V), and the optimizer step: AdamW reads and writes 30 bytes per
parameter it owns (:func:`labkit.device.roofline.optimizer_op`); offloaded (Ren et al. 2021), its
gradients and parameters cross PCIe and the update runs at the host's memory bandwidth.
"""
from __future__ import annotations

from labkit.device.roofline import ADAMW_BYTES_PER_PARAM, matmul, optimizer_op
from labkit.memory.architecture import ModelShape, linear_layers
from labkit.planning import collectives as C
from labkit.planning import pipeline_model as pm
from labkit.planning.hardware import Hardware
from labkit.planning.plan import NO_OPERATORS, Operators, Plan
from labkit.planning.stage_memory import edge_params, layer_params

ROW_PARALLEL = ("o", "down")  # split on their input by TP; the others on their output
SCHEDULES = pm.SCHEDULES
__all__ = ["NO_OPERATORS", "Operators", "Plan", "layer_compute", "model_flops_per_token", "predict", "step_time"]


def _gemm(hw: Hardware, tokens: float, k: float, n: float, value_bytes: int = 2) -> float:
    return hw.roof().time(matmul("gemm", tokens, k, n, value_bytes))


def elementwise_bytes(shape: ModelShape, fused: bool = True) -> float:
    """Bytes one token's element-wise ops move through memory in one block's forward.

    Fused (Megatron-LM's kernels, or ``torch.compile``): each norm reads and writes ``h`` values, each
    residual add reads two and writes one, the MLP's activation reads its inputs and writes its output
    once (SwiGLU 3 x ffn; GELU 2 x ffn, plus GPT's two dropouts), rotary embeddings read and write Q
    and K; 2 bytes each. Eager PyTorch, as a Llama block is written (torchtitan's): RMSNorm upcasts to
    fp32 and runs five kernels (42 h bytes), SwiGLU three (10 ffn), rotary embeddings in complex fp32
    24 bytes per Q and K value: counted from the kernels each op launches. A mixture of experts adds
    its token permutation: each of a token's ``k`` routed copies written once sorted by expert and
    read back once to be weighted and summed, ``2 (1 + k) h`` values each way (Gale et al. 2023's
    gather and scatter around the grouped GEMMs). Per expert, the activation runs on ``k`` copies."""
    h, q_kv, k = shape.hidden, (shape.heads + shape.n_kv_heads) * shape.d_head, shape.experts_per_token
    llama = shape.family != "gpt"
    moe = 2 * 2 * (1 + k) * h if shape.experts > 1 else 0
    if fused:
        act = k * (3 * shape.ffn if llama else 2 * shape.ffn + 5 * h)
        return 2 * (10 * h + act + (2 * q_kv if llama else 0)) + moe
    act = k * (10 * shape.ffn if llama else 4 * shape.ffn + 10 * h)
    return 84 * h + 12 * h + act + (24 * q_kv if llama else 0) + moe


def layer_compute(shape: ModelShape, plan: Plan, hw: Hardware, causal: bool = True) -> dict[str, float]:
    """Seconds of one block's forward and backward on one rank, for one micro-batch, by part:
    ``backward`` is ``backward_input`` (on the critical path) plus ``backward_weight`` (deferrable)."""
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
        score_recompute = 0.0
    else:
        mm = 4 * scores * shape.d_head / hw.matmul_flops
        traffic = 13 * scores / hw.bytes_per_s
        attention = (mm + traffic, 2 * (mm + traffic))
        score_recompute = mm + traffic
    sp = tp if plan.sequence_parallel or tp == 1 else 1
    elem_fwd = tokens * elementwise_bytes(shape, plan.fused) * plan.value_bytes / 2 / sp / hw.bytes_per_s
    forward = gemm + attention[0] + elem_fwd
    selective = elem_fwd if plan.flash else score_recompute
    extra = {"full": forward, "selective": selective, "op": gemm / 2 + elem_fwd}.get(plan.recompute, 0.0)
    return {"forward": forward, "backward": 2 * gemm + attention[1] + 2 * elem_fwd, "recompute": extra,
            "backward_input": gemm + attention[1] + 2 * elem_fwd, "backward_weight": gemm,
            "attention": attention[0] + attention[1]}


def head_compute(shape: ModelShape, plan: Plan, hw: Hardware) -> float:
    """Seconds of the output layer and the fp32 loss, forward and backward, per micro-batch."""
    tokens = plan.micro_batch * shape.seq_len / plan.cp
    logits = tokens * shape.vocab / plan.tp
    return 3 * _gemm(hw, tokens, shape.hidden, shape.vocab / plan.tp, plan.value_bytes) + 24 * logits / hw.bytes_per_s


def groups(plan: Plan, devices_per_node: int) -> dict[str, C.Group]:
    """Each dimension's group, by the mesh's order (module docstring): TP fastest, then CP, the data
    ranks (EP's inside FSDP's shard group), the HSDP replicas, PP."""
    g = lambda n, stride: C.group(n, stride, devices_per_node)  # noqa: E731
    shard = plan.dp * plan.cp // plan.replicas  # one replica's ranks that shard each weight
    return {"tp": g(plan.tp, 1), "cp": g(plan.cp, plan.tp), "shard": g(shard, plan.tp), "ep": g(plan.ep, plan.tp),
            "replicate": g(plan.replicas, plan.tp * shard), "pp_across": plan.tp * plan.cp * plan.dp >= devices_per_node}


def _fsdp_exposed(hw: Hardware, shard: C.Group, layer_params: float, value_bytes: int, n: int, fwd: float,
                  bwd: float, overlap: bool) -> float:
    """Exposed seconds of FSDP2's per-layer gathers (forward and backward, ``value_bytes`` a parameter)
    and reduce-scatters (fp32 gradients) of one micro-batch over ``n`` layers of ``fwd`` / ``bwd``
    seconds each (module docstring)."""
    ag = C.all_gather(hw, shard, value_bytes * layer_params)
    rs = C.reduce_scatter(hw, shard, 4 * layer_params)
    if not overlap:
        return n * (2 * ag + rs)
    return ag + max(0, n - 1) * max(0.0, ag - fwd) + ag + rs + max(0, n - 1) * max(0.0, ag + rs - bwd)


def step_time(shape: ModelShape, plan: Plan, hw: Hardware, causal: bool = True,
              ops: Operators = NO_OPERATORS) -> dict[str, float]:
    """The parts of one step, in seconds, and ``total``; per the module docstring. The parts are the
    busiest pipeline rank's: ``compute`` to ``fsdp`` over its ``m`` micro-batches, then the bubble,
    the data-parallel gradients and the optimizer. ``ops``: the operators a rank launches
    (:class:`Operators`), each costing ``hw.op_overhead_s`` (on a DTensor ``hw.dtensor_op_overhead_s``)."""
    if plan.schedule not in SCHEDULES:
        raise ValueError(f"schedule={plan.schedule!r} is unknown; valid: {list(SCHEDULES)}")
    g, dpn = groups(plan, hw.devices_per_node), hw.devices_per_node
    m, v = plan.microbatches, plan.v
    layers = pm.chunk_layers(shape.n_layer, plan.pp * v, plan.first_less, plan.last_less)
    tokens = plan.micro_batch * shape.seq_len / plan.cp
    lay = layer_compute(shape, plan, hw, causal)
    vb = plan.value_bytes
    act_bytes = vb * tokens * shape.hidden
    tp_one = (4 + (2 if plan.recompute == "full" else 0)) * C.all_reduce(hw, g["tp"], act_bytes)
    kv = 2 * vb * tokens * shape.n_kv_heads * shape.d_head / plan.tp  # K and V of this rank's chunk
    if plan.cp_impl == "allgather":  # K and V gathered before attention, dK and dV reduce-scattered after
        cp_one = 2 * C.all_gather(hw, g["cp"], plan.cp * kv) + C.reduce_scatter(hw, g["cp"], plan.cp * kv)
    else:  # a ring: K and V passed on while attention computes, forward once and backward twice
        ring = 3 * (plan.cp - 1) * C.send(hw, kv, g["cp"].nodes > 1)
        cp_one = max(0.0, ring - lay["attention"])
    cp_one = cp_one if plan.cp > 1 else 0.0
    ep_one = 4 * C.all_to_all(hw, g["ep"], act_bytes * shape.experts_per_token) if plan.ep > 1 else 0.0
    send = C.send(hw, act_bytes / (plan.tp if plan.sequence_parallel else 1), g["pp_across"])
    dense, experts = layer_params(shape)
    embed, out = edge_params(shape)
    per_layer_params = (dense + experts / plan.ep) / plan.tp
    ranks = []
    for r in range(plan.pp):
        chunks = pm.rank_chunks(r, plan.pp, v, plan.schedule)
        n = sum(layers[c] for c in chunks)
        last = len(layers) - 1 in chunks
        compute = n * (lay["forward"] + lay["backward"] + lay["recompute"]) + (head_compute(shape, plan, hw) if last else 0)
        params = n * per_layer_params + ((embed if 0 in chunks else 0) + (out if last else 0)) / plan.tp
        if plan.zero == 3 and plan.pp > 1:  # FSDP2 adds each micro-batch's bf16 gradients into fp32 ones
            compute += 10 * params / hw.bytes_per_s
        fsdp = 0.0
        if plan.zero == 3 and plan.pp == 1:
            fsdp = _fsdp_exposed(hw, g["shard"], per_layer_params, vb, n, lay["forward"], lay["backward"],
                                 plan.dp_overlap)
        ranks.append({"compute": compute, "overhead": ops.seconds(hw, "micro_batch"), "tensor_parallel": n * tp_one,
                      "context_parallel": n * cp_one, "expert_parallel": n * ep_one,
                      "pipeline_p2p": 2 * len(chunks) * send if plan.pp > 1 else 0.0, "fsdp": fsdp, "params": params,
                      "layers": n})
    per_mb = [sum(r[k] for k in PER_MB) for r in ranks]
    chunk = max(1, shape.n_layer / (plan.pp * v))
    zb = (chunk * lay["forward"], chunk * lay["backward_input"], chunk * lay["backward_weight"])
    busy, bubble = pm.pipeline_seconds(per_mb, m, v, plan.schedule, zb)
    top = ranks[per_mb.index(max(per_mb))]
    params = max(r["params"] for r in ranks)
    grads, fsdp_step = _data_parallel(hw, plan, g, params, top["layers"] * lay["backward"], m)
    owned = params / (plan.dp * plan.cp // plan.replicas) if plan.zero >= 1 else params
    optimizer = _optimizer(hw, plan, owned) + ops.seconds(hw, "step")
    total = busy + bubble + grads + fsdp_step + optimizer
    parts = {k: m * top[k] for k in PER_MB}
    parts["fsdp"] += fsdp_step
    return {**parts, "bubble": bubble, "data_parallel": grads, "optimizer": optimizer, "total": total}


PER_MB = ("compute", "overhead", "tensor_parallel", "context_parallel", "expert_parallel", "pipeline_p2p", "fsdp")


def _data_parallel(hw: Hardware, plan: Plan, g: dict, params: float, backward: float, m: int) -> tuple[float, float]:
    """(exposed seconds of the gradient reduction, of FSDP's once-a-step gathers under a pipeline)."""
    shard, vb = g["shard"], plan.value_bytes
    hide = backward if plan.dp_overlap else 0.0
    if plan.zero in (0, 1):  # gradients accumulated locally, reduced once a step
        sync = (C.all_reduce(hw, shard, 4 * params) if plan.zero == 0 else
                C.reduce_scatter(hw, shard, 4 * params) + C.all_gather(hw, shard, vb * params))
        return max(0.0, sync - hide), 0.0
    if plan.zero == 2:  # partitioned gradients: reduce-scattered after every micro-batch's backward
        return m * max(0.0, C.reduce_scatter(hw, shard, 4 * params) - hide) + C.all_gather(hw, shard, vb * params), 0.0
    across = C.all_reduce(hw, g["replicate"], 4 * params / shard.n) if plan.replicas > 1 else 0.0
    if plan.pp == 1:  # FSDP2's per-layer collectives are in the micro-batches; HSDP's replicas reduce after
        return max(0.0, across - hide), 0.0
    gather = C.all_gather(hw, shard, vb * params)  # once, ahead of the first micro-batch, a layer at a time
    scatter = C.reduce_scatter(hw, shard, 4 * params) + across
    return max(0.0, scatter - hide), gather


def _optimizer(hw: Hardware, plan: Plan, owned: float) -> float:
    if not plan.offload:
        return hw.roof().time(optimizer_op(owned))
    pcie = (4 + plan.value_bytes) * owned / (hw.pcie_gb_per_s * 1e9)  # fp32 gradients out, parameters back
    return pcie + ADAMW_BYTES_PER_PARAM * owned / (hw.host_gb_per_s * 1e9)


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
