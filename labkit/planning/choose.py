"""Which strategy: the planner's own ranking, for a question asked without a global batch.

``python -m labkit.planning memory`` asks "``n`` devices, this micro-batch: what should I run?". That is the
planner's question (:func:`labkit.planning.search.search`) with the batch it implies: ``micro_batch``
sequences per device, ``micro_batch x n`` a step. The chooser asks the search, so the two give the
same ranking for the same inputs; every layout is priced by the one step model
(:mod:`labkit.planning.step_model`) and the fullest pipeline rank's memory
(:mod:`labkit.planning.stage_memory`), and every one is a run ``labkit.train`` starts as printed.

Beside it, a popular rule of thumb (:func:`rule_of_thumb`) is evaluated the same way, as the rule
configures it (all devices data parallel, no recomputation, the micro-batch asked): whether it fits,
and how much slower its step is than the planner's first choice. The rules the strategy chapter
teaches (shard only what does not fit; tensor parallelism inside a node when the gradients would
cross slow links; pipelines across nodes when the batch bounds data parallelism) are what this
ranking comes to, case by case, not rules it follows.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, replace

from labkit.core.checks import positive_int
from labkit.core.units import duration, size
from labkit.memory.calculator import GB, model_shape
from labkit.planning.accelerators import accelerator
from labkit.planning.commands import train_args
from labkit.planning.cost import price_run
from labkit.planning.hardware import hardware
from labkit.planning.search import Ranked, label, search
from labkit.planning.stage_memory import RankMemory, peak_rank
from labkit.planning.step_model import Plan, predict


@dataclass(frozen=True)
class Recommendation:
    strategy: str | None  # the first layout's label; None when nothing fits
    reason: str
    ranked: list[Ranked]  # every layout that fits, fastest first (the planner's search)
    rule_of_thumb: str
    rule: Ranked  # the rule's layout, evaluated whether it fits or not
    usable_bytes: int

    @property
    def chosen(self) -> Ranked | None:
        return self.ranked[0] if self.ranked else None

    @property
    def rule_fits(self) -> bool:
        return self.rule.memory.total <= self.usable_bytes

    def rule_slowdown(self) -> float | None:
        """How much longer a step takes with the rule's layout than with the first (None if it does not fit)."""
        if not self.rule_fits or self.chosen is None:
            return None
        return self.rule.prediction["total"] / self.chosen.prediction["total"] - 1


def rule_of_thumb(n_params: float, device_memory_gb: float) -> str:
    """The common heuristic: fits on one GPU -> DDP; 7B-70B -> FSDP; 70B+ -> ZeRO-3.

    "Fits" is judged the way it usually is, on mixed-precision Adam model states (16 bytes per
    parameter), ignoring activations.
    """
    if 16 * n_params <= device_memory_gb * GB:
        return "DDP"
    return "FSDP" if n_params < 70e9 else "ZeRO-3"


def _gb(x: float) -> str:
    return size(x)


def _parts(m: RankMemory) -> str:
    return (f"params {_gb(m.params)}, grads {_gb(m.grads)}, optimizer {_gb(m.optimizer)}, activations "
            f"{_gb(m.activations + m.loss + m.buffers)}" + (f"; optimizer states {_gb(m.host)} in host memory"
                                                            if m.host else ""))


def choose_strategy(model, n_devices: int, device_memory_gb: float = 80.0, micro_batch: int = 1,
                    seq_len: int | None = None, devices_per_node: int = 8, headroom: float = 0.1,
                    device: str | None = None) -> Recommendation:
    """The planner's ranking for ``micro_batch`` sequences per device on ``n_devices`` ``device``s
    (a key of :data:`labkit.planning.hardware.HARDWARE`, default the H100) with ``device_memory_gb``
    each, ``headroom`` of it kept for temporaries, communication buffers and fragmentation; the
    rule of thumb's layout beside it; and why, in one paragraph."""
    if not 0 <= headroom < 1:
        raise ValueError(f"headroom must be in [0, 1), got {headroom!r}")
    positive_int("n_devices", n_devices)
    positive_int("micro_batch", micro_batch)
    shape = model_shape(model)
    if seq_len is not None:
        shape = replace(shape, seq_len=positive_int("seq_len", seq_len))
    hw = replace(hardware(device or "h100-80gb"), devices_per_node=devices_per_node)
    usable = int(device_memory_gb * GB * (1 - headroom))
    ranked = search(shape, hw, n_devices, micro_batch * n_devices * shape.seq_len, device_memory_gb, headroom)
    rule = rule_of_thumb(shape.n_params, device_memory_gb)
    plan = Plan(dp=n_devices, micro_batch=micro_batch, global_batch=micro_batch * n_devices,
                zero=0 if rule == "DDP" else 3)
    rule_ranked = Ranked(plan, label(plan), predict(shape, plan, hw), peak_rank(shape, plan), train_args(plan, shape))
    base = peak_rank(shape, Plan(dp=n_devices, micro_batch=micro_batch, global_batch=micro_batch * n_devices, zero=0))
    why_base = f"DDP would need {_gb(base.total)} per device ({_parts(base)}); usable {_gb(usable)}"
    if not ranked:
        reason = (f"nothing fits on {n_devices} x {device_memory_gb:g} GB at {micro_batch} x {shape.seq_len} tokens "
                  f"a device: add devices, shorten sequences or lower the micro-batch. {why_base}.")
        return Recommendation(None, reason, ranked, rule, rule_ranked, usable)
    best = ranked[0]
    nxt = next((r for r in ranked[1:] if r.prediction["total"] > best.prediction["total"] * 1.001), None)
    reason = (f"{best.label} needs {_gb(best.memory.total)} of {_gb(usable)} usable per device ({_parts(best.memory)}), "
              f"a step of about {duration(best.prediction['total'])} for {micro_batch * n_devices} sequences of "
              f"{shape.seq_len} (predicted MFU {best.prediction['mfu']:.0%})"
              + (f"; next: {nxt.label}, {duration(nxt.prediction['total'])}" if nxt else "")
              + ("" if base.total <= usable else f". {why_base}"))
    return Recommendation(best.label, reason, ranked, rule, rule_ranked, usable)


def min_devices(model, stage: int, recompute: str = "none", device_memory_gb: float = 80.0,
                micro_batch: int = 1, headroom: float = 0.1, step: int = 8, limit: int = 65536) -> int | None:
    """Fewest devices (``step`` doubled) on which plain data parallelism at ZeRO ``stage`` fits (the
    planner's memory, :func:`labkit.planning.stage_memory.peak_rank`); None if none up to ``limit``."""
    shape, usable = model_shape(model), device_memory_gb * GB * (1 - headroom)
    n = step
    while n <= limit:
        plan = Plan(dp=n, micro_batch=micro_batch, global_batch=micro_batch * n, zero=stage, recompute=recompute)
        if peak_rank(shape, plan).total <= usable:
            return n
        if stage == 0:  # nothing is sharded: more devices never help
            return None
        n *= 2
    return None


STAGES = {"DDP": 0, "ZeRO-1": 1, "ZeRO-2 / FSDP SHARD_GRAD_OP": 2, "ZeRO-3: FSDP FULL_SHARD or DeepSpeed ZeRO-3": 3}


def price_strategies(model, tokens: float, device_names: list[str], global_batch: int, target_days: float = 30.0,
                     stages: dict[str, int] | None = None) -> list[dict]:
    """For each device type and ZeRO stage of plain data parallelism: the fewest devices that fit, the
    devices (that number doubled until the run fits ``target_days``) by the step model at a global
    batch of ``global_batch`` sequences, its predicted MFU, and the run's time and price there
    (:func:`labkit.planning.cost.price_run` with the predicted hours)."""
    shape = model_shape(model)
    steps = math.ceil(tokens / (global_batch * shape.seq_len))
    rows = []
    for name in device_names:
        dev, hw = accelerator(name), hardware(name)
        for lab, stage in (stages or STAGES).items():
            need = min_devices(shape, stage, device_memory_gb=dev.memory_gb)
            row = {"device": name, "strategy": lab, "min devices (memory)": need or "never fits", "devices": None,
                   "MFU": None, "days": None, "on-demand $M": None, "spot $M": None}
            n, p = need, None
            while n is not None and n <= global_batch:
                p = predict(shape, Plan(dp=n, global_batch=global_batch, zero=stage), hw)
                if steps * p["total"] <= 24 * 3600 * target_days:
                    break
                n *= 2
            if p is not None and n <= global_batch:
                c = price_run(shape.n_params, tokens, n, name, hours=steps * p["total"] / 3600)
                row.update({"devices": n, "MFU": round(p["mfu"], 3), "days": round(c.hours / 24, 1),
                            "on-demand $M": round(c.cost_on_demand / 1e6, 2), "spot $M": round(c.cost_spot / 1e6, 2)})
            rows.append(row)
    return rows
