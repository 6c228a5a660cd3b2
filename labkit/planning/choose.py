"""Which strategy: the cheapest configuration whose per-device memory, from the calculator, fits.

Candidates are tried in order of what they cost beyond plain data parallelism. Sharding the
optimizer states and gradients (ZeRO-1/2) moves the same 2 Psi per step as DDP's all-reduce;
selective recomputation re-runs only the attention-score ops; sharding the parameters (ZeRO-3 /
FSDP) moves 3 Psi (Rajbhandari et al. 2020, section 7); full recomputation adds a forward pass
(~33% more compute); optimizer offload (Ren et al. 2021) moves the optimizer step to the CPU;
tensor parallelism (Shoeybi et al. 2019) adds all-reduces inside every layer and needs a fast
intra-node link. The decision is made on bytes, not on a parameter count alone.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from labkit.core.checks import positive_int
from labkit.memory.calculator import GB, MemoryEstimate, estimate_memory, model_shape
from labkit.planning.accelerators import accelerator
from labkit.planning.cost import price_run, training_flops, training_hours

# (label, stage, recompute, offload, tp, pp). "selective" is Korthikanti et al.'s: recompute the
# attention scores, which fused attention (the calculator's default) never stores anyway.
CANDIDATES = [
    ("DDP", 0, "none", False, 1, 1),
    ("ZeRO-1", 1, "none", False, 1, 1),
    ("ZeRO-2 (FSDP SHARD_GRAD_OP)", 2, "none", False, 1, 1),
    ("ZeRO-2 + selective recompute", 2, "selective", False, 1, 1),
    ("ZeRO-3 / FSDP", 3, "none", False, 1, 1),
    ("ZeRO-3 / FSDP + selective recompute", 3, "selective", False, 1, 1),
    ("ZeRO-3 / FSDP + full recompute", 3, "full", False, 1, 1),
    ("ZeRO-3 / FSDP + full recompute + optimizer offload", 3, "full", True, 1, 1),
    ("TP=2 + SP + ZeRO-3 + full recompute", 3, "full", False, 2, 1),
    ("TP=4 + SP + ZeRO-3 + full recompute", 3, "full", False, 4, 1),
    ("TP=8 + SP + ZeRO-3 + full recompute", 3, "full", False, 8, 1),
    ("TP=8 + PP=2 (1F1B) + ZeRO-1 + full recompute", 1, "full", False, 8, 2),
    ("TP=8 + PP=4 (1F1B) + ZeRO-1 + full recompute", 1, "full", False, 8, 4),
    ("TP=8 + PP=8 (1F1B) + ZeRO-1 + full recompute", 1, "full", False, 8, 8),
]


@dataclass(frozen=True)
class Option:
    label: str
    estimate: MemoryEstimate
    usable_bytes: int

    @property
    def fits(self) -> bool:
        return self.estimate.total <= self.usable_bytes


@dataclass(frozen=True)
class Recommendation:
    strategy: str | None
    reason: str
    options: list[Option]
    rule_of_thumb: str

    @property
    def rule_fits(self) -> bool:
        """Whether the rule of thumb's choice (as configured by the rule, no recompute) fits."""
        return any(o.fits for o in self.options if o.label == _RULE_LABEL[self.rule_of_thumb])


_RULE_LABEL = {"DDP": "DDP", "FSDP": "ZeRO-3 / FSDP", "ZeRO-3": "ZeRO-3 / FSDP"}


def rule_of_thumb(n_params: float, device_memory_gb: float) -> str:
    """The common heuristic: fits on one GPU -> DDP; 7B-70B -> FSDP; 70B+ -> ZeRO-3.

    "Fits" is judged the way it usually is, on mixed-precision Adam model states (16 bytes per
    parameter), ignoring activations.
    """
    if 16 * n_params <= device_memory_gb * GB:
        return "DDP"
    return "FSDP" if n_params < 70e9 else "ZeRO-3"


def _gb(x: int) -> str:
    return f"{x / GB:.1f} GB"


def choose_strategy(model, n_devices: int, device_memory_gb: float = 80.0, micro_batch: int = 1,
                    seq_len: int | None = None, precision: str = "mixed", devices_per_node: int = 8,
                    headroom: float = 0.1) -> Recommendation:
    """Recommend the first candidate that fits in ``(1 - headroom)`` of device memory, and why.

    ``headroom`` keeps room for temporaries, communication buffers and allocator fragmentation,
    which the calculator does not model.
    """
    if not 0 <= headroom < 1:
        raise ValueError(f"headroom must be in [0, 1), got {headroom!r}")
    positive_int("n_devices", n_devices)
    shape = model_shape(model)
    usable = int(device_memory_gb * GB * (1 - headroom))
    options = []
    for label, stage, recompute, offload, tp, pp in CANDIDATES:
        if tp > min(devices_per_node, n_devices) or n_devices % (tp * pp) or pp > shape.n_layer:
            continue
        est = estimate_memory(shape, micro_batch, n_devices, stage, precision, recompute, tp,
                              sequence_parallel=tp > 1, device_memory_gb=device_memory_gb,
                              offload_optimizer=offload, seq_len=seq_len, pp=pp)
        options.append(Option(label, est, usable))
    rule = rule_of_thumb(shape.n_params, device_memory_gb)
    first = next((o for o in options if o.fits), None)
    base = options[0].estimate
    why_base = (f"DDP would need {_gb(base.total)} per device: model states "
                f"{_gb(base.params + base.grads + base.optimizer)}, activations "
                f"{_gb(base.activations + base.head)}; usable {_gb(usable)}")
    if first is None:
        last = options[-1].estimate
        reason = (f"nothing fits on {n_devices} x {device_memory_gb:g} GB: even "
                  f"{options[-1].label} needs {_gb(last.total)} per device. Add devices, shorten "
                  f"sequences or use pipeline parallelism. {why_base}.")
        return Recommendation(None, reason, options, rule)
    e = first.estimate
    reason = (f"{first.label} needs {_gb(e.total)} of {_gb(usable)} usable per device "
              f"(params {_gb(e.params)}, grads {_gb(e.grads)}, optimizer {_gb(e.optimizer)}, "
              f"activations {_gb(e.activations + e.head)}"
              + (f"; optimizer states {_gb(e.host_bytes)} in host memory" if e.host_bytes else "")
              + ")" + ("" if first is options[0] else f". {why_base}"))
    return Recommendation(first.label, reason, options, rule)


def min_devices(model, stage: int, recompute: str = "none", device_memory_gb: float = 80.0,
                micro_batch: int = 1, precision: str = "mixed", headroom: float = 0.1,
                step: int = 8, limit: int = 65536) -> int | None:
    """Fewest devices (a multiple of ``step``) on which a ZeRO ``stage`` fits; None if none up to ``limit``."""
    usable = device_memory_gb * GB * (1 - headroom)
    n = step
    while n <= limit:
        if estimate_memory(model, micro_batch, n, stage, precision, recompute,
                           device_memory_gb=device_memory_gb).total <= usable:
            return n
        if stage in (0,):  # nothing is sharded: more devices never help
            return None
        n *= 2
    return None


def price_strategies(model, tokens: float, device_names: list[str], mfu: float = 0.4,
                     target_days: float = 30.0, stages: dict[str, int] | None = None) -> list[dict]:
    """For each device type and ZeRO stage: the fewest devices that fit, the devices a deadline
    needs (a multiple of 8), and the run's time and price there (:func:`labkit.cost.price_run`)."""

    stages = stages or {"DDP": 0, "ZeRO-1": 1, "ZeRO-2 / FSDP SHARD_GRAD_OP": 2,
                        "ZeRO-3: FSDP FULL_SHARD or DeepSpeed ZeRO-3": 3}
    n_params = model_shape(model).n_params
    flops = training_flops(n_params, tokens)
    rows = []
    for name in device_names:
        dev = accelerator(name)
        gpu_hours = training_hours(flops, 1, dev.peak_bf16_tflops, mfu)
        deadline = math.ceil(gpu_hours / (24 * target_days) / 8) * 8
        for label, stage in stages.items():
            need = min_devices(model, stage, device_memory_gb=dev.memory_gb)
            row = {"device": name, "strategy": label, "min devices (memory)": need or "never fits",
                   "devices": None, "days": None, "on-demand $M": None, "spot $M": None}
            if need is not None:
                n = max(need, deadline)
                c = price_run(n_params, tokens, n, name, mfu)
                row.update({"devices": n, "days": round(c.hours / 24, 1),
                            "on-demand $M": round(c.cost_on_demand / 1e6, 2), "spot $M": round(c.cost_spot / 1e6, 2)})
            rows.append(row)
    return rows
