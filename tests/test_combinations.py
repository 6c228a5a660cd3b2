"""Every combination the validation accepts, held to one process (issue 45).

The layouts (each dimension alone on 4 ranks, and the composed ones the labs use on 4) against every
setting that changes numerics: the precisions, FSDP2's bf16 parameters (--fsdp-bf16), the pipeline
schedules, recomputation and sequence parallelism. Each combination either trains with finite losses
within its bar of one process in the same precision, or is refused in one line before any rank
starts (:func:`labkit.train.validate.validate`). Toy size, 3 steps: one 4-rank launch runs them all
(tests/test_mesh.py holds the 8-rank grid for 10 steps, resumed and resharded).

The first combination it caught: pipeline stages with bf16 FSDP parameters trained on garbage and
exited 0 (issue 45, item 6: loss 0.0000 with --fsdp-bf16, NaN with --precision bf16 as well).
"""
from __future__ import annotations

import math
from dataclasses import replace

import pytest

from combination_fns import each
from labkit.core.model import GPTConfig
from labkit.launch import launch
from labkit.train import TrainConfig, train
from labkit.train.validate import validate

WORLD, STEPS = 4, 3
MODEL = GPTConfig(n_layer=4, n_head=4, n_embd=32, block_size=16)  # 4 layers: a V of 2 ranks has 4 stages
MOE = replace(MODEL, moe_experts=4, moe_top_k=2)
BASE = TrainConfig(strategy="mesh", steps=STEPS, batch_size=8, lr=3e-3, count_comm="none")
LAYOUTS = {"dp_replicate 4": (dict(dp_replicate=4), MODEL), "dp_shard 4": (dict(dp_shard=4), MODEL),
           "tp 4": (dict(tp=4), MODEL), "pp 4": (dict(pp=4), MODEL), "cp 4": (dict(cp=4), MODEL),
           "ep 4": (dict(dp_shard=4, ep=4), MOE), "hsdp 2x2": (dict(dp_replicate=2, dp_shard=2), MODEL),
           "pp2 dp_shard2": (dict(pp=2, dp_shard=2), MODEL), "tp2 dp_shard2": (dict(tp=2, dp_shard=2), MODEL),
           "pp2 tp2": (dict(pp=2, tp=2), MODEL),  # the composing lab's layout on 4 GPUs (fit_layout)
           "cp2 dp_shard2": (dict(cp=2, dp_shard=2), MODEL), "ep2 dp_shard4": (dict(ep=2, dp_shard=4), MOE)}
FP32, BF16 = 1e-5, 2e-2  # fp32: measured under 1e-6 over 3 steps; bf16 autocast sums in other orders
# setting -> (TrainConfig fields, the precision of its one-process twin, its bar)
SETTINGS = {
    "fp32": ({}, "fp32", FP32),
    "bf16": (dict(precision="bf16"), "bf16", BF16),
    "fp16": (dict(precision="fp16"), "fp16", BF16),
    "fp8": (dict(precision="fp8"), "fp8", BF16),
    # FSDP2's bf16 parameters compute every layer in bf16, and without autocast the GPT's loss over
    # bf16 logits is itself a bf16 number (1/32 apart near 5): fp32's "vs 16-bit" bar
    "fsdp_bf16": (dict(fsdp_bf16=True), "bf16", 5e-2),
    "fsdp_bf16 + bf16": (dict(fsdp_bf16=True, precision="bf16"), "bf16", BF16),
    "recompute full": (dict(activation_checkpointing="full"), "fp32", FP32),
    "recompute selective": (dict(activation_checkpointing="selective"), "fp32", FP32),
    "sequence parallel": (dict(sequence_parallel=True), "fp32", FP32),
}
SCHEDULES = ("gpipe", "interleaved", "zb", "zbv", "dualpipev")  # 1f1b, the default, is every row above


def _rows() -> dict[str, tuple]:
    """name -> (the TrainConfig's fields, model, twin precision, bar)."""
    rows = {}
    for layout, (degrees, model) in LAYOUTS.items():
        micro = {"microbatches": 4} if degrees.get("pp", 1) > 1 else {}
        for setting, (fields, twin, bar) in SETTINGS.items():
            rows[f"{layout} | {setting}"] = ({**degrees, **micro, **fields}, model, twin, bar)
        if micro:
            for schedule in SCHEDULES:
                for setting in ("fp32", "fsdp_bf16 + bf16"):
                    fields, twin, bar = SETTINGS[setting]
                    rows[f"{layout} | {setting} | {schedule}"] = ({**degrees, **micro, **fields,
                                                                    "pp_schedule": schedule}, model, twin, bar)
    return rows


ROWS = _rows()


@pytest.fixture(scope="module")
def combos() -> dict[str, dict]:
    """Each row refused (its one-line error, before any rank starts) or run; the runs in one launch."""
    out, accepted = {}, {}
    for name, (fields, model, twin, bar) in ROWS.items():
        try:
            cfg = replace(BASE, **fields)  # TrainConfig's own checks, then the plan's
            validate(cfg, model, WORLD)
        except ValueError as e:
            out[name] = {"refused": str(e)}
            continue
        accepted[name] = (cfg, model)
    runs = launch(each, list(accepted.values()), world_size=WORLD, timeout=900, quiet=True)[0]
    refs: dict = {}
    for (name, (cfg, model)), run in zip(accepted.items(), runs):
        twin = ROWS[name][2]
        if (twin, model) not in refs:
            refs[twin, model] = train(replace(BASE, strategy="single", precision=twin), model)["loss"]
        out[name] = {**run, "ref": refs[twin, model]}
    return out


@pytest.mark.parametrize("name", list(ROWS))
def test_every_combination_trains_as_one_process_or_is_refused_in_one_line(combos, name):
    got, bar = combos[name], ROWS[name][3]
    if "refused" in got:
        assert got["refused"] and "\n" not in got["refused"], (name, got["refused"])
        return
    assert "error" not in got, (name, got["error"])
    loss, ref = got["loss"], got["ref"]
    assert len(loss) == STEPS and all(math.isfinite(x) for x in loss), (name, loss)
    dev = max(abs(a - b) for a, b in zip(loss, ref))
    assert dev < bar, (name, f"max |loss - one process| {dev:.2e}, bar {bar:g}", loss, ref)


def test_what_is_refused_is_what_cannot_run():
    """The validation refuses what labkit does not implement or what would do nothing, and no more: every
    layout trains in fp32; --fsdp-bf16 where no rank shards and sequence parallelism without tensor
    parallelism are refused (accepted, they trained as something else)."""
    from labkit.parallel.layout.mesh import Degrees

    refused = {}
    for name, (fields, model, *_) in ROWS.items():
        try:
            validate(replace(BASE, **fields), model, WORLD)
        except ValueError as e:
            refused[name] = str(e)
    assert not [n for n in refused if n.endswith("| fp32")], refused
    for name, (fields, *_) in ROWS.items():
        d = Degrees(**LAYOUTS[name.split(" | ")[0]][0])
        if fields.get("fsdp_bf16") and d.tokens == 1 and "pp_schedule" not in fields:
            assert "fsdp_bf16=True has no effect" in refused[name], name
        if fields.get("sequence_parallel") and d.tp == 1:
            assert "sequence_parallel=True has no effect with tp=1" in refused[name], name
