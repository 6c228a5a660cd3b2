"""What every run measures: speed and MFU, peak memory, traces, and the collective counter kept out
of the timed steps when asked."""
import json

import pytest

from labkit.core.model import GPT, GPTConfig
from labkit.launch import launch
from labkit.planning.accelerators import ACCELERATORS, from_device_name
from labkit.planning.cost import flops_per_token
from labkit.train import TrainConfig, train

MODEL = GPTConfig(block_size=16)


def test_speed_keys_and_mfu_from_a_given_peak():
    r = train(TrainConfig(steps=4, peak_tflops=0.5), MODEL)
    tokens = 8 * 16
    assert r["tokens_per_s"] == pytest.approx(tokens / r["median_step_s"])
    assert r["model_tflops_per_s"] == pytest.approx(r["tokens_per_s"] * flops_per_token(2, 64, 16, 256) / 1e12)
    assert r["mfu"] == pytest.approx(r["model_tflops_per_s"] / 0.5)
    assert r["hfu"] == r["mfu"]  # no recomputation
    # the published convention (PaLM, Megatron-LM, torchtitan) counts every attention score
    assert r["mfu_palm"] / r["mfu"] == pytest.approx(flops_per_token(2, 64, 16, 256, causal=False)
                                                     / flops_per_token(2, 64, 16, 256))
    none = train(TrainConfig(steps=2), MODEL)
    assert none["mfu"] is None and none["peak_tflops"] is None  # a CPU has no datasheet peak here
    assert set(none["ranks"][0]["peak_memory_bytes"]) == {"allocated", "reserved", "process_max_rss"}
    full = train(TrainConfig(steps=3, peak_tflops=0.5, activation_checkpointing="full"), MODEL)
    assert full["hfu"] / full["mfu"] == pytest.approx(flops_per_token(2, 64, 16, 256, recompute="full")
                                                      / flops_per_token(2, 64, 16, 256))


def test_flops_per_token_is_6n_plus_causal_attention():
    L, h, s, V = 12, 768, 1024, 256
    assert flops_per_token(L, h, s, V) == 6 * (12 * L * h * h + V * h) + 6 * L * s * h
    assert flops_per_token(L, h, s, V, causal=False) - flops_per_token(L, h, s, V) == 6 * L * s * h
    n = GPT.count_params(GPTConfig(n_layer=L, n_embd=h, n_head=12, block_size=s))
    assert abs(6 * n / flops_per_token(L, h, s, V) - 1) < 0.1  # ~6N: the matmuls are most of it
    # the causal half reads about 9% below the published MFU at GPT-2 small's shape (the glossary's figure)
    assert 1 - flops_per_token(L, h, s, V) / flops_per_token(L, h, s, V, causal=False) == pytest.approx(0.09, abs=0.005)


def test_datasheet_table_and_device_names():
    assert {"a100-40gb", "a100-80gb", "h100-80gb", "h200", "l4", "l40s"} <= set(ACCELERATORS)
    for a in ACCELERATORS.values():
        assert set(a.peak_tflops) == {"bf16", "fp16", "tf32", "fp32"} and "datasheet" in a.source
        assert a.peak_tflops["bf16"] >= a.peak_tflops["tf32"] > a.peak_tflops["fp32"]
    assert from_device_name("NVIDIA H100 80GB HBM3") == "h100-80gb" and from_device_name("NVIDIA L40S") == "l40s"
    assert from_device_name("NVIDIA A100-SXM4-40GB") == "a100-40gb" and from_device_name("Quadro") is None


def test_counting_the_last_step_only_keeps_the_counter_out_of_the_other_timings():
    r = launch(train, TrainConfig(strategy="ddp", steps=4, count_comm="last"), MODEL, world_size=2)[0]
    rank = r["ranks"][0]
    assert r["comm_counted"] == "last" and rank["step_timed_without_counter"] == [True] * 3 + [False]
    assert rank["allreduce_bytes_per_step"] == [None] * 3 + [r["grad_bytes"]]


def test_profile_steps_write_a_trace_per_rank_with_the_steps_ops_and_collectives(tmp_path):
    cfg = TrainConfig(strategy="ddp", steps=3, profile_steps="1:2", profile_dir=str(tmp_path))
    launch(train, cfg, MODEL, world_size=2)
    for rank in (0, 1):
        events = json.loads((tmp_path / f"trace_rank{rank}.json").read_text())["traceEvents"]
        names = {e.get("name", "") for e in events}
        assert "labkit step 1" in names and "labkit step 0" not in names  # only the window
        assert any(n.startswith("aten::mm") or n == "aten::addmm" for n in names)  # the model's matmuls
        assert any("allreduce" in n.lower() or "all_reduce" in n.lower() for n in names), sorted(names)[:50]


@pytest.mark.parametrize("kwargs, match", [
    (dict(profile_steps="3"), r"profile_steps='3' must be 'A:B'"),
    (dict(profile_steps="2:9", steps=4), r"profile_steps='2:9' must satisfy 0 <= A < B <= steps=4"),
    (dict(tf32=True), "tf32 is not available with device='cpu': it is a CUDA feature"),
    (dict(memory_snapshot="snap"), "memory_snapshot is not available with device='cpu'"),
    (dict(count_comm="sometimes"), r"count_comm='sometimes' is unknown"),
])
def test_bad_instrument_settings_are_named(kwargs, match):
    with pytest.raises(ValueError, match=match):
        TrainConfig(**kwargs)
