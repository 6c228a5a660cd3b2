"""What a run costs: compute, time, money, and what preemptions do to all three.

* Training compute is about 6ND FLOPs for N parameters and D tokens: 2ND for the forward pass and
  4ND for the backward (Kaplan et al. 2020, section 2.1; Hoffmann et al. 2022). Full activation
  recomputation adds one forward pass, 8ND (Korthikanti et al. 2022, section 5).
* Time is compute over delivered throughput. Model FLOPs utilisation (MFU, Chowdhery et al. 2022,
  appendix B) divides the FLOPs the *model* needs, 6ND, by what the devices could do; recomputation
  does not count. Hardware FLOPs utilisation (HFU) counts every FLOP the devices run, 8ND with full
  recomputation. At the same hardware efficiency full recomputation keeps HFU and lowers MFU to
  6/8 of it. :func:`price_run` takes either; the other follows.
* Preemptions arrive as a Poisson process. With checkpoints every tau hours that take C hours to
  write, a restart that takes R hours and a mean time between failures M, the expected wall time
  of W hours of work is (W/tau) (M + R) (exp((tau + C)/M) - 1) (Daly 2006, eq. 9 with segments
  of tau + C, first order in the restart: Daly charges it as M exp(R/M)); without checkpoints it is
  (M + R)(exp(W/M) - 1). The interval that minimises it is close to Young's sqrt(2 C M)
  (Young 1974; Daly 2006).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from labkit.core.checks import one_of, positive_int, positive_number
from labkit.planning.accelerators import accelerator

HOURS_PER_DAY = 24.0


def _count(name: str, value) -> int:
    return positive_int(name, value, accept_float=True)


def training_flops(n_params: float, tokens: float, recompute: str = "none") -> float:
    """6ND, or 8ND when every layer's forward is recomputed in backward."""
    n, d = positive_number("n_params", n_params), positive_number("tokens", tokens)
    if recompute not in ("none", "selective", "full"):
        raise ValueError(f"recompute={recompute!r} is unknown; valid modes: ['none', 'selective', 'full']")
    # Selective recomputation redoes only the attention-score ops, a few percent at most.
    return (8.0 if recompute == "full" else 6.0) * n * d


def flops_per_token(n_layer: int, hidden: int, seq_len: int, vocab: int, causal: bool = True,
                    recompute: str = "none") -> float:
    """Training FLOPs per token of a GPT: model FLOPs by default, hardware FLOPs with ``recompute``.

    Model FLOPs (Chowdhery et al. 2022, appendix B, the ``6N + 12LHQT`` of MFU): 6 per weight of
    every matrix multiply, N = 12 L h^2 in the blocks plus the V h of the head (2 forward, 4
    backward; Kaplan et al. 2020); and the attention scores and their weighted sum, 12 L s h for
    full attention. A causal model computes half the score matrix with causal kernels (FlashAttention,
    Dao et al. 2022), so ``causal`` counts 6 L s h; PaLM and torchtitan count the full 12. With
    ``recompute="full"`` every block's forward runs again in backward: hardware FLOPs (HFU) add one
    forward, 2 N_blocks + 2 L s h (causal), the "8ND" of Korthikanti et al. 2022 section 5.
    """
    one_of("recompute", recompute, ("none", "selective", "full"), "modes")
    L, h, s, V = (positive_int(k, v) for k, v in (("n_layer", n_layer), ("hidden", hidden), ("seq_len", seq_len),
                                                  ("vocab", vocab)))
    attention = (6 if causal else 12) * L * s * h
    flops = 6 * (12 * L * h * h + V * h) + attention
    if recompute == "full":
        flops += 2 * 12 * L * h * h + attention / 3
    return float(flops)


def training_hours(flops: float, n_devices: int, peak_tflops: float, mfu: float) -> float:
    """Wall-clock hours at a sustained ``mfu`` fraction of the devices' peak."""
    if not 0 < mfu <= 1:
        raise ValueError(f"mfu must be in (0, 1], got {mfu!r}")
    n = _count("n_devices", n_devices)
    return positive_number("flops", flops) / (n * positive_number("peak_tflops", peak_tflops) * 1e12 * mfu) / 3600.0


# How many days a published interruption band covers. AWS's Spot Instance Advisor lists, per instance
# type and region, bands of "frequency of interruption" (<5%, 5-10%, 10-15%, 15-20%, >20%): the share
# of instances interrupted over the trailing month. Read as a share per day, the same band means 30
# times as many preemptions, and every conclusion drawn from it changes.
SHARE_PERIOD_DAYS = {"day": 1.0, "month": 30.0}


def preemptions_per_day(share: float, period: str = "month") -> float:
    """The per-instance preemption rate per day of a band "``share`` of instances interrupted over
    ``period``", as a Poisson process: ``-ln(1 - share) / days``."""
    if not 0 < share < 1:
        raise ValueError(f"share must be in (0, 1), the fraction of instances interrupted; got {share!r}")
    return -math.log1p(-share) / SHARE_PERIOD_DAYS[one_of("period", period, SHARE_PERIOD_DAYS, "periods")]


# The planners' assumption when none is given: 10% of instances a month, the middle of AWS's bands.
DEFAULT_PREEMPTIONS_PER_DAY = preemptions_per_day(0.10, "month")


def cluster_mtbf_hours(n_instances: int, preemptions_per_instance_per_day: float) -> float:
    """Mean hours between preemptions anywhere in a job of ``n_instances`` (any one stops it)."""
    rate = _count("n_instances", n_instances) * positive_number(
        "preemptions_per_instance_per_day", preemptions_per_instance_per_day) / HOURS_PER_DAY
    return 1.0 / rate


def young_daly_interval_hours(checkpoint_hours: float, mtbf_hours: float) -> float:
    """Young's optimal checkpoint interval, sqrt(2 C M)."""
    return math.sqrt(2 * positive_number("checkpoint_hours", checkpoint_hours) * positive_number("mtbf_hours", mtbf_hours))


def expected_wall_hours(work_hours: float, mtbf_hours: float, interval_hours: float | None = None,
                        checkpoint_hours: float = 0.0, restart_hours: float = 0.0) -> float:
    """Expected wall time to finish ``work_hours`` of computation under Poisson preemptions.

    ``interval_hours=None`` means no checkpoints: every preemption restarts from step 0.
    """
    w, m = positive_number("work_hours", work_hours), positive_number("mtbf_hours", mtbf_hours)
    if checkpoint_hours < 0 or restart_hours < 0:
        raise ValueError("checkpoint_hours and restart_hours must be >= 0")
    if interval_hours is None:
        return (m + restart_hours) * math.expm1(w / m)
    tau = min(positive_number("interval_hours", interval_hours), w)
    return (w / tau) * (m + restart_hours) * math.expm1((tau + checkpoint_hours) / m)


@dataclass(frozen=True)
class CheckpointPlan:
    """When to checkpoint ``work_hours`` of work, and what preemptions then cost in expected hours."""

    work_hours: float
    mtbf_hours: float
    checkpoint_hours: float  # C: what one checkpoint holds the run up
    restart_hours: float  # R: from a preemption to training again
    interval_hours: float  # Young's sqrt(2 C M)
    wall_hours: float  # expected, checkpointing at that interval
    wall_hours_without: float  # expected, never checkpointing: every preemption restarts from step 0

    def wall_hours_at(self, interval_hours: float) -> float:
        """Expected hours to finish when checkpointing every ``interval_hours`` instead."""
        return expected_wall_hours(self.work_hours, self.mtbf_hours, interval_hours, self.checkpoint_hours,
                                   self.restart_hours)


def checkpoint_plan(work_hours: float, mtbf_hours: float, checkpoint_hours: float,
                    restart_hours: float = 0.0) -> CheckpointPlan:
    """Young's interval for checkpoints costing ``checkpoint_hours`` (C) under preemptions every
    ``mtbf_hours`` (M) on average, restarts costing ``restart_hours`` (R), and the expected wall time
    with and without checkpoints (:func:`expected_wall_hours`)."""
    tau = young_daly_interval_hours(checkpoint_hours, mtbf_hours)
    return CheckpointPlan(work_hours, mtbf_hours, checkpoint_hours, restart_hours, tau,
                          expected_wall_hours(work_hours, mtbf_hours, tau, checkpoint_hours, restart_hours),
                          expected_wall_hours(work_hours, mtbf_hours, None, 0.0, restart_hours))


@dataclass(frozen=True)
class RunCost:
    devices: int
    device: str
    flops: float  # what the devices run: 6ND, or 8ND with full recomputation (hardware FLOPs)
    model_flops: float  # what the model needs, 6ND, whatever is recomputed
    mfu: float
    hfu: float
    hours: float
    gpu_hours: float
    cost_on_demand: float
    cost_spot: float  # including the expected rework and checkpoints under preemptions
    spot_hours: float
    checkpoint_interval_hours: float
    mtbf_hours: float


def price_run(n_params: float, tokens: float, n_devices: int, device_name: str, mfu: float | None = None,
              recompute: str = "none", devices_per_instance: int = 8,
              preemptions_per_instance_per_day: float = DEFAULT_PREEMPTIONS_PER_DAY, checkpoint_minutes: float = 5.0,
              restart_minutes: float = 10.0, hfu: float | None = None, hours: float | None = None) -> RunCost:
    """Compute, time and money of a run, on demand and on spot with Young-interval checkpoints.

    Give the run's ``hours`` (the step model's: steps x predicted step, as the planners do), or, to
    price a what-if, its utilisation as ``mfu`` (of the model's 6ND; default 0.4) or ``hfu`` (of every
    FLOP the devices run, recomputation included: with full recomputation the same ``hfu`` takes 4/3
    as long); the others follow."""
    dev = accelerator(device_name)
    flops, model_flops = training_flops(n_params, tokens, recompute), training_flops(n_params, tokens)
    if sum(x is not None for x in (mfu, hfu, hours)) > 1:
        raise ValueError(f"give one of hours={hours!r}, mfu={mfu!r}, hfu={hfu!r}: the others follow from it")
    if hours is not None:
        hours = positive_number("hours", hours)
        mfu = model_flops / (hours * 3600 * _count("n_devices", n_devices) * dev.peak_bf16_tflops * 1e12)
        hfu = mfu * flops / model_flops
    elif hfu is not None:
        hours = training_hours(flops, n_devices, dev.peak_bf16_tflops, hfu)
        mfu = hfu * model_flops / flops
    else:
        mfu = 0.4 if mfu is None else mfu
        hours = training_hours(model_flops, n_devices, dev.peak_bf16_tflops, mfu)
        hfu = mfu * flops / model_flops
    instances = math.ceil(_count("n_devices", n_devices) / _count("devices_per_instance", devices_per_instance))
    mtbf = cluster_mtbf_hours(instances, preemptions_per_instance_per_day)
    c, r = checkpoint_minutes / 60.0, restart_minutes / 60.0
    tau = young_daly_interval_hours(c, mtbf) if c > 0 else hours
    spot_hours = expected_wall_hours(hours, mtbf, tau, c, r)
    return RunCost(n_devices, device_name, flops, model_flops, mfu, hfu, hours, hours * n_devices,
                   hours * n_devices * dev.price_on_demand, spot_hours * n_devices * dev.price_spot,
                   spot_hours, tau, mtbf)


def preemption_loss(run_cost: float, run_hours: float, hours_in: float,
                    checkpoint_every_minutes: float | None, restart_minutes: float = 10.0) -> dict:
    """What one preemption ``hours_in`` a run costs, with and without periodic checkpoints.

    Without a checkpoint all ``hours_in`` hours are redone. With one every k minutes, at most k
    minutes (k/2 on average, the preemption falling anywhere in the interval) plus the restart.
    """
    burn = positive_number("run_cost", run_cost) / positive_number("run_hours", run_hours)
    if not 0 < hours_in <= run_hours:
        raise ValueError(f"hours_in must be in (0, run_hours={run_hours}], got {hours_in!r}")
    restart = restart_minutes / 60.0
    if checkpoint_every_minutes is None:
        lost_worst = lost_mean = hours_in
    else:
        k = positive_number("checkpoint_every_minutes", checkpoint_every_minutes) / 60.0
        lost_worst, lost_mean = min(k, hours_in), min(k, hours_in) / 2
    return {"burn_per_hour": burn, "lost_hours_worst": lost_worst + restart,
            "lost_hours_mean": lost_mean + restart, "lost_cost_worst": (lost_worst + restart) * burn,
            "lost_cost_mean": (lost_mean + restart) * burn}
