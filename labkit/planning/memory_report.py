"""What ``python -m labkit.planning memory`` computes, before any printing: the per-stage bytes, the
recommendation, the price, and the same as one JSON-ready dict (``--json``).

Fine-tuning's recommendation (:func:`choose_finetune`) is the least sharded data-parallel layout
that fits in ``(1 - headroom)`` of device memory: DDP, then ZeRO-1, 2, 3 (FSDP), first with the
recomputation asked for, then with full recomputation (gradient checkpointing, which LoRA and QLoRA
recipes switch on); when none fits with the headroom, the least sharded that fits at all, marked
"tight". Full fine-tuning holds what pretraining holds, so the command line gives it pretraining's
:func:`labkit.planning.choose.choose_strategy` (tensor and pipeline parallelism, offload).
"""
from __future__ import annotations

from dataclasses import asdict, dataclass

from labkit.memory.calculator import GB, MemoryEstimate
from labkit.memory.finetune import FinetuneEstimate, estimate_finetune
from labkit.planning.stage_memory import RankMemory

STAGE_LABELS = {0: "DDP", 1: "ZeRO-1", 2: "ZeRO-2 (FSDP SHARD_GRAD_OP)", 3: "ZeRO-3 / FSDP"}
KINDS = FinetuneEstimate.KINDS  # frozen_weights, trained_weights, grads, optimizer, activations


@dataclass(frozen=True)
class FinetuneRecommendation:
    strategy: str | None
    reason: str
    estimate: FinetuneEstimate | None


def _gb(x: int) -> str:
    return f"{x / GB:.1f} GB"


def choose_finetune(model, mode: str, n_devices: int, device_memory_gb: float, recompute: str = "none",
                    headroom: float = 0.1, **kwargs) -> FinetuneRecommendation:
    """The least sharded layout whose fine-tuning fits in ``(1 - headroom)`` of device memory, and why;
    failing that, the least sharded that fits in all of it, marked "tight". ``kwargs`` go to
    :func:`labkit.memory.finetune.estimate_finetune` (rank, targets, micro_batch, ...)."""
    usable = int(device_memory_gb * GB * (1 - headroom))
    stages = (0,) if n_devices == 1 else (0, 1, 2, 3)  # on one device sharding changes nothing
    tried = []
    for rc in dict.fromkeys((recompute, "full")):
        for stage in stages:
            e = estimate_finetune(model, mode, world_size=n_devices, stage=stage, recompute=rc,
                                  device_memory_gb=device_memory_gb, **kwargs)
            label = ("one device" if n_devices == 1 else STAGE_LABELS[stage]) + (
                " + full recompute" if rc == "full" and recompute != "full" else "")
            tried.append((label, e))
    for label, e in tried:
        if e.total <= usable:
            return FinetuneRecommendation(label, f"{label} needs {_gb(e.total)} of {_gb(usable)} usable per device "
                                                 f"({_kinds(e)})", e)
    for label, e in tried:
        if e.fits:
            return FinetuneRecommendation(f"{label} (tight)", f"{label} needs {_gb(e.total)} per device ({_kinds(e)}): "
                                          f"it fits in {device_memory_gb:g} GB with {_gb(e.margin)} to spare, inside "
                                          f"the {headroom:.0%} kept for temporaries and fragmentation (QLoRA's paged "
                                          "optimizer moves optimizer states to host memory under such spikes)", e)
    label, e = tried[-1]
    return FinetuneRecommendation(None, f"nothing fits on {n_devices} x {device_memory_gb:g} GB: even {label} "
                                        f"needs {_gb(e.total)} per device (usable {_gb(usable)}). Add devices, "
                                        "shorten sequences, lower the rank or quantise the base.", None)


def _kinds(e: FinetuneEstimate) -> str:
    return ", ".join(f"{k.replace('_', ' ')} {_gb(getattr(e, k))}" for k in KINDS)


def bytes_by_kind(e) -> dict:
    """The five kinds for a fine-tuning estimate, a pretraining ``MemoryEstimate`` or a planned layout's
    fullest rank (:class:`labkit.planning.stage_memory.RankMemory`; nothing frozen)."""
    if isinstance(e, MemoryEstimate):
        return {"frozen_weights": 0, "trained_weights": e.params, "grads": e.grads, "optimizer": e.optimizer,
                "activations": e.activations + e.head}
    if isinstance(e, RankMemory):
        return {"frozen_weights": 0, "trained_weights": e.params, "grads": e.grads, "optimizer": e.optimizer,
                "activations": e.activations + e.loss + e.buffers}
    return e.bytes_by_kind()


def report(plan: dict, args) -> dict:
    """The JSON of ``--json``: the model and devices, bytes per device by kind for every ZeRO stage, whether
    the recommendation fits and its bytes by kind (or the most sharded stage's when nothing fits), the
    recommendation, and the price when ``--tokens`` was given."""
    shape, rec, ft = plan["shape"], plan["recommendation"], plan["finetune"]
    stages = [{"stage": s, "bytes_per_device": bytes_by_kind(e), "total": sum(bytes_by_kind(e).values()),
               "fits": e.fits} for s, e in enumerate(plan["stages"])]
    if isinstance(rec, FinetuneRecommendation):
        chosen = rec.estimate
    else:
        chosen = rec.chosen.memory if rec.chosen is not None else None
    kinds = bytes_by_kind(chosen if chosen is not None else plan["stages"][-1])
    first = plan["stages"][0]
    return {
        "model": plan["name"], "n_params": shape.n_params, "n_active_params": shape.active_params,
        "shape": asdict(shape), "devices": args.devices,
        "device": {"type": args.device_type, "name": plan["device_name"], "memory_gb": plan["memory_gb"]},
        "micro_batch": args.micro_batch, "seq_len": first.parts["seq_len"], "recompute": args.recompute,
        "global_batch": args.micro_batch * args.devices, "steps": plan["steps"],
        "finetune": ft, "precision": first.precision,
        "lora": ({"rank": first.rank, "targets": list(first.targets), "trainable_params": first.trainable_params}
                 if ft in ("lora", "qlora") else None),
        "stages": stages, "fits": rec.strategy is not None, "bytes_per_device": kinds,
        "total_bytes_per_device": sum(kinds.values()),
        "recommendation": {"strategy": rec.strategy, "reason": rec.reason,
                           "rule_of_thumb": getattr(rec, "rule_of_thumb", None),
                           "rule_fits": getattr(rec, "rule_fits", None),
                           "prediction": rec.chosen.prediction if getattr(rec, "chosen", None) else None},
        "price": asdict(plan["price"]) if plan["price"] is not None else None,
    }
