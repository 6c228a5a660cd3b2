"""Which strategy: of the configurations whose per-device memory (the calculator's) fits, the fastest.

Candidates are listed in order of what they give up, and the order breaks ties:

1. **DDP, ZeRO-1, ZeRO-2**: the same 2 Psi per step on the wire; ZeRO-1 and 2 shard optimizer
   states and gradients (Rajbhandari et al. 2020).
2. **ZeRO-3 / FSDP**: parameters sharded too, 3 Psi per step (section 7 of the paper).
3. **Gradient accumulation**: the same tokens per step in micro-batches of one, when activations are
   what does not fit; it costs nothing on the wire, and some efficiency of small matmuls.
4. **Full recomputation**: one more forward pass, a third more compute (Chen et al. 2016).
   **Context parallelism** (Liu et al. 2023) when the sequence is what does not fit: each rank holds
   1/cp of it, at the price of passing K and V round a ring every layer.
   **Expert parallelism** for mixture-of-experts models (Lepikhin et al. 2020): the experts' states
   divided over ranks, four all-to-alls of the routed tokens per layer.
5. **Tensor parallelism inside a node**, with sequence parallelism (Shoeybi et al. 2019; Korthikanti
   et al. 2022): four all-reduces of the activations per layer over NVLink.
6. **Pipeline stages across nodes** on top of TP=8 (Narayanan et al. 2021): the 1F1B bubble, with
   the replica's share of the global batch as its micro-batches.
7. **Optimizer offload** to host memory (Ren et al. 2021): gradients and parameters over PCIe every
   step, the slowest link; the last resort.

Composed with TP, PP, CP or EP, the data-parallel ranks replicate the model (DDP, stage 0) or shard it
with FSDP2 (stage 3), as the training loop composes them (:mod:`labkit.parallel.compose`); ZeRO-1 and
ZeRO-2 are DeepSpeed's, for pure data parallelism. Every candidate is a run ``labkit.train`` starts
as printed (:mod:`labkit.planning.candidates`), and one the loop would refuse for this model and
batch is never listed.

Korthikanti et al.'s selective recomputation is not a candidate: with fused attention, the
calculator's default, it recomputes what is never stored and changes no estimate. Among the
candidates that fit, the one with the smallest estimated step time wins
(:func:`labkit.planning.step_time.step_seconds`: compute and the communication backward cannot hide),
so that a candidate that fits with room to spare is not chosen over a faster one because it came first.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from labkit.core.checks import positive_int
from labkit.memory.calculator import GB, MemoryEstimate, estimate_memory, model_shape
from labkit.planning.accelerators import accelerator
from labkit.planning.candidates import CANDIDATES, Candidate, refusal
from labkit.planning.cost import price_run, training_flops, training_hours
from labkit.planning.step_time import step_seconds

HFU_ASSUMED = 0.4  # the chooser's step at a utilisation assumed, not predicted (labkit.planning.step_model predicts)


@dataclass(frozen=True)
class Option:
    label: str
    estimate: MemoryEstimate
    usable_bytes: int
    step: dict  # the estimated step time and its parts, in seconds (labkit.planning.step_time)
    candidate: Candidate | None = None

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
    def rule_option(self) -> Option | None:
        """The rule of thumb's choice as the rule configures it (no recompute, no accumulation)."""
        return next((o for o in self.options if o.label == _RULE_LABEL[self.rule_of_thumb]), None)

    @property
    def rule_fits(self) -> bool:
        return self.rule_option is not None and self.rule_option.fits

    @property
    def chosen(self) -> Option | None:
        return next((o for o in self.options if o.label == self.strategy), None)

    def train_args(self, n_devices: int, micro_batch: int) -> list[str] | None:
        """The flags of ``python -m labkit.train`` that run the recommendation (None when nothing fits)."""
        chosen = self.chosen
        return chosen.candidate.train_args(n_devices, micro_batch) if chosen is not None else None

    def rule_slowdown(self) -> float | None:
        """How much longer a step takes with the rule's choice than with this one (None if it does not fit)."""
        if not self.rule_fits or self.chosen is None:
            return None
        return self.rule_option.step["total"] / self.chosen.step["total"] - 1


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


def _options(shape, n_devices: int, device_memory_gb: float, micro_batch: int, seq_len: int | None,
             precision: str, devices_per_node: int, usable: int, device: str, hfu: float) -> list[Option]:
    options = []
    s = seq_len or shape.seq_len
    for c in CANDIDATES:
        if max(c.tp, c.cp, c.ep) > min(devices_per_node, n_devices) or (c.accumulate and micro_batch == 1):
            continue  # TP, rings and all-to-alls beyond NVLink; nothing to accumulate
        if (c.ep > 1 and shape.experts == 1) or refusal(c, shape, n_devices, micro_batch, s) is not None:
            continue  # expert parallelism is for a mixture of experts; what the loop would refuse
        mb = c.micro(micro_batch)
        est = estimate_memory(shape, mb, n_devices, c.stage, precision, c.recompute, c.tp,
                              sequence_parallel=c.tp > 1 and c.ep == 1, device_memory_gb=device_memory_gb,
                              offload_optimizer=c.offload, seq_len=seq_len, pp=c.pp, cp=c.cp, ep=c.ep)
        # Every candidate trains the same global batch, micro_batch sequences per device: a replica on
        # tp x pp x cp devices takes tp x pp x cp times as many, in micro-batches of mb
        t = step_seconds(shape, n_devices, c.rows(micro_batch), mb, s, c.stage, c.recompute, c.offload, c.tp, c.pp,
                         device, hfu, devices_per_node, c.cp, c.ep)
        label = c.label if not c.accumulate else f"{c.label} ({micro_batch} micro-batches of 1)"
        options.append(Option(label, est, usable, t, c))
    return options


def choose_strategy(model, n_devices: int, device_memory_gb: float = 80.0, micro_batch: int = 1,
                    seq_len: int | None = None, precision: str = "mixed", devices_per_node: int = 8,
                    headroom: float = 0.1, device: str | None = None, hfu: float = HFU_ASSUMED) -> Recommendation:
    """Recommend, of the candidates that fit in ``(1 - headroom)`` of device memory, the one with the
    smallest estimated step time (ties: the earlier candidate), and say why.

    ``headroom`` keeps room for temporaries, communication buffers and allocator fragmentation,
    which the calculator does not model. ``device`` (a key of ``ACCELERATORS``) sets the peak for the
    step-time estimate (default: the H100's) and ``hfu`` the share of it sustained on every FLOP run,
    recomputation included (hardware FLOPs utilisation, :mod:`labkit.planning.step_time`); only the
    ranking depends on them.
    """
    if not 0 <= headroom < 1:
        raise ValueError(f"headroom must be in [0, 1), got {headroom!r}")
    positive_int("n_devices", n_devices)
    positive_int("micro_batch", micro_batch)
    shape = model_shape(model)
    usable = int(device_memory_gb * GB * (1 - headroom))
    device = device or "h100-80gb"
    options = _options(shape, n_devices, device_memory_gb, micro_batch, seq_len, precision, devices_per_node,
                       usable, device, hfu)
    rule = rule_of_thumb(shape.n_params, device_memory_gb)
    fitting = [o for o in options if o.fits]
    best = min(fitting, key=lambda o: (round(o.step["total"], 4), options.index(o))) if fitting else None
    base = options[0].estimate
    why_base = (f"DDP would need {_gb(base.total)} per device: model states "
                f"{_gb(base.params + base.grads + base.optimizer)}, activations "
                f"{_gb(base.activations + base.head)}; usable {_gb(usable)}")
    if best is None:
        last = options[-1].estimate
        reason = (f"nothing fits on {n_devices} x {device_memory_gb:g} GB: even "
                  f"{options[-1].label} needs {_gb(last.total)} per device. Add devices, shorten "
                  f"sequences or use pipeline parallelism. {why_base}.")
        return Recommendation(None, reason, options, rule)
    e = best.estimate
    others = sorted((o for o in fitting if o is not best), key=lambda o: o.step["total"])
    reason = (f"{best.label} needs {_gb(e.total)} of {_gb(usable)} usable per device "
              f"(params {_gb(e.params)}, grads {_gb(e.grads)}, optimizer {_gb(e.optimizer)}, "
              f"activations {_gb(e.activations + e.head)}"
              + (f"; optimizer states {_gb(e.host_bytes)} in host memory" if e.host_bytes else "")
              + f"), about {best.step['total']:.2f} s a step"
              + (f" (next: {others[0].label}, {others[0].step['total']:.2f} s)" if others else "")
              + ("" if best is options[0] else f". {why_base}"))
    return Recommendation(best.label, reason, options, rule)


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
    needs (a multiple of 8), and the run's time and price there (:func:`labkit.planning.cost.price_run`)."""

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
