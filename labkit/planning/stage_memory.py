"""Memory of every pipeline rank of a layout, as it is: its own layers, what its schedule keeps in
flight, the embedding or output layer where they sit. The fullest rank decides whether it fits.

One rank's bytes, for a :class:`labkit.planning.step_model.Plan`:

* **Model states** (ZeRO's accounting, Rajbhandari et al. 2020: 2 + 2 + 12 bytes per parameter in
  mixed precision, :func:`labkit.memory.calculator.model_state_breakdown`) of the parameters this
  rank holds: its chunks' layers split by TP as Megatron-LM splits them, the experts' MLPs further
  by EP, the token embedding on the rank of the first chunk and the output layer (a second copy
  when tied) on the rank of the last, each split over the vocabulary by TP (Megatron-LM and
  torchtitan shard both). ZeRO shards over the data-parallel ranks that hold copies (CP's
  included; HSDP: one replica's); under a pipeline FSDP keeps the gathered parameters and the
  unsharded gradients across the step's micro-batches (torchtitan's ``reshard_after_forward`` is
  off with PP, as Llama 3's FSDP, Dubey et al. 2024 section 3.3.2): whole bf16 parameters and whole
  gradients, accumulated in fp32 (FSDP2's ``unsharded_accumulated_grad``, in its reduce dtype; Llama 3
  "use[s] FP32 gradients accumulation"), 6 bytes a parameter beside the sharded optimizer states.
  Without a pipeline FSDP2 adds two gathered layers (the one computing and the one prefetched) and
  one layer's unsharded gradient (Zhao et al. 2023).
* **Activations**: the layer-micro-batches the schedule keeps in flight on this rank
  (:func:`labkit.planning.pipeline_model.in_flight`) times one layer's bytes
  (:func:`labkit.memory.calculator.activation_bytes_per_layer`, with the plan's recomputation and
  kernels), and, under full or op-level recomputation, one layer re-materialised during backward.
  A stage's output is sent on and its memory freed (Megatron-LM's ``deallocate_output_tensor``;
  Llama 3 "proactively deallocate[s] ... the input and output tensors of each pipeline stage"); with
  ``free_stage_outputs`` off (torch.distributed.pipelining keeps them for backward) each in-flight
  chunk also keeps its ``b s h / (cp tp)`` output.
* **The loss** on the last chunk's rank, for one micro-batch at a time: the fp32 log-softmax over the
  vocabulary cross-entropy saves, and at the start of backward its gradient with respect to it and
  to its input (8 more bytes per logit), as :func:`labkit.planning.published.peak_memory` found on
  torchtitan's runs.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from labkit.memory.architecture import ModelShape, expert_params
from labkit.memory.calculator import activation_bytes_per_layer, model_state_breakdown
from labkit.planning import pipeline_model as pm


@dataclass(frozen=True)
class RankMemory:
    """Bytes on one pipeline rank (every TP, CP and DP rank of that stage holds the same)."""

    rank: int
    layers: int
    params: int
    grads: int
    optimizer: int
    activations: int
    loss: int
    buffers: int  # FSDP2's gathered parameters and unsharded gradients, transient
    host: int = 0  # optimizer states offloaded to host memory

    @property
    def total(self) -> int:
        return self.params + self.grads + self.optimizer + self.activations + self.loss + self.buffers

    @property
    def states(self) -> int:
        return self.params + self.grads + self.optimizer


def edge_params(shape: ModelShape) -> tuple[int, int]:
    """(parameters with the first chunk, with the last): the token (and GPT's position) embedding;
    the final norm and the output layer, a copy of the embedding when tied."""
    embed = shape.vocab * shape.hidden + (shape.seq_len * shape.hidden if shape.family == "gpt" else 0)
    return embed, shape.vocab * shape.hidden + (2 if shape.family == "gpt" else 1) * shape.hidden


def layer_params(shape: ModelShape) -> tuple[float, float]:
    """(dense, experts') parameters of one block."""
    embed, out = edge_params(shape)
    tied = shape.vocab * shape.hidden if shape.family == "gpt" else 0  # GPT's output is the embedding
    experts = expert_params(shape)
    return (shape.n_params - embed - out + tied - experts) / shape.n_layer, experts / shape.n_layer


def activation_per_layer(shape: ModelShape, plan, recompute: str | None = None) -> int:
    """Bytes one layer keeps for one micro-batch on one rank under ``plan`` (or ``recompute`` instead
    of the plan's)."""
    recompute = plan.recompute if recompute is None else recompute
    per = activation_bytes_per_layer(shape.seq_len // plan.cp, plan.micro_batch, shape.hidden, shape.heads,
                                     plan.tp, plan.tp > 1 and plan.sequence_parallel, recompute, plan.value_bytes,
                                     dropout=shape.family == "gpt", flash_attention=plan.flash,
                                     kv_dim=shape.n_kv_heads * shape.d_head, ffn=shape.ffn,
                                     swiglu=shape.family != "gpt", kv_len=shape.seq_len, fused=plan.fused)
    if shape.experts_per_token > 1 and recompute != "full":  # k experts' MLPs per token
        per = math.ceil(per * (1 + 19 * (shape.experts_per_token - 1) / 34))
    return per


def _states(shape: ModelShape, plan, n_layers: int, first: bool, last: bool):
    """Model states of a rank holding ``n_layers`` layers, and the embedding / output layer if
    ``first`` / ``last`` (module docstring): ZeRO's stage, FSDP under a pipeline as ZeRO-1 plus fp32
    accumulated gradients, experts split by EP and sharded over the ranks holding the same ones."""
    dense, experts = layer_params(shape)
    embed, out = edge_params(shape)
    holders = plan.dp * plan.cp // plan.replicas  # ranks that shard each weight (one HSDP replica)
    piped_fsdp = plan.zero == 3 and plan.pp > 1
    stage = 1 if piped_fsdp else plan.zero
    mine = (n_layers * dense + (embed if first else 0) + (out if last else 0)) / plan.tp
    st = model_state_breakdown(max(1, math.ceil(mine)), holders, stage, fp32_grad_accum=piped_fsdp)
    if experts:
        ex = model_state_breakdown(max(1, math.ceil(n_layers * experts / (plan.tp * plan.ep))),
                                   max(1, holders // plan.ep), stage, fp32_grad_accum=piped_fsdp)
        st = type(st)(*(getattr(st, f) + getattr(ex, f) for f in ("params", "grads", "optimizer", "grad_accum")))
    return st


def rank_memory(shape: ModelShape, plan) -> list[RankMemory]:
    """Every pipeline rank's bytes (module docstring)."""
    v = pm.chunks_per_rank(plan.schedule, plan.chunks)
    layers = pm.chunk_layers(shape.n_layer, plan.pp * v, plan.first_less, plan.last_less)
    dense, experts = layer_params(shape)
    per_layer = activation_per_layer(shape, plan)
    tokens = plan.micro_batch * shape.seq_len / plan.cp
    out_rows = []
    for r in range(plan.pp):
        chunks = pm.rank_chunks(r, plan.pp, v, plan.schedule)
        n = sum(layers[c] for c in chunks)
        last = len(layers) - 1 in chunks
        st = _states(shape, plan, n, 0 in chunks, last)
        # without a pipeline one micro-batch at a time: accumulation frees each before the next
        acts = (pm.in_flight(r, plan.pp, plan.microbatches, plan.schedule, layers) if plan.pp > 1 else n) * per_layer
        if plan.recompute in ("full", "op") and n:  # backward re-materialises one layer at a time
            acts += activation_per_layer(shape, plan, "none")
        if plan.pp > 1 and not plan.free_stage_outputs:  # each in-flight chunk's output, kept for backward
            outputs = pm.in_flight(r, plan.pp, plan.microbatches, plan.schedule, [1] * len(layers))
            acts += outputs * plan.value_bytes * tokens * shape.hidden / (plan.tp if plan.sequence_parallel else 1)
        loss = int((12 * tokens * shape.vocab + 4 * plan.value_bytes * tokens * shape.hidden) / plan.tp) if last else 0
        buffers = 0
        if plan.zero == 3 and plan.pp == 1:  # two gathered blocks (one prefetched), one block's gradients
            buffers = int(3 * plan.value_bytes * (dense + experts / plan.ep) / plan.tp)
        optimizer, host = (0, st.optimizer) if plan.offload else (st.optimizer, 0)
        out_rows.append(RankMemory(r, n, st.params, st.grads + st.grad_accum, optimizer, int(acts), loss, buffers,
                                   host))
    return out_rows


def peak_rank(shape: ModelShape, plan) -> RankMemory:
    """The fullest pipeline rank: whether the layout fits is decided there."""
    return max(rank_memory(shape, plan), key=lambda r: r.total)
