"""The CPU calibration of the step-time model, and the published-memory comparison: exact parts."""
from __future__ import annotations

import pytest
import torch

from labkit.comm.counter import CommCounter
from labkit.memory import MODELS
from labkit.memory.calculator import activation_bytes_per_layer
from labkit.planning.cpu_model import combine, counted_operators, cpu_hardware, gloo_link
from labkit.planning.published import compare_memory, memory_runs
from labkit.planning.stage_memory import peak_rank
from labkit.planning.step_model import Operators


def _rows(op: str, alpha: float, beta: float) -> list[dict]:
    return [{"op": op, "bytes": b, "time_us": 1e6 * (alpha + beta * b)} for b in (1 << 10, 1 << 16, 1 << 22)]


def test_gloo_link_solves_start_up_and_step_latency_from_the_two_fits():
    # all-reduce on two ranks: base + 2 steps; all-gather: base + 1 step
    link = gloo_link(_rows("all_reduce", 500e-6, 1e-9) + _rows("all_gather", 300e-6, 5e-10))
    assert link["step_latency_s"] == pytest.approx(200e-6, rel=1e-6)
    assert link["base_latency_s"] == pytest.approx(100e-6, rel=1e-6)
    assert link["busbw_gb_per_s"] == pytest.approx(1.0, rel=1e-6)


def test_calibration_takes_the_fastest_operators_and_the_slowest_rates_and_shares_cores():
    cal = {"op_s": 2e-5, "dtensor_op_s": 9e-5, "matmul_flops": 9e10, "bytes_per_s": 2e10, "base_latency_s": 1e-4,
           "step_latency_s": 2e-4, "busbw_gb_per_s": 1.0, "ranks": 2, "cores": 2}
    slow_rank = {**cal, "op_s": 4e-5, "matmul_flops": 5e10}
    both = combine([slow_rank, cal])
    assert both["op_s"] == 2e-5 and both["matmul_flops"] == 5e10
    two, four = cpu_hardware(both, 2), cpu_hardware(both, 4)
    assert four.op_overhead_s == 2 * two.op_overhead_s and four.matmul_flops == two.matmul_flops / 2
    assert four.node.step_latency_s == 2 * two.node.step_latency_s


def test_the_counter_counts_operators_apart_from_collectives():
    x = torch.ones(4, requires_grad=True)
    with CommCounter() as c:
        (x * 2).sum().backward()
    assert c.ops["plain"] >= 3 and c.ops["dtensor"] == 0 and not c.calls


def test_counted_operators_split_the_step_into_micro_batches_and_the_optimizer():
    run = {"operators_per_step": [None, {"total": {"plain": 1000, "dtensor": 40}, "fwd_bwd": {"plain": 800, "dtensor": 8}}]}
    assert counted_operators(run, 4) == Operators(micro_batch=200, micro_batch_dtensor=2, step=200, step_dtensor=32)
    with pytest.raises(ValueError, match="count_comm"):
        counted_operators({"operators_per_step": [None]}, 1)


def test_torchtitans_op_policy_keeps_the_input_odd_matmuls_and_attention_output():
    l8 = MODELS["llama3-8b"]
    h, kv, f, a = l8.hidden, l8.n_kv_heads * l8.d_head, l8.ffn, l8.heads
    per_token = activation_bytes_per_layer(1, 1, h, a, recompute="op", dtype_bytes=2, kv_dim=kv, ffn=f, swiglu=True)
    # input h; q (h), v (kv), gate (ffn), down (h); attention output h: bf16; log-sum-exp fp32 per head
    assert per_token == 2 * (h + h + kv + f + h + h) + 4 * a
    full = activation_bytes_per_layer(1, 1, h, a, recompute="none", dtype_bytes=2, kv_dim=kv, ffn=f, swiglu=True,
                                      dropout=False, flash_attention=True)
    assert per_token < full / 2


def test_published_memory_is_predicted_below_the_reserved_peak_and_its_parts_add_up():
    rows = compare_memory()
    assert [r["devices"] for r in rows] == [8, 128]
    for r in rows:
        assert -0.15 < r["error"] < 0  # live tensors under what the caching allocator reserved
    eight, many = (peak_rank(r.shape, r.plan) for r in memory_runs())
    assert eight.total == eight.params + eight.grads + eight.optimizer + eight.activations + eight.loss + eight.buffers
    assert eight.states == pytest.approx(16 * many.states, rel=0.01)
    assert eight.activations == many.activations and eight.loss == many.loss
