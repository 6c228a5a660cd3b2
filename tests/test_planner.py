"""The planner at scale: the pipeline's stages and schedules, the network as the mesh places it, the
closed-form bounds against the step model, the search on Llama 3 405B, and commands that run."""
from __future__ import annotations

import dataclasses
import json
import math
import os
import random
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from labkit.memory import MODELS
from labkit.planning import bounds
from labkit.planning import collectives as C
from labkit.planning import pipeline_model as pm
from labkit.planning.choose import choose_strategy
from labkit.planning.commands import degrees, refused
from labkit.planning.hardware import hardware
from labkit.planning.published import compare, runs, spread
from labkit.planning.search import search, why
from labkit.planning.stage_memory import layer_params, peak_rank, rank_memory
from labkit.planning.step_model import Plan, groups, layer_compute, predict, step_time

ROOT = Path(__file__).resolve().parents[1]
H100 = hardware("h100-80gb")


def _torch_peak(cls, p: int, v: int, m: int, layers: list[int], rank: int) -> int:
    """Layer-micro-batches in flight at rank's peak, by torch's own schedule generator."""
    from torch.distributed.pipelining.schedules import _ComputationType as T

    o = cls.__new__(cls)  # the generator needs no process group: the schedule's fields only
    o.pp_group_size, o.n_local_stages, o._n_microbatches = p, v, m
    o.number_of_rounds = max(1, m // p)
    o.microbatches_per_round = m // o.number_of_rounds
    o.num_stages = o._num_stages = p * v
    o.rank = rank
    live = peak = 0
    for a in o._calculate_single_rank_operations(rank):
        if a is None:
            continue
        if a.computation_type == T.FORWARD:
            live += layers[a.stage_index]
        elif a.computation_type in (T.FULL_BACKWARD, T.BACKWARD_WEIGHT):
            live -= layers[a.stage_index]
        peak = max(peak, live)
    return peak


def test_in_flight_follows_torchs_own_schedules():
    """The memory model's in-flight activations replay torch.distributed.pipelining's order (torch
    2.13's generators), chunk by chunk, with uneven chunks."""
    from torch.distributed.pipelining import schedules as S

    rng = random.Random(0)
    for p, v, m in [(2, 2, 4), (4, 2, 8), (4, 3, 8), (4, 4, 16), (8, 2, 16), (4, 2, 10), (8, 4, 8), (4, 2, 6)]:
        layers = [rng.randint(0, 5) for _ in range(p * v)]
        for r in range(p):
            assert pm.in_flight(r, p, m, "interleaved", layers) == _torch_peak(
                S.ScheduleInterleaved1F1B, p, v, m, layers, r), (p, v, m, r)
    for p, m in [(2, 4), (4, 8), (4, 16), (8, 16), (4, 4)]:
        layers = [rng.randint(1, 5) for _ in range(2 * p)]
        for r in range(p):
            assert pm.in_flight(r, p, m, "zbv", layers) == _torch_peak(S.ScheduleZBVZeroBubble, p, 2, m, layers, r)
    assert [pm.in_flight(r, 4, 8, "1f1b", [3] * 4) for r in range(4)] == [12, 9, 6, 3]  # min(p - r, m) x layers
    assert pm.in_flight(0, 4, 8, "gpipe", [3] * 4) == 24


def test_the_interleaved_first_rank_holds_korthikantis_layers():
    """Korthikanti et al. 2022, section 4.2.3: L (1 + (p-1)/(pv)) layers' worth on the first stage."""
    for p, v in ((4, 2), (8, 2), (4, 4)):
        L = 2 * p * v
        assert pm.in_flight(0, p, 4 * p, "interleaved", [L // (p * v)] * (p * v)) == L * (1 + (p - 1) / (p * v))


def test_llama3s_stages_split_and_the_interleaved_warm_up_holds_every_micro_batch():
    """Section 3.3.2: one layer fewer on the first and last stage, the first chunk only the embedding."""
    layers = pm.chunk_layers(126, 128, 1, 1)
    assert layers[0] == layers[-1] == 0 and set(layers[1:-1]) == {1}
    assert pm.chunk_layers(126, 16, 1, 1) == [7] + [8] * 14 + [7]
    # 16 micro-batches through 8 chunks: the warm-up (140 forwards on rank 1) exceeds the 128 a step has
    assert pm.interleaved_warmup(1, 16, 8, 16) == 140 and pm.in_flight(1, 16, 16, "interleaved", layers) == 128


def test_llama3s_layout_fits_the_h100_with_elementwise_recomputation_only():
    """The chapter's reading of "without activation checkpointing": no matmul recomputed, but the
    norms and the SwiGLU product are, or the fullest rank (1: full chunks, longest warm-up) is over."""
    run = next(r for r in runs() if r.name == "Llama 3 405B, 16,384 GPUs, 8k")
    none, sel = (peak_rank(run.shape, dataclasses.replace(run.plan, recompute=rc)) for rc in ("none", "selective"))
    assert none.rank == 1 and none.total > 80e9 > sel.total
    first = rank_memory(run.shape, run.plan)[0]
    assert first.layers == 7 and first.total < none.total  # the lighter first stage


def test_all_to_all_sends_what_leaves_the_node_through_its_own_nic():
    one = 1e9
    inside = C.all_to_all(H100, C.group(8, 1, 8), one)
    assert inside == pytest.approx(H100.base_latency_s + H100.node.step_latency_s + 7 / 8 * one / 360e9)
    across = C.all_to_all(H100, C.group(64, 1, 8), one)  # 8 ranks a node: 56/64 of a rank's bytes leave it
    assert across == pytest.approx(H100.base_latency_s + H100.network.step_latency_s + 56 / 64 * one / 45e9)
    ring = C.all_gather(H100, C.group(64, 1, 8), one)  # a ring spreads the same bytes over eight NICs
    assert across > 6 * ring


def test_groups_sit_where_the_mesh_puts_them():
    """TP fastest, then CP, the data ranks (EP's among FSDP's), their replicas, PP: with TP 8 an EP
    group has one rank a node, and its all-to-alls cross the network."""
    g = groups(Plan(tp=8, pp=2, dp=8, ep=8, zero=3), 8)
    assert (g["tp"].per_node, g["ep"].per_node, g["shard"].per_node) == (8, 1, 1) and g["pp_across"]
    mix = MODELS["mixtral-8x7b"]
    wide, narrow = (step_time(mix, Plan(tp=t, dp=64 // t, ep=8, global_batch=64, zero=3), H100)["expert_parallel"]
                    for t in (8, 1))
    assert wide > 3 * narrow


def test_fsdp_hides_what_compute_covers_and_shows_the_first_gather_and_last_scatter():
    """FSDP2 gathers a layer ahead and reduce-scatters behind (Zhao et al. 2023): with compute to spare
    the step exposes one gather in forward, one gather and one reduce-scatter in backward."""
    shape = MODELS["llama3-8b"]
    plan = Plan(dp=8, micro_batch=2, global_batch=16, zero=3)
    per_layer = layer_params(shape)[0]
    shard = C.group(8, 1, 8)
    edges = 2 * C.all_gather(H100, shard, 2 * per_layer) + C.reduce_scatter(H100, shard, 4 * per_layer)
    assert step_time(shape, plan, H100)["fsdp"] == pytest.approx(edges)
    off = step_time(shape, dataclasses.replace(plan, dp_overlap=False), H100)["fsdp"]
    assert off == pytest.approx(shape.n_layer * edges)
    short = step_time(dataclasses.replace(shape, seq_len=256), Plan(dp=64, global_batch=64, zero=3), H100)
    assert short["fsdp"] > 0.2 * short["total"]  # 256 tokens a rank cannot hide 64-way gathers


def _crossover(exposed, closed: float) -> float:
    lo, hi = closed / 16, closed * 16
    assert exposed(lo) > 0 >= exposed(hi)
    for _ in range(40):
        mid = math.sqrt(lo * hi)
        lo, hi = (mid, hi) if exposed(mid) > 0 else (lo, mid)
    return hi


def _data_parallel_exposed(what: str, tokens: float) -> float:
    shape = dataclasses.replace(MODELS["llama3-70b"], seq_len=max(1, int(tokens)))
    if what != "fsdp":
        return step_time(shape, Plan(dp=64, global_batch=64, zero=0 if what == "dp" else 1), H100)["data_parallel"]
    per_layer, shard = layer_params(shape)[0], C.group(64, 1, 8)
    edges = 2 * C.all_gather(H100, shard, 2 * per_layer) + C.reduce_scatter(H100, shard, 4 * per_layer)
    return step_time(shape, Plan(dp=64, global_batch=64, zero=3), H100)["fsdp"] - edges * 1.0001


def _tp_exposed(hidden: float) -> float:
    h = 64 * max(1, int(hidden / 64))
    shape = dataclasses.replace(MODELS["gpt3-175b"], hidden=h, heads=64, seq_len=4096)
    plan = Plan(tp=8, global_batch=1, dp=1, zero=0)
    lay = layer_compute(shape, plan, H100)
    return 4 * C.all_reduce(H100, C.group(8, 1, 8), 2 * shape.seq_len * h) - 3 * lay["backward_weight"]


def _cp_exposed(seq: float) -> float:
    shape = dataclasses.replace(MODELS["gpt3-175b"], seq_len=16 * max(1, int(seq / 16)))
    return step_time(shape, Plan(cp=8, tp=8, dp=1, global_batch=1, zero=3), H100)["context_parallel"]


def _ep_exposed(ffn: float) -> float:
    shape = dataclasses.replace(MODELS["mixtral-8x7b"], intermediate=64 * max(1, int(ffn / 64)))
    st = step_time(shape, Plan(dp=64, ep=64, global_batch=64, zero=3), H100)
    gemms = 18 * shape.hidden * shape.ffn * shape.experts_per_token * shape.seq_len / H100.matmul_flops
    return st["expert_parallel"] - shape.n_layer * gemms


@pytest.mark.parametrize("what", ["dp", "zero1", "fsdp", "tp", "cp", "ep"])
def test_each_closed_form_bound_is_the_step_models_crossover(what):
    """Each threshold of labkit.planning.bounds against the step model's own crossover, found by
    bisection. The closed forms leave out latencies, attention and element-wise work (more compute
    to hide behind, more time per collective), so each sits within a factor of 1.6 of the crossover
    where the bytes dominate (CP's with multi-head attention: grouped-query K and V are messages
    small enough for the ring's per-hop latency to move it further)."""
    l70 = MODELS["llama3-70b"]
    closed = {"dp": bounds.dp_tokens(H100, 64), "zero1": bounds.dp_tokens(H100, 64, 1),
              "fsdp": bounds.fsdp_tokens(H100, 64), "tp": bounds.tp_hidden(H100, 8),
              "cp": bounds.cp_tokens(H100, MODELS["gpt3-175b"], 8, stride=8), "ep": bounds.ep_ffn(H100, 64)}[what]
    exposed = {"tp": _tp_exposed, "cp": _cp_exposed, "ep": _ep_exposed}.get(
        what, lambda x: _data_parallel_exposed(what, x))
    exact = _crossover(exposed, closed)
    assert closed / 1.6 < exact < closed * 1.6, (what, closed, exact)


@pytest.mark.parametrize("gpus, measured", [(16384, 400), (8192, 430)])
def test_the_405b_search_finds_a_layout_at_three_quarters_of_what_meta_measured(gpus, measured):
    shape = MODELS["llama3-405b"]
    ranked = search(shape, H100, gpus, 2048 * shape.seq_len, 80)
    best = ranked[0]
    assert best.prediction["mfu"] * H100.peak_tflops >= 0.75 * measured
    assert best.plan.pp > 1 and best.plan.tp >= 4 and best.memory.total <= 0.9 * 80e9
    assert refused(best.plan, shape) is None and degrees(best.plan).world == gpus
    assert why(best, best) is None


def test_the_chooser_and_the_planner_rank_the_same_inputs_alike():
    shape = MODELS["llama2-13b"]
    rec = choose_strategy(shape, 64, 80, micro_batch=2, seq_len=4096, device="h100-80gb")
    ranked = search(shape, H100, 64, 2 * 64 * 4096, 80)
    assert [r.label for r in rec.ranked] == [r.label for r in ranked]
    assert [r.prediction["total"] for r in rec.ranked] == [r.prediction["total"] for r in ranked]


def test_every_prediction_prints_the_published_spread_of_its_kind():
    rows = compare()
    s = spread(Plan(tp=8, pp=16, dp=128, zero=3), rows)
    assert s["same_kind"] and s["kind"] == "TP + PP + FSDP"
    assert set(s["runs"]) == {r["run"] for r in rows if r["kind"] == "TP + PP + FSDP"}
    assert s["low"] == min(r["error"] for r in rows if r["run"] in s["runs"])
    zero_bubble = spread(Plan(tp=4, pp=32, cp=4, dp=32, zero=3, schedule="zbv", chunks=2), rows)
    assert zero_bubble["n"] >= 1


def _printed_command(argv: list[str]) -> str:
    out = subprocess.run([sys.executable, "-m", "labkit.planning", "layouts", *argv], capture_output=True, text=True,
                         timeout=120, check=True, cwd=ROOT).stdout
    return next(line.strip() for line in out.splitlines() if line.strip().startswith("torchrun "))


def test_the_printed_command_runs_as_printed():
    """python -m labkit.planning layouts's run #1, pasted into a shell: a 4-stage pipeline a layer lighter at
    each end, trained on 4 CPU processes (the torchrun of the venv, as a reader who activated it)."""
    command = _printed_command(["--family", "gpt", "--hidden", "64", "--layers", "4", "--heads", "4", "--vocab",
                                "256", "--seq-len", "512", "--devices", "4", "--global-batch", "4k", "--device-gb",
                                "0.004", "--train-device", "cpu"])
    argv = shlex.split(command)
    assert argv[argv.index("--pp") + 1] == "4" and "--pp-first-stage-less-layers" in argv, command
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}", "OMP_NUM_THREADS": "1",
           "PYTHONWARNINGS": "ignore"}
    proc = subprocess.run(command, shell=True, capture_output=True, text=True, timeout=300, env=env, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert re.search(r"mesh on 4 rank\(s\): steps 0\.\.20, loss \d+\.\d+ -> \d+\.\d+", proc.stdout), proc.stdout


def test_the_memory_cli_prices_whole_steps(capsys):
    from labkit.planning.memory_cli import main

    assert main(["--model", "10b", "--devices", "192", "--tokens", "1e12", "--device-type", "h100-80gb",
                 "--json"]) == 0
    r = json.loads(capsys.readouterr().out)
    steps, seq = r["steps"], r["seq_len"]
    assert steps == math.ceil(1e12 / (r["global_batch"] * seq)) and r["global_batch"] == 192 * r["micro_batch"]
    step = r["recommendation"]["prediction"]["total"]
    assert r["price"]["hours"] == pytest.approx(steps * step / 3600)
    assert main(["--model", "10b", "--devices", "192", "--tokens", "1e12", "--device-type", "h100-80gb"]) == 0
    out = capsys.readouterr().out
    assert "ranked for 1 x 2,048-token sequence(s) per device, 192 a step" in out
    assert f"{steps:,} steps of 192 x 2,048 tokens" in out and "--steps " in out and "torchrun --nnodes 24" in out


def test_a_prediction_within_a_thousandth_is_the_same_and_why_says_nothing():
    shape = MODELS["llama3-8b"]
    a, b = (search(shape, H100, 8, 64 * shape.seq_len, 80)[i] for i in (0, 1))
    if b.prediction["total"] <= a.prediction["total"] * 1.001:
        assert why(a, b) is None
    else:
        assert why(a, b)


def test_every_plan_predicts_finite_parts():
    shape = MODELS["llama3-70b"]
    for plan in (Plan(tp=8, pp=4, dp=2, global_batch=32, schedule="zbv", chunks=2, first_less=1, last_less=1),
                 Plan(tp=8, pp=4, dp=2, global_batch=32, schedule="interleaved", chunks=5),
                 Plan(dp=64, global_batch=64, zero=3, offload=True, recompute="full")):
        p = predict(shape, plan, H100)
        assert all(math.isfinite(v) and v >= 0 for v in p.values()), plan
