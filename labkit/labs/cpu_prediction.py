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


COMM = ("tensor_parallel", "fsdp", "data_parallel", "pipeline_p2p")


def calibration_line(pred: dict[str, Any]) -> str:
    """What the calibration measured, in one line."""
    cal = pred["calibration"]
    return (f"calibrated on {cal['ranks']} ranks, {cal['cores']} cores: matmul {cal['matmul_flops'] / 1e9:.0f} GFLOP/s, "
            f"copy {cal['bytes_per_s'] / 1e9:.1f} GB/s, {cal['op_s'] * 1e6:.0f} us per operator, "
            f"{cal['dtensor_op_s'] * 1e6:.0f} us per DTensor operator, gloo all-reduce "
            f"{cal['all_reduce_alpha_s'] * 1e6:.0f} us + {1 / cal['busbw_gb_per_s']:.2f} ns/B")


def table(pred: dict[str, Any]):
    """The lab's table: measured and predicted step per layout, the error, and the predicted step's
    shares (arithmetic, operators, communication and bubble), as a DataFrame."""
    import pandas as pd

    rows = []
    for r in pred["rows"]:
        parts, total = r["parts_ms"], r["predicted_ms"]
        rows.append({"layout (CPU, gloo)": r["layout"], "ranks": r["ranks"], "measured ms": r["measured_ms"],
                     "predicted ms": total, "error %": 100 * r["error"],
                     "arithmetic %": 100 * parts["compute"] / total,
                     "operators %": 100 * (parts["overhead"] + parts["optimizer"]) / total,
                     "communication + bubble %": 100 * (sum(parts[k] for k in COMM) + parts["bubble"]) / total})
    return pd.DataFrame(rows)


def figure(pred: dict[str, Any]):
    """The predicted parts of each layout's step as stacked bars, the measured step as a dot."""
    import matplotlib.pyplot as plt
    import numpy as np

    fig, ax = plt.subplots(figsize=(7, 3.4))
    parts = [("compute", "arithmetic"), ("overhead", "operators (forward, backward)"),
             ("optimizer", "optimizer step"), ("comm", "communication"), ("bubble", "bubble")]
    rows = pred["rows"]
    left, y = np.zeros(len(rows)), np.arange(len(rows))[::-1]
    for i, (key, label) in enumerate(parts):
        vals = np.array([sum(r["parts_ms"][k] for k in COMM) if key == "comm" else r["parts_ms"][key] for r in rows])
        ax.barh(y, vals, left=left, color=f"C{i}", label=label)
        left += vals
    ax.scatter([r["measured_ms"] for r in rows], y, color="k", zorder=3, label="measured")
    ax.set_yticks(y, [r["layout"] for r in rows], fontsize=8)
    ax.set(xlabel="ms per step (2 CPU cores, gloo; not a GPU figure)",
           title="The step-time model on this machine: predicted parts, measured step")
    ax.legend(fontsize=7, loc="lower right")
    fig.tight_layout()
    return fig
