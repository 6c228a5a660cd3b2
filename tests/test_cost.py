import math

import pytest

from labkit.planning import cost
from labkit.planning.accelerators import accelerator
from labkit.memory.calculator import model_shape
from labkit.planning.choose import choose_strategy, min_devices, price_strategies, rule_of_thumb
from labkit.planning.hardware import hardware
from labkit.planning.search import search
from labkit.planning.step_model import Plan, predict


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
    # activations, not parameters: a 1.3B model at 16k tokens x 8 does not fit under DDP; the planner
    # takes the same eight sequences a device in micro-batches of one
    long = choose_strategy("gpt3-1.3b", 8, 80, micro_batch=8, seq_len=16384, device="a100-80gb")
    assert long.rule_of_thumb == "DDP" and not long.rule_fits
    assert long.chosen.plan.micro_batch == 1 and long.chosen.plan.microbatches == 8
    # over-sharding: 7B on 64 A100s fits with ZeRO-1, which gathers nothing layer by layer
    seven = choose_strategy("llama2-7b", 64, 80, device="a100-80gb")
    assert seven.chosen.plan.zero == 1 and seven.rule_fits and 0 <= seven.rule_slowdown() < 0.05
    # on 64 H100s the rule's FSDP gathers every layer across the network: slower than ZeRO-1
    thirteen = choose_strategy("llama2-13b", 64, 80, seq_len=2048, device="h100-80gb")
    assert thirteen.chosen.plan.zero == 1 and thirteen.rule_slowdown() > 0.05
    # 70B on 8 x 80 GB: only with recomputation and optimizer offload
    r = choose_strategy("llama2-70b", 8, 80, device="a100-80gb")
    assert r.chosen.plan.offload and r.chosen.plan.recompute != "none" and "host memory" in r.reason
    # the chooser is the planner: the same ranking for the same inputs
    plans = search(model_shape("llama2-7b"), hardware("a100-80gb"), 64, 64 * 4096, 80)
    assert [x.label for x in seven.ranked] == [x.label for x in plans]


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
    given = cost.price_run(7e9, 1e12, 64, "h100-80gb", hours=plain.hours)  # the planners give the hours
    assert given.mfu == pytest.approx(0.4) and given.cost_on_demand == pytest.approx(plain.cost_on_demand)
    with pytest.raises(ValueError, match="give one of hours=None, mfu=0.4, hfu=0.5"):
        cost.price_run(7e9, 1e12, 64, "h100-80gb", mfu=0.4, hfu=0.5)


def test_the_price_of_a_strategy_is_steps_times_its_predicted_step():
    rows = {(r["device"], r["strategy"]): r for r in price_strategies("10b", 1e12, ["h100-80gb"], 2048, 30)}
    z1 = rows["h100-80gb", "ZeRO-1"]
    step = predict(model_shape("10b"), Plan(dp=z1["devices"], global_batch=2048, zero=1), hardware("h100-80gb"))
    steps = math.ceil(1e12 / (2048 * 2048))
    assert z1["days"] == round(steps * step["total"] / 86400, 1) and z1["MFU"] == round(step["mfu"], 3)
    assert rows["h100-80gb", "DDP"]["min devices (memory)"] == "never fits"
