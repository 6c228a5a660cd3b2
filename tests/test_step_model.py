"""The step-time model, held against published runs, and the planner that ranks layouts with it."""
from __future__ import annotations

import dataclasses
import math
import shlex

import pytest

from labkit.memory import MODELS
from labkit.memory.architecture import ModelShape
from labkit.parallel.pipeline.timeline import bubble_formula
from labkit.planning import collectives as C
from labkit.planning import layouts_cli
from labkit.planning.hardware import HARDWARE, hardware
from labkit.planning.published import compare, megatron_flops, median_abs_error, runs
from labkit.planning.search import degrees, search
from labkit.planning.step_model import Operators, Plan, model_flops_per_token, predict, step_time

H100 = hardware("h100-80gb")
# Stated in the chapter and the closing note: the median error over every published run, and the worst.
MEDIAN_BOUND, WORST_BOUND = 0.10, 0.25


def test_the_model_predicts_published_runs_within_the_stated_bounds():
    rows = compare()
    for r in rows:
        print(f"{r['run']:34} {r['measured']:>8,.0f} {r['predicted']:>8,.0f} {r['error'] * 100:+6.1f}%")
    assert len(rows) == len(runs()) >= 15
    assert {r["source"] for r in rows} >= {"Narayanan et al. 2021, Table 1",
                                          "Dubey et al. 2024 (The Llama 3 Herd of Models), Table 4"}
    assert median_abs_error(rows) <= MEDIAN_BOUND, median_abs_error(rows)
    assert max(abs(r["error"]) for r in rows) <= WORST_BOUND
    for r in rows:  # a published MFU is never above 100% nor below a few percent
        assert 0.05 < r["mfu"] < 1.0, r


def test_megatron_equation_3_counts_four_passes_over_the_weights_plus_attention_and_logits():
    shape = runs()[0].shape
    s, l, h, V = shape.seq_len, shape.n_layer, shape.hidden, shape.vocab
    weights = 4 * 2 * 12 * l * h * h * s  # forward, recomputed forward and backward (2x), one sequence
    assert megatron_flops(shape, 1) == pytest.approx(weights * (1 + s / (6 * h) + V / (16 * l * h)))


def test_palm_convention_is_six_per_matmul_weight_plus_twelve_lhs():
    shape = MODELS["llama3-8b"]
    attention = 12 * shape.n_layer * shape.hidden * shape.seq_len
    norms = shape.hidden * (2 * shape.n_layer + 1)  # untied: the parameters less the embedding and the norms
    assert model_flops_per_token(shape) == 6 * (shape.n_params - shape.vocab * shape.hidden - norms) + attention
    assert model_flops_per_token(shape, causal=True) == model_flops_per_token(shape) - attention / 2


def test_a_tied_output_layer_still_multiplies_and_the_planner_counts_as_training_does():
    """GPT-2 ties its output layer to the token embedding: one V x h matrix among the parameters, two
    uses, and the output layer's 6 V h FLOPs per token (37% of GPT-2 small's) are model FLOPs all the
    same. The planner's MFU and the one training reports (labkit.planning.cost) count alike."""
    from labkit.planning.cost import flops_per_token

    tied = ModelShape.from_dims("gpt", 768, 12, 12, 50257, 1024)
    untied = ModelShape.from_dims("gpt", 768, 12, 12, 50257, 1024, tied=False)
    assert untied.n_params - tied.n_params == 50257 * 768
    assert model_flops_per_token(tied) == model_flops_per_token(untied)
    for causal in (False, True):
        assert model_flops_per_token(tied, causal) == flops_per_token(12, 768, 1024, 50257, causal=causal)
    moe = MODELS["mixtral-8x7b"]  # two of eight experts per token
    assert model_flops_per_token(moe) < 6 * moe.active_params + 12 * moe.n_layer * moe.hidden * moe.seq_len


def test_collectives_pay_latency_per_step_and_choose_the_tree_at_scale():
    inside = C.group(8, 1, 8)
    assert (inside.n, inside.per_node) == (8, 8)
    ring = C.all_reduce(H100, inside, 1e9)
    expected = 8.4e-6 + 14 * 3.4e-6 + 2 * 7 / 8 * 1e9 / 360e9
    assert ring == pytest.approx(expected)
    # reduce-scatter then all-gather move what one all-reduce moves, in the same steps
    assert C.reduce_scatter(H100, inside, 1e9) + C.all_gather(H100, inside, 1e9) == pytest.approx(ring + 8.4e-6)
    wide = C.group(8192, 8, 8)  # one rank per node: TP 8 inside
    assert (wide.per_node, wide.nodes) == (1, 8192)
    small = C.all_reduce(H100, wide, 1024)
    assert small < 2 * 8191 * 14e-6 / 10  # the tree's 2 log2(8192) network steps, not the ring's 16,382
    assert small > 2 * 13 * 14e-6
    # a ring across nodes with 8 ranks per node spreads its traffic over 8 NICs
    assert C.all_gather(H100, C.group(64, 1, 8), 1e9) < C.all_gather(H100, C.group(64, 8, 8), 1e9) / 4


def test_the_bubble_is_the_pipeline_formula_and_interleaving_shrinks_it():
    """(p-1)/v of a mean rank's micro-batch (Narayanan et al. 2021, section 2.2.2); with equal ranks
    (no output layer: a model whose head is negligible) the share of the pipeline is (p-1)/(vm+p-1)."""
    shape = dataclasses.replace(MODELS["llama3-70b"], vocab=8)
    base = Plan(tp=8, pp=4, dp=2, global_batch=32)
    for plan in (base, dataclasses.replace(base, schedule="interleaved", chunks=2)):
        parts = step_time(shape, plan, H100)
        pipeline = parts["total"] - parts["data_parallel"] - parts["optimizer"]
        assert parts["bubble"] / pipeline == pytest.approx(bubble_formula(plan.pp, plan.microbatches, plan.v),
                                                            rel=1e-3)
    one = step_time(MODELS["llama3-70b"], base, H100)["bubble"]
    two = step_time(MODELS["llama3-70b"], dataclasses.replace(base, schedule="interleaved", chunks=2), H100)["bubble"]
    assert two < one


def test_full_recomputation_repeats_the_forward_and_its_tensor_parallel_all_reduces():
    shape, plan = MODELS["llama3-70b"], Plan(tp=8, dp=1, global_batch=1)
    none, full = step_time(shape, plan, H100), step_time(shape, dataclasses.replace(plan, recompute="full"), H100)
    assert full["tensor_parallel"] == pytest.approx(none["tensor_parallel"] * 6 / 4)
    assert 1.25 < full["compute"] / none["compute"] < 1.4  # a forward is about a third of forward + backward


def test_fsdp_gathers_across_thousands_of_ranks_are_not_counted_as_hidden():
    shape = MODELS["llama3-405b"]
    parts = step_time(shape, Plan(tp=8, dp=2048, global_batch=2048, zero=3), H100)
    assert parts["fsdp"] > 0.1 * parts["total"]


def test_search_lists_only_layouts_that_fit_run_and_take_the_global_batch():
    shape = MODELS["llama3-70b"]
    ranked = search(shape, H100, 64, 256 * shape.seq_len, 80.0)
    assert ranked and all(r.memory_bytes <= 0.9 * 80e9 for r in ranked)
    times = [r.prediction["total"] for r in ranked]  # fastest first; within 0.1% the simpler layout
    assert all(b >= a - 1e-3 * times[0] for a, b in zip(times, times[1:]))
    assert times[0] <= min(times) * 1.001
    for r in ranked:
        p = r.plan
        assert p.devices == 64 and p.dp * p.micro_batch * p.microbatches == 256
        assert degrees(p).world == 64
    from labkit.train.cli import configs_from

    cfg, model = configs_from(ranked[0].train_args + ["--device", "cpu"])
    assert tuple(max(1, v) for v in (cfg.tp, cfg.pp, cfg.cp)) == (ranked[0].plan.tp, ranked[0].plan.pp, ranked[0].plan.cp)
    assert cfg.batch_size == 256 and model.block_size == shape.seq_len


def _documented_commands() -> list[list[str]]:
    lines = [ln.strip() for ln in layouts_cli.__doc__.splitlines()
             if ln.strip().startswith("python -m labkit.planning layouts ")]
    return [shlex.split(ln)[4:] for ln in lines]


def test_every_command_in_the_cli_header_runs_as_written(capsys):
    commands = _documented_commands()
    assert len(commands) == 4
    for argv in commands:
        assert layouts_cli.main(argv) == 0, argv
        out = capsys.readouterr().out
        assert "MFU" in out, (argv, out)
    assert layouts_cli.main(["--model", "llama3-405b", "--devices", "16384", "--global-batch", "16M"]) == 0
    out = capsys.readouterr().out
    assert "16,777,216 tokens a step (2,048 sequences of 8,192)" in out
    assert "run #1 (2048 nodes of 8):" in out and "torchrun --nnodes 2048" in out and "sbatch --nodes=2048" in out
    assert "--n-layer 126 --n-head 128 --n-embd 16384" in out and "note: labkit.train trains a GPT" in out
    assert "published runs of its kind" in out


@pytest.mark.parametrize("argv, message", [
    (["--global-batch", "lots"], "--global-batch='lots' must be a positive number of tokens"),
    (["--global-batch", "1000"], "must be a whole number of 8192-token sequences"),
    (["--devices", "0"], "--devices must be a positive integer"),
    (["--device-type", "tpu"], "invalid choice"),
])
def test_bad_input_is_one_line_and_exit_status_2(argv, message, capsys):
    with pytest.raises(SystemExit) as e:
        layouts_cli.main(argv)
    err = capsys.readouterr().err.strip()
    assert e.value.code == 2 and len(err.splitlines()) == 1 and message in err, err


def test_every_constant_names_its_source():
    for key, hw in HARDWARE.items():
        assert hw.source and hw.node.source and hw.network.source, key
        assert 0 < hw.matmul_efficiency <= 1 and 0 < hw.attention_efficiency <= 1 and 0 < hw.hbm_efficiency <= 1
        assert math.isfinite(predict(MODELS["llama3-8b"], Plan(dp=8, global_batch=8), hw)["mfu"])


def test_operator_overheads_and_value_width_enter_where_an_overhead_bound_cpu_run_needs_them():
    shape = MODELS["gpt2-124m"]
    plan = Plan(dp=2, micro_batch=4, global_batch=16, zero=0)
    slow = dataclasses.replace(H100, op_overhead_s=1e-5, dtensor_op_overhead_s=1e-4, base_latency_s=0.0)
    ops = Operators(micro_batch=1230, micro_batch_dtensor=10, step=600, step_dtensor=5)
    quiet, busy = step_time(shape, plan, slow), step_time(shape, plan, slow, ops=ops)
    assert quiet["overhead"] == 0 and busy["overhead"] == pytest.approx(2 * (1230 * 1e-5 + 10 * 1e-4))
    assert busy["optimizer"] - quiet["optimizer"] == pytest.approx(600 * 1e-5 + 5 * 1e-4)
    fp32 = step_time(shape, dataclasses.replace(plan, value_bytes=4), H100)
    assert fp32["compute"] > step_time(shape, plan, H100)["compute"]  # twice the bytes on the memory roof


def test_search_enumerates_zero_1_2_hsdp_and_expert_parallelism_and_each_runs_as_labkit_train_takes_it():
    from labkit.train.cli import configs_from

    l8 = MODELS["llama3-8b"]
    ranked = search(l8, H100, 64, 256 * l8.seq_len, 80.0)
    kinds = {(r.plan.zero, r.plan.replicas > 1) for r in ranked}
    assert {(0, False), (1, False), (2, False), (3, False), (3, True)} <= kinds
    for zero, strategy in ((1, "zero1"), (2, "zero2")):
        r = next(r for r in ranked if r.plan.zero == zero)
        assert r.train_args[:2] == ["--strategy", strategy] and configs_from(r.train_args)[0].strategy == strategy
    hsdp = next(r for r in ranked if r.plan.replicas > 1)
    cfg, _ = configs_from(hsdp.train_args)
    assert cfg.dp_replicate == hsdp.plan.replicas and cfg.dp_replicate * cfg.dp_shard * max(1, cfg.tp) == 64
    fsdp = next(r for r in ranked if r.plan.zero == 3 and r.plan.replicas == 1 and r.plan.tp == hsdp.plan.tp
                and r.plan.micro_batch == hsdp.plan.micro_batch and r.plan.recompute == hsdp.plan.recompute)
    assert hsdp.memory_bytes > fsdp.memory_bytes  # states sharded over one replica's ranks only
    mixtral = MODELS["mixtral-8x7b"]
    moe = search(mixtral, H100, 64, 1024 * mixtral.seq_len, 80.0)
    ep = next(r for r in moe if r.plan.ep > 1)
    cfg, _ = configs_from(ep.train_args)
    assert cfg.ep == ep.plan.ep and ep.prediction["expert_parallel"] > 0


def test_zero2_reduces_gradients_every_micro_batch_and_zero1_once():
    shape = MODELS["llama3-8b"]
    one, two = (Plan(dp=64, micro_batch=1, global_batch=64 * 8, zero=z, dp_overlap=False) for z in (1, 2))
    few = dataclasses.replace(two, global_batch=64)
    assert step_time(shape, two, H100)["data_parallel"] > step_time(shape, one, H100)["data_parallel"]
    assert step_time(shape, few, H100)["data_parallel"] == pytest.approx(step_time(shape, dataclasses.replace(
        one, global_batch=64), H100)["data_parallel"])  # one micro-batch: the same reduce-scatter and gather
