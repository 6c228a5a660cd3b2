"""The step-time model held against runs on this machine's CPU: five layouts trained, each predicted.

The calibration and the prediction are :mod:`labkit.planning.cpu_model`'s; this module runs the
layouts (it sits above :mod:`labkit.train`) for the strategy_cost lab.
"""
from __future__ import annotations

from dataclasses import asdict, replace
from typing import Any

from labkit.core.model import GPTConfig
from labkit.launch import launch
from labkit.memory.architecture import ModelShape
from labkit.planning.cpu_model import calibrate_on_rank, combine, counted_operators, cpu_hardware, measured_step
from labkit.planning.step_model import Plan, predict
from labkit.train import TrainConfig, train_many


# The layouts the lab predicts: name -> (ranks, labkit.train fields, the step model's Plan of them
# for a batch of B sequences). Plans are built by :func:`_plan` once B is known.
LAYOUTS = {
    "DDP 2": (2, {"strategy": "ddp"}, {"dp": 2, "zero": 0}),
    "FSDP 2": (2, {"strategy": "fsdp"}, {"dp": 2, "zero": 3}),
    "TP 2": (2, {"strategy": "mesh", "tp": 2}, {"tp": 2}),
    "PP 2 (1F1B, 4 micro-batches)": (2, {"strategy": "mesh", "pp": 2, "microbatches": 4}, {"pp": 2, "mb": 4}),
    "FSDP 2 x TP 2": (4, {"strategy": "mesh", "tp": 2, "dp_shard": 2}, {"tp": 2, "dp": 2, "zero": 3}),
}


def _plan(spec: dict, batch: int) -> Plan:
    dp, mb = spec.get("dp", 1), spec.get("mb", 1)
    # fp32, eager element-wise ops, no FlashAttention on a CPU; one core per rank: nothing overlaps
    return Plan(tp=spec.get("tp", 1), pp=spec.get("pp", 1), dp=dp, zero=spec.get("zero", 1),
                micro_batch=batch // (dp * mb), global_batch=batch, value_bytes=4, fused=False, flash=False,
                dp_overlap=False)


def _calibrate_and_train(configs: list[TrainConfig], model_cfg: GPTConfig) -> tuple[dict, list[dict]]:
    cal = calibrate_on_rank()
    return cal, train_many(configs, model_cfg)


def predict_layouts(model_cfg: GPTConfig, batch: int, steps: int) -> dict[str, Any]:
    """Calibrate on two CPU ranks, train each of :data:`LAYOUTS` for ``steps`` steps on ``batch``
    sequences, and predict each one's step from the calibration and the operators it counted.
    Returns ``calibration`` and ``rows``: per layout the measured and predicted step (ms), the error
    and the prediction's parts."""
    base = TrainConfig(steps=steps, batch_size=batch, seed=0, device="cpu")
    by_world: dict[int, list[str]] = {}
    for name, (world, _, _) in LAYOUTS.items():
        by_world.setdefault(world, []).append(name)
    results: dict[str, dict] = {}
    cal: dict[str, Any] = {}
    for world, names in sorted(by_world.items()):
        configs = [replace(base, **LAYOUTS[n][1]) for n in names]
        if not cal:
            per_rank = launch(_calibrate_and_train, configs, model_cfg, world_size=world, device="cpu", quiet=True)
            cal, runs = combine([c for c, _ in per_rank]), per_rank[0][1]
        else:
            runs = launch(train_many, configs, model_cfg, world_size=world, device="cpu", quiet=True)[0]
        results.update(zip(names, runs))
    shape = ModelShape.from_gpt_config(model_cfg)
    rows = []
    for name, (world, _, spec) in LAYOUTS.items():
        plan, run, hw = _plan(spec, batch), results[name], cpu_hardware(cal, world)
        # the slowest rank's prediction (a pipeline's last stage); its own measured step
        preds = [(predict(shape, plan, hw, counted_operators(r, plan.microbatches)), r) for r in run["ranks"]]
        pred, rank = max(preds, key=lambda pr: pr[0]["total"])
        measured = measured_step(run)
        rows.append({"layout": name, "ranks": world, "measured_ms": 1e3 * measured,
                     "predicted_ms": 1e3 * pred["total"], "error": pred["total"] / measured - 1,
                     "parts_ms": {k: 1e3 * v for k, v in pred.items() if k not in ("tokens_per_s_per_device", "mfu")},
                     "operators": asdict(counted_operators(rank, plan.microbatches))})
    return {"calibration": cal, "rows": rows}
