import math

import pytest

from labkit.planning import cost
from labkit.planning.accelerators import accelerator
from labkit.planning.choose import choose_strategy, min_devices, rule_of_thumb


def test_six_n_d_and_recompute():
    assert cost.training_flops(1e9, 1e12) == 6e21
    assert cost.training_flops(1e9, 1e12, "full") == 8e21


def test_time_and_price():
    h = cost.training_hours(6e21, 8, 312, 0.5)
    assert h == pytest.approx(6e21 / (8 * 312e12 * 0.5) / 3600)
    run = cost.price_run(1e9, 1e12, 8, "a100-80gb", mfu=0.5, preemptions_per_instance_per_day=0.1)
    assert run.gpu_hours == pytest.approx(8 * h)
    assert run.cost_on_demand == pytest.approx(8 * h * accelerator("a100-80gb").price_on_demand)
    assert run.spot_hours > run.hours  # preemptions cost time


def test_preemption_rates_of_the_seed_scenario():
    # 5-15% as a rate per instance per day on 100 nodes: one preemption every few hours
    lo, hi = cost.cluster_mtbf_hours(100, 0.15), cost.cluster_mtbf_hours(100, 0.05)
    assert lo == pytest.approx(1.6) and hi == pytest.approx(4.8)
    # the bands as published: the share interrupted over a month (AWS) or a day, as Poisson rates
    assert cost.preemptions_per_day(0.15, "day") == pytest.approx(-math.log(0.85))
    assert cost.preemptions_per_day(0.15, "month") == pytest.approx(-math.log(0.85) / 30)
    assert cost.cluster_mtbf_hours(100, cost.preemptions_per_day(0.15, "month")) == pytest.approx(44.3, abs=0.05)
    with pytest.raises(ValueError, match=r"period='week' is unknown; valid periods: \['day', 'month'\]"):
        cost.preemptions_per_day(0.1, "week")
    with pytest.raises(ValueError, match=r"share must be in \(0, 1\)"):
        cost.preemptions_per_day(15, "month")


def test_young_daly_is_near_the_minimum_of_expected_time():
    m, c, r, w = 2.4, 2 / 60, 10 / 60, 24
    tau = cost.young_daly_interval_hours(c, m)
    assert tau == pytest.approx(math.sqrt(2 * c * m))
    best = min((cost.expected_wall_hours(w, m, t / 100, c, r), t / 100) for t in range(5, 600))
    assert cost.expected_wall_hours(w, m, tau, c, r) <= best[0] * 1.02
    assert cost.expected_wall_hours(w, m, None, 0, r) > 100 * w  # without checkpoints: hopeless
    assert cost.expected_wall_hours(w, 1e9, tau, 0, 0) == pytest.approx(w, rel=1e-6)  # no failures


def test_the_18000_dollar_run():
    none = cost.preemption_loss(18000, 24, 14, None)
    every30 = cost.preemption_loss(18000, 24, 14, 30)
    assert none["lost_cost_worst"] == pytest.approx((14 + 10 / 60) * 750)
    assert every30["lost_cost_worst"] == pytest.approx((0.5 + 10 / 60) * 750)
    assert every30["lost_cost_mean"] < every30["lost_cost_worst"]


def test_rule_of_thumb_and_where_it_is_wrong():
    assert rule_of_thumb(1e9, 80) == "DDP" and rule_of_thumb(13e9, 80) == "FSDP" and rule_of_thumb(175e9, 80) == "ZeRO-3"
    # activations, not parameters: a 1.3B model at 16k tokens x 8 does not fit under DDP
    long = choose_strategy("gpt3-1.3b", 8, 80, micro_batch=8, seq_len=16384)
    assert long.rule_of_thumb == "DDP" and not long.rule_fits
    # "reduce the batch size": the same tokens per step in 8 micro-batches of 1 (accumulated) fit DDP
    assert long.strategy == "DDP + gradient accumulation (8 micro-batches of 1)"
    # over-sharding: 7B on 64 A100s fits with ZeRO-1, as fast as ZeRO-3 by the estimate, fewer bytes
    seven = choose_strategy("llama2-7b", 64, 80, device="a100-80gb")
    assert seven.strategy == "ZeRO-1" and seven.rule_fits and abs(seven.rule_slowdown()) < 0.05
    # the same model's bigger sibling on 64 H100s: gradients over InfiniBand dominate, TP in a node wins
    thirteen = choose_strategy("llama2-13b", 64, 80, seq_len=2048, device="h100-80gb")
    assert thirteen.strategy.startswith("TP=") and thirteen.rule_slowdown() > 0.5
    # 70B on 8 x 80 GB: only with recomputation and optimizer offload
    r = choose_strategy("llama2-70b", 8, 80)
    assert "offload" in r.strategy and "host memory" in r.reason
    small = choose_strategy("gpt2-124m", 8, 80, micro_batch=8, seq_len=1024)
    assert small.strategy == "DDP" and small.rule_fits


def test_nothing_fits_is_said_with_numbers():
    r = choose_strategy("gpt3-175b", 8, 16)
    assert r.strategy is None and "nothing fits on 8 x 16 GB" in r.reason


def test_min_devices():
    assert min_devices("10b", 0) is None  # DDP never fits 160 GB of model states
    assert min_devices("10b", 1) == 8


@pytest.mark.parametrize("call, match", [
    (lambda: cost.training_flops(0, 1e9), "n_params must be a positive finite number"),
    (lambda: cost.training_flops(1e9, 1e9, "half"), "recompute='half' is unknown"),
    (lambda: cost.training_hours(1e20, 8, 312, 1.5), r"mfu must be in \(0, 1\]"),
    (lambda: accelerator("tpu-v9"), "device='tpu-v9' is unknown; valid devices"),
    (lambda: cost.preemption_loss(18000, 24, 30, None), "hours_in must be in"),
    (lambda: cost.cluster_mtbf_hours(0, 0.1), "n_instances must be a positive integer"),
    (lambda: cost.training_hours(1e20, 3.5, 312, 0.4), "n_devices must be a positive integer, got 3.5"),
    (lambda: cost.price_run(1e9, 1e12, 0, "a100-80gb"), "n_devices must be a positive integer"),
    (lambda: choose_strategy("llama2-7b", 0), "n_devices must be a positive integer"),
    (lambda: choose_strategy("llama2-7b", 8, headroom=1.0), r"headroom must be in \[0, 1\)"),
])
def test_bad_input_is_named(call, match):
    with pytest.raises(ValueError, match=match):
        call()


def test_mfu_charges_the_model_and_hfu_the_hardware():
    """Chowdhery et al. 2022: MFU divides the model's 6ND by peak; recomputation is hardware work (HFU)."""
    plain = cost.price_run(7e9, 1e12, 64, "h100-80gb", mfu=0.4)
    full = cost.price_run(7e9, 1e12, 64, "h100-80gb", mfu=0.4, recompute="full")
    assert full.hours == pytest.approx(plain.hours) and full.model_flops == plain.model_flops == 6 * 7e9 * 1e12
    assert full.flops == 8 * 7e9 * 1e12 and full.hfu == pytest.approx(0.4 * 8 / 6) and plain.hfu == 0.4
    at_hfu = cost.price_run(7e9, 1e12, 64, "h100-80gb", hfu=0.4, recompute="full")
    assert at_hfu.hours == pytest.approx(plain.hours * 8 / 6) and at_hfu.mfu == pytest.approx(0.3)
    with pytest.raises(ValueError, match="give mfu=0.4 or hfu=0.5, not both"):
        cost.price_run(7e9, 1e12, 64, "h100-80gb", mfu=0.4, hfu=0.5)


def test_the_step_time_estimate_behind_the_chooser():
    from labkit.memory.calculator import model_shape
    from labkit.planning.accelerators import interconnect
    from labkit.planning.step_time import step_seconds

    shape = model_shape("llama2-7b")
    one = step_seconds(shape, 1, 1, 1, 4096, 0, "none", False, 1, 1, "h100-80gb")
    assert one["total"] == one["compute"] == pytest.approx(6 * shape.n_params * 4096 / (989e12 * 0.4))
    full = step_seconds(shape, 1, 1, 1, 4096, 0, "full", False, 1, 1, "h100-80gb")
    assert full["compute"] == pytest.approx(one["compute"] * 8 / 6)
    ddp, z3 = (step_seconds(shape, 64, 1, 1, 4096, s, "none", False, 1, 1, "h100-80gb") for s in (0, 3))
    # 2 Psi (16-bit gradients) x 63/64 per rank over InfiniBand; ZeRO-3 moves half as much again
    assert ddp["data_parallel"] == pytest.approx(2 * 2 * shape.n_params * 63 / 64 / (interconnect("ib-ndr").gb_per_s * 1e9))
    assert z3["data_parallel"] == pytest.approx(1.5 * ddp["data_parallel"])
    # backward (two thirds of the compute) hides what it can of the gradient traffic
    assert ddp["total"] == pytest.approx(ddp["compute"] + max(0, ddp["data_parallel"] - 2 / 3 * ddp["compute"]))
    in_node = step_seconds(shape, 8, 1, 1, 4096, 0, "none", False, 1, 1, "h100-80gb")
    assert in_node["total"] == in_node["compute"]  # over NVLink it hides completely
    pp = step_seconds(shape, 64, 32, 1, 4096, 1, "none", False, 8, 4, "h100-80gb")
    assert pp["bubble"] == pytest.approx(3 / 35) and pp["tensor_parallel"] > 0
