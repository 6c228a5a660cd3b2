"""Where the memory goes: a calculator for model states and activations, per device.

* Model states follow ZeRO (Rajbhandari et al. 2020, section 3 and Figure 1): mixed-precision
  Adam keeps 2 bytes/parameter of 16-bit weights, 2 of 16-bit gradients and K = 12 of optimizer
  state (fp32 master weights, momentum, variance). Stage 1 shards the optimizer states over N ranks,
  stage 2 the gradients too, stage 3 the parameters too.
* Activations follow Korthikanti et al. 2022, "Reducing Activation Recomputation in Large
  Transformer Models", section 4, generalised in :mod:`labkit.memory.activations` (re-exported
  here): bytes per layer, times the layers, plus the head.

Measurement lives in :mod:`labkit.memory.probe`; ``python -m labkit.planning memory`` prints a breakdown.
"""
from __future__ import annotations

import math
import os
from dataclasses import asdict, dataclass, field
from fractions import Fraction

from labkit.core.checks import at_most, one_of, positive_count, positive_number
from labkit.memory.activations import POLICIES, RECOMPUTE, activation_bytes_per_layer, autocast_extra_bytes_per_layer
from labkit.memory.architecture import MODELS, ModelShape, expert_params
from labkit.memory.hf_config import shape_from_hf_config

GB = 10**9  # the ZeRO paper's GB; GiB is 2**30
STAGES = (0, 1, 2, 3)
# Bytes per parameter of Adam training, (weights, gradients, optimizer states), by precision recipe.
BYTES_PER_PARAM = {
    "mixed": (2, 2, 12),  # 16-bit weights and grads; fp32 master + m + v (ZeRO's K = 12)
    "fp32": (4, 4, 8),  # the weights are their own master copy; m and v in fp32
    "bf16": (2, 2, 4),  # pure bf16 training: no master copy, m and v in bf16
    "fp32_master": (4, 4, 12),  # fp32 weights plus a separate fp32 master copy (DeepSpeed's ZeRO)
}


def _count(name: str, value) -> int:  # counts here may come as floats: 1e9 parameters
    return positive_count(name, value, accept_float=True)


__all__ = ["GB", "POLICIES", "RECOMPUTE", "activation_bytes_per_layer", "autocast_extra_bytes_per_layer",
           "estimate_memory", "model_shape", "model_state_breakdown", "zero_model_state_bytes"]


def _stage(stage) -> int:
    return one_of("stage", stage, STAGES, "ZeRO stages")


def zero_model_state_bytes(n_params: int, world_size: int, stage: int, k: float = 12) -> int:
    """Per-device bytes of mixed-precision Adam model states under ZeRO stage 0-3.

    (2+2+K)Psi, 4Psi + K Psi/N, 2Psi + (2+K)Psi/N, (2+2+K)Psi/N, rounded up to whole bytes.
    """
    psi, n = _count("n_params", n_params), _count("world_size", world_size)
    if not (isinstance(k, (int, float)) and k > 0):
        raise ValueError(f"k (optimizer bytes per parameter) must be positive, got {k!r}")
    k = Fraction(k)
    total = {0: (4 + k) * psi, 1: 4 * psi + k * psi / n, 2: 2 * psi + (2 + k) * psi / n,
             3: (4 + k) * psi / n}[_stage(stage)]
    return math.ceil(total)


@dataclass(frozen=True)
class ModelStates:
    params: int
    grads: int
    optimizer: int
    grad_accum: int = 0  # an fp32 gradient-accumulation buffer, when kept

    @property
    def total(self) -> int:
        return self.params + self.grads + self.optimizer + self.grad_accum


def model_state_breakdown(n_params: int, world_size: int = 1, stage: int = 0,
                          precision: str = "mixed", fp32_grad_accum: bool = False) -> ModelStates:
    """Per-device parameter, gradient and optimizer-state bytes (Adam) for a precision and stage."""
    psi, n = _count("n_params", n_params), _count("world_size", world_size)
    one_of("precision", precision, BYTES_PER_PARAM, "precisions")
    stage = _stage(stage)
    w, g, o = BYTES_PER_PARAM[precision]

    def shard(bytes_per_param: int, sharded: bool) -> int:
        return math.ceil(Fraction(bytes_per_param * psi, n if sharded else 1))

    return ModelStates(params=shard(w, stage >= 3), grads=shard(g, stage >= 2),
                       optimizer=shard(o, stage >= 1),
                       grad_accum=shard(4, stage >= 2) if fp32_grad_accum else 0)


def model_shape(model) -> ModelShape:
    """A ``ModelShape`` from a name in ``MODELS``, a Hugging Face ``config.json`` path (or a folder
    holding one), a ``GPTConfig``, a parameter count or a shape."""
    if isinstance(model, ModelShape):
        return model
    if hasattr(model, "n_embd") and hasattr(model, "n_layer"):
        return ModelShape.from_gpt_config(model)
    if isinstance(model, (int, float)) and not isinstance(model, bool):
        return ModelShape.from_n_params(model)
    if isinstance(model, (str, os.PathLike)) and model not in MODELS and (
            str(model).endswith(".json") or os.path.isdir(model)):
        return shape_from_hf_config(model)
    if model not in MODELS:
        raise ValueError(f"model={model!r} is unknown; valid models: {sorted(MODELS)}, "
                         "a GPTConfig, a ModelShape or a parameter count, or a Hugging Face config.json path")
    return MODELS[model]


class DeviceBudget:
    """What an estimate with a ``total`` and the ``device_bytes`` it must fit in says about fitting."""

    total: int
    device_bytes: int

    @property
    def fits(self) -> bool:
        return self.total <= self.device_bytes

    @property
    def margin(self) -> int:
        """Bytes to spare (positive) or missing (negative) on each device."""
        return self.device_bytes - self.total


@dataclass(frozen=True)
class MemoryEstimate(DeviceBudget):
    """Per-device bytes of one training configuration, and whether it fits."""

    model: str
    world_size: int
    stage: int
    precision: str
    recompute: str
    tp: int
    offload_optimizer: bool
    params: int
    grads: int
    optimizer: int
    activations: int
    head: int  # final LayerNorm input and output, and the log-softmax of the logits
    device_bytes: int
    host_bytes: int = 0  # optimizer states moved to CPU memory by offload
    parts: dict = field(default_factory=dict)

    @property
    def total(self) -> int:
        return self.params + self.grads + self.optimizer + self.activations + self.head

    def to_dict(self) -> dict:
        return {**asdict(self), "total": self.total, "fits": self.fits, "margin": self.margin}


def estimate_memory(model, micro_batch: int = 1, world_size: int = 1, stage: int = 0,
                    precision: str = "mixed", recompute: str = "none", tp: int = 1,
                    sequence_parallel: bool = False, device_memory_gb: float = 80.0,
                    offload_optimizer: bool = False, flash_attention: bool = True,
                    dropout: bool | None = None, seq_len: int | None = None, pp: int = 1, cp: int = 1,
                    ep: int = 1, fused: bool = False) -> MemoryEstimate:
    """Whole-model, per-device estimate: model states, activations of every layer, and the head.

    Tensor parallelism divides the layer weights by ``tp`` and pipeline parallelism by ``pp``
    stages; ZeRO shards over the ``world_size / (tp * pp)`` data-parallel ranks. Under a 1F1B
    schedule the first stage holds ``pp`` micro-batches in flight for its ``L/pp`` layers, as many
    layer-activations as without pipelining (Narayanan et al. 2021; Korthikanti et al. 2022,
    section 4.2.3); the last stage holds the head. The head keeps the final LayerNorm's input and output
    and the fp32 log-softmax that cross-entropy saves (4 bytes of s*b*V/tp; a loop that also holds
    on to the logits keeps as much again). Activations are 4 bytes wide in fp32 training, 2 otherwise.

    Context parallelism over ``cp`` ranks gives each rank ``seq_len / cp`` tokens of every sequence,
    so every activation term falls by ``cp`` (Liu et al. 2023), the attention scores too (each rank
    keeps its ``s / cp`` queries against all ``s`` keys, not ``(s / cp)^2``); the parameters stay replicated over
    them, and ZeRO shards over all ``world_size / (tp * pp)`` ranks that hold copies. Expert
    parallelism over ``ep`` ranks divides the experts' parameters (and their gradients and optimizer
    states) by ``ep``; ZeRO then shards them over the ``world_size / (tp * pp * ep)`` ranks holding the
    same experts (:func:`parallel_parts`). A token routed to ``k`` experts keeps ``k`` MLPs' activations,
    the MLP's 19 of the 34 sbh of a layer (Korthikanti et al. 2022), hence ``1 + (k-1) 19/34``.
    ``fused``: element-wise kernels fused as Megatron-Core fuses them (:func:`activation_bytes_per_layer`).
    A pipeline stage by stage, schedule by schedule: :mod:`labkit.planning.stage_memory`.
    """
    shape = model_shape(model)
    world_size, tp, pp = _count("world_size", world_size), _count("tp", tp), _count("pp", pp)
    cp, ep = _count("cp", cp), _count("ep", ep)
    if world_size % (tp * pp * cp) or world_size % (tp * pp * ep):
        raise ValueError(f"tp={tp} x pp={pp} x cp={cp} (and x ep={ep}) must divide world_size={world_size}")
    if ep > 1 and shape.experts % ep:
        raise ValueError(f"ep={ep} must divide the model's {shape.experts} experts")
    if pp > shape.n_layer:
        raise ValueError(f"pp={pp} stages need at least {pp} layers; the model has {shape.n_layer}")
    at_most("device_memory_gb", positive_number("device_memory_gb", device_memory_gb), 1e6,
            "a million GB on one device")
    full_s = _count("seq_len", seq_len or shape.seq_len)
    if full_s % cp:
        raise ValueError(f"cp={cp} must divide seq_len={full_s}")
    s = full_s // cp  # this rank's tokens of every sequence
    states = parallel_parts(shape, world_size, stage, precision, tp, pp, ep)
    act_dtype = 4 if precision == "fp32" else 2
    dropout = shape.family == "gpt" if dropout is None else dropout  # LLaMA-style blocks have none
    block = dict(kv_dim=shape.n_kv_heads * shape.d_head, ffn=shape.ffn, swiglu=shape.family != "gpt", fused=fused)
    per_layer = activation_bytes_per_layer(s, micro_batch, shape.hidden, shape.heads, tp,
                                           sequence_parallel, recompute, act_dtype,
                                           dropout=dropout, flash_attention=flash_attention, kv_len=full_s, **block)
    if shape.experts_per_token > 1 and recompute != "full":
        per_layer = math.ceil(per_layer * (1 + Fraction(19 * (shape.experts_per_token - 1), 34)))
    layers = per_layer * shape.n_layer
    if recompute in ("full", "op"):  # backward re-materialises one layer at a time on top of what is kept
        layers += activation_bytes_per_layer(s, micro_batch, shape.hidden, shape.heads, tp, sequence_parallel,
                                             "none", act_dtype, dropout=dropout,
                                             flash_attention=flash_attention, kv_len=full_s, **block)
    micro_batch = _count("micro_batch", micro_batch)
    head = 2 * act_dtype * s * micro_batch * shape.hidden + math.ceil(4 * s * micro_batch * shape.vocab / tp)
    if pp > 1:  # the per-device peak: the first stage's in-flight layers, or the last stage's head
        last = math.ceil(layers / pp) + head
        layers, head = (layers, 0) if layers >= last else (last - head, head)
    name = str(model) if isinstance(model, (str, os.PathLike)) else "custom"
    optimizer, host = states.optimizer, 0
    if offload_optimizer:  # ZeRO-Offload (Ren et al. 2021): Adam states and step on the CPU
        optimizer, host = 0, states.optimizer
    return MemoryEstimate(name, world_size, stage, precision, recompute, tp, offload_optimizer,
                          states.params, states.grads, optimizer, layers, head,
                          int(device_memory_gb * GB), host,
                          parts={"activation_bytes_per_layer": per_layer, "seq_len": full_s, "seq_len_per_rank": s,
                                 "micro_batch": micro_batch, "n_params": shape.n_params, "cp": cp, "ep": ep})


def parallel_parts(shape, world_size: int, stage: int, precision: str, tp: int = 1, pp: int = 1,
                   ep: int = 1) -> ModelStates:
    """Model states per device: the dense weights split by ``tp x pp`` and sharded by ZeRO over the
    ``world_size / (tp x pp)`` ranks holding copies; the experts' weights further split by ``ep`` and
    sharded over the ``world_size / (tp x pp x ep)`` ranks holding the same experts."""
    experts = expert_params(shape) if ep > 1 else 0
    dp = world_size // (tp * pp)
    dense = model_state_breakdown(math.ceil((shape.n_params - experts) / (tp * pp)), dp, stage, precision)
    if not experts:
        return dense
    mine = model_state_breakdown(math.ceil(experts / (tp * pp * ep)), dp // ep, stage, precision)
    return ModelStates(*(getattr(dense, f) + getattr(mine, f) for f in ("params", "grads", "optimizer", "grad_accum")))

