"""Fine-tuning's memory per device: full, LoRA (Hu et al. 2021) and QLoRA (Dettmers et al. 2023).

By kind, per device:

* **Frozen weights**, which get no gradient and no optimizer state. LoRA keeps the base in bf16,
  2 bytes/parameter. QLoRA stores the blocks' linear weights in 4-bit NormalFloat with double
  quantisation (Dettmers et al. 2023, section 3): 4 bits per weight, one 8-bit constant per block
  of 64 weights and one fp32 constant per 256 of those: 4 + 8/64 + 32/(64 x 256) = 4.127 bits,
  0.516 bytes/parameter. Embeddings, the output layer, norms, biases and MoE routers stay in bf16
  (bitsandbytes replaces the blocks' ``nn.Linear`` projections; QLoRA's code skips ``lm_head``).
* **Trained weights**: LoRA adds B A next to each targeted W (in -> out), A of r x in and B of out x r,
  r(in + out) parameters (Hu et al. 2021, section 4.1); full fine-tuning trains every parameter.
* **Gradients and optimizer states** of the trained weights, by recipe (weights, gradients,
  Adam states; bytes/parameter): ``"mixed"`` 2 + 2 + 12, bf16 adapters with an fp32 master and fp32
  moments (ZeRO's K = 12, the default for full and LoRA; peft's fp32 adapters, 4 + 4 + 8, total the
  same 16); ``"bf16_adam32"`` 2 + 2 + 8, QLoRA's code (adapters cast to bf16, ``paged_adamw_32bit``
  keeps fp32 moments and no master copy; the default for QLoRA). Any recipe of ``BYTES_PER_PARAM``
  also works.
* **Activations**: the calculator's (:func:`labkit.memory.calculator.estimate_memory`, Korthikanti
  et al. 2022). LoRA stores them as full training does: the adapters' gradients need the gradient
  of every layer above them, so backward runs through all the frozen layers. On top, per targeted
  projection, the r-wide ``x A`` that B's gradient needs (2 bytes x tokens x r) and, with LoRA
  dropout, the dropped-out input (2 bytes + a 1-byte mask per element); QLoRA also dequantises one
  weight at a time to bf16 for its matmul (the largest: 2 bytes x in x out).

ZeRO stages shard the trained states as in pretraining (stage 1 the optimizer, 2 the gradients,
3 the weights); the frozen base is sharded only at stage 3 (FSDP's FULL_SHARD shards every
parameter). Paged optimizers (QLoRA) move optimizer states to host memory only under memory spikes;
the estimate keeps them on the device, so "fits" holds without paging.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from fractions import Fraction

from labkit.core.checks import one_of, positive_int
from labkit.memory.architecture import ModelShape, linear_layers
from labkit.memory.calculator import BYTES_PER_PARAM, DeviceBudget, estimate_memory, model_shape

FINETUNE = ("full", "lora", "qlora")
TRAINED_BYTES = {**BYTES_PER_PARAM, "bf16_adam32": (2, 2, 8)}  # (weights, gradients, optimizer) per parameter
DEFAULT_PRECISION = {"full": "mixed", "lora": "mixed", "qlora": "bf16_adam32"}
NF4_BITS = Fraction(4) + Fraction(8, 64) + Fraction(32, 64 * 256)  # Dettmers et al. 2023, section 3
_ATTENTION, _MLP = ("q", "k", "v", "o", "qkv"), ("gate", "up", "down")


def lora_targets(model, targets="all") -> tuple[str, ...]:
    """The projections LoRA adapts: "all" (attention and MLP, QLoRA's choice), "attention", "mlp",
    or names (comma-separated or a list) of :func:`~labkit.memory.architecture.linear_layers`;
    ``transformers``' ``q_proj`` style is accepted, and q/k/v mean the fused qkv of a GPT."""
    shape = model_shape(model)
    names = list(linear_layers(shape))
    items = targets.split(",") if isinstance(targets, str) else list(targets)
    chosen = []
    for raw in items:
        t = str(raw).strip().lower().removesuffix("_proj")
        group = {"all": names, "attention": [n for n in names if n in _ATTENTION],
                 "mlp": [n for n in names if n in _MLP]}.get(t)
        if group is None and shape.family == "gpt" and t in ("q", "k", "v"):
            group = ["qkv"]
        if group is None and t in names:
            group = [t]
        if group is None:
            raise ValueError(f"lora target {str(raw).strip()!r} is unknown for a {shape.family}-family model; "
                             f"valid targets: {names}, all, attention, mlp")
        chosen += [n for n in group if n not in chosen]
    if not chosen:
        raise ValueError(f"lora targets={targets!r} names no projection; valid targets: {names}, all, attention, mlp")
    return tuple(n for n in names if n in chosen)


def lora_params(model, rank: int, targets="all") -> int:
    """Trainable LoRA parameters: r (in + out) per targeted projection, per expert, per layer."""
    shape, r = model_shape(model), positive_int("lora_rank", rank)
    lin = linear_layers(shape)
    chosen = lora_targets(shape, targets)
    too_big = [n for n in chosen if r > min(lin[n][:2])]
    if too_big:
        raise ValueError(f"lora_rank={r} exceeds the smaller side of {too_big[0]} ({min(lin[too_big[0]][:2])}): "
                         "a low-rank update needs r <= min(in, out)")
    return shape.n_layer * sum(r * (lin[n][0] + lin[n][1]) * lin[n][2] for n in chosen)


def linear_weight_params(shape: ModelShape) -> int:
    """Weights of the blocks' projections, the ones QLoRA quantises (no biases, routers, norms or embeddings)."""
    return shape.n_layer * sum(i * o * c for i, o, c in linear_layers(shape).values())


def frozen_weight_bytes(model, mode: str) -> int:
    """Bytes of the frozen base, whole (before any sharding): 0 for full fine-tuning, bf16 for LoRA,
    NF4 with double quantisation for QLoRA's projections and bf16 for the rest."""
    shape = model_shape(model)
    one_of("finetune", mode, FINETUNE, "modes")
    if mode == "full":
        return 0
    if mode == "lora":
        return 2 * shape.n_params
    linear = linear_weight_params(shape)
    return math.ceil(linear * NF4_BITS / 8) + 2 * (shape.n_params - linear)


def _lora_activation_bytes(shape: ModelShape, rank: int, targets, s: int, b: int, dropout: bool) -> int:
    """One layer's LoRA extras: x A (r wide) per target, and LoRA dropout's output and mask."""
    lin, total = linear_layers(shape), 0
    for name in targets:
        fan_in = lin[name][0]
        tokens = s * b * (shape.experts_per_token if name in _MLP else 1)  # a token runs through k experts
        total += 2 * tokens * rank + (3 * tokens * fan_in if dropout else 0)
    return total


@dataclass(frozen=True)
class FinetuneEstimate(DeviceBudget):
    """Per-device bytes of one fine-tuning configuration, by kind, and whether it fits."""

    model: str
    mode: str
    world_size: int
    stage: int
    rank: int | None
    targets: tuple
    precision: str
    recompute: str
    trainable_params: int
    frozen_weights: int
    trained_weights: int
    grads: int
    optimizer: int
    activations: int
    device_bytes: int
    parts: dict = field(default_factory=dict)

    KINDS = ("frozen_weights", "trained_weights", "grads", "optimizer", "activations")

    @property
    def total(self) -> int:
        return sum(getattr(self, k) for k in self.KINDS)

    def bytes_by_kind(self) -> dict:
        return {k: getattr(self, k) for k in self.KINDS}

    def to_dict(self) -> dict:
        return {**asdict(self), "total": self.total, "fits": self.fits, "margin": self.margin}


def estimate_finetune(model, mode: str = "lora", rank: int = 16, targets="all", micro_batch: int = 1,
                      world_size: int = 1, stage: int = 0, recompute: str = "none", seq_len: int | None = None,
                      device_memory_gb: float = 80.0, precision: str | None = None, lora_dropout: bool = False,
                      flash_attention: bool = True) -> FinetuneEstimate:
    """Per-device bytes of fine-tuning ``model`` on ``world_size`` data-parallel devices at ZeRO ``stage``.

    ``mode`` is "full", "lora" or "qlora"; ``rank`` and ``targets`` set the adapters (ignored for
    full); ``precision`` the trained weights' recipe (default: mixed for full and LoRA, bf16_adam32
    for QLoRA); ``lora_dropout`` counts the dropped-out inputs LoRA dropout keeps."""
    shape = model_shape(model)
    mode = one_of("finetune", mode, FINETUNE, "modes")
    precision = one_of("precision", precision or DEFAULT_PRECISION[mode], TRAINED_BYTES, "precisions")
    if mode == "full" and precision not in BYTES_PER_PARAM:
        raise ValueError(f"precision={precision!r} is unknown for full fine-tuning; valid: {list(BYTES_PER_PARAM)}")
    if mode != "full" and precision not in ("mixed", "bf16", "bf16_adam32"):
        raise ValueError(f"precision={precision!r}: LoRA and QLoRA run bf16 adapters over a bf16/NF4 base; "
                         "valid: ['mixed', 'bf16', 'bf16_adam32']")
    base = estimate_memory(shape, micro_batch, world_size, stage, "mixed" if mode != "full" else precision,
                           recompute, device_memory_gb=device_memory_gb, flash_attention=flash_attention,
                           seq_len=seq_len)
    n, s, b = base.world_size, base.parts["seq_len"], base.parts["micro_batch"]
    name = base.model
    if mode == "full":
        return FinetuneEstimate(name, mode, n, stage, None, (), precision, recompute, shape.n_params, 0, base.params,
                                base.grads, base.optimizer, base.activations + base.head, base.device_bytes,
                                {**base.parts, "head": base.head})
    chosen = lora_targets(shape, targets)
    trainable = lora_params(shape, rank, chosen)
    w, g, o = TRAINED_BYTES[precision]

    def shard(total, sharded: bool) -> int:
        return math.ceil(Fraction(total, n if sharded else 1))

    per_layer_lora = _lora_activation_bytes(shape, rank, chosen, s, b, lora_dropout)
    lora_acts = per_layer_lora * (1 if recompute == "full" else shape.n_layer)
    dequant = 2 * max(i * o_ for i, o_, _ in linear_layers(shape).values()) if mode == "qlora" else 0
    parts = {**base.parts, "head": base.head, "lora_activations": lora_acts, "dequantised_weight": dequant,
             "frozen_whole": frozen_weight_bytes(shape, mode), "bytes_per_trained_param": (w, g, o)}
    return FinetuneEstimate(name, mode, n, stage, rank, chosen, precision, recompute, trainable,
                            shard(parts["frozen_whole"], stage >= 3), shard(w * trainable, stage >= 3),
                            shard(g * trainable, stage >= 2), shard(o * trainable, stage >= 1),
                            base.activations + base.head + lora_acts + dequant, base.device_bytes, parts)

