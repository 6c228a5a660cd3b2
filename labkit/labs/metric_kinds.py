"""What each recorded lab metric is, said once: exact, close within a tolerance, or a timing.

A regression run (:mod:`labkit.labs.compare`) holds a lab's metrics against a baseline by kind:

* **exact**: bytes, counts, formulas, shapes, and on the same machine the losses and parameter
  differences of a seeded CPU run. Any change is a regression. Against a baseline from another
  machine (another CPU instruction set, its extensions, or thread count, :data:`MACHINE_KEYS`) only what is exact
  everywhere is held (integers, strings, booleans); its floats, and :data:`FROM_FLOATS` metrics,
  are reported as moved. The same program sums in another order there, and training amplifies it:
  between an AVX2 and an AVX-512 host 619 floats of the ci baseline moved by more than 1e-4, by up
  to 3% (the fine-tuning lab's noise-scale statistics), so no tolerance tells such a move from a
  regression. ``make baseline`` on the new machine holds them again.
* **close**: reproducible up to a stated tolerance.
* **context**: what the run ran on (``environment``: versions, instruction set); reported.
* **timing**: measured time, or a quantity derived from it (a rate, a fit, a verdict chosen by a
  timing). On two shared CPU cores it is noise, so it is reported, never a failure, unless the
  caller states a tolerance for timings (``--timings 0.1`` on a quiet GPU node).

A metric's path is its keys joined by ``/`` (list items by their index), ``recorded/<name>`` for
the values a lab glued for the text. A key named as a timing (:data:`ANY_LAB`: ``median_step_ms/ddp``)
makes a timing; then the lab's own patterns decide; what no pattern names is exact, so a new
metric is held exactly until it is declared otherwise here.
"""
from __future__ import annotations

from dataclasses import dataclass
from fnmatch import fnmatchcase


@dataclass(frozen=True)
class Kind:
    name: str  # "exact", "close" or "timing"
    rel: float = 0.0
    abs: float = 0.0


EXACT = Kind("exact")
# exact on one machine, but made from floats though it is not one (text a model sampled): against
# another machine's baseline it is reported with the floats
FROM_FLOATS = Kind("exact, from floats")
TIMING = Kind("timing")
CONTEXT = Kind("context")


def close(rel: float = 0.0, abs: float = 0.0) -> Kind:
    return Kind("close", rel, abs)


# What makes a float from one machine differ from another's, though the program is the same: against
# a baseline from another machine the compare command reports floats rather than holding them.
MACHINE_KEYS = ("cpu_capability", "cpu_isa", "threads", "machine")

# By any key of a path, in every lab: what is measured in time, or derived from a time.
ANY_LAB: list[tuple[str, Kind]] = [(p, TIMING) for p in (
    "*_ms", "*_ms_*", "*_us", "*_s", "*_s_*", "*seconds*", "*_per_s", "*_per_s_*", "*per_s", "*gbps*",
    "*gb_per_s*", "*tflops*", "mfu*", "best_mfu", "hfu", "*time*", "*wall*", "*busy*", "*wait*", "*speedup*",
    "*_fraction", "*latency*", "iters", "pid", "diagnosis", "classification", "verdict*", "*bandwidth*",
    "elapsed*", "process_max_rss", "overlap*", "*_vs_*", "*step_ratio*")]

# Where a lab is mostly timings, what it holds exactly is listed and the rest is a timing ("*" last).
_FAULT_TOLERANCE_EXACT = ("profile", "params/*", "bit_exact", "max_param_diff", "loss_*", "final_step",
                          "restored_identical", "verify_problems", "dcp_silently_changed",
                          "torch_save_crc/*", "recorded/ft_max_param_diff",
                          "recorded/ft_params_differing", "recorded/ft_n_params", "recorded/ft_steps",
                          "recorded/ft_save_every", "recorded/ft_state_mb", "recorded/ft_mtbf_*",
                          "recorded/ft_share_*", "recorded/ft_dcp_changed", "recorded/ft_torch_save_changed",
                          "recorded/ft_naive_trials")
_INPUT_PIPELINE_EXACT = ("profile", "params/*", "*/pad_fraction", "*/copy_fraction", "*/pinned", "*/n_steps",
                         "*/warmup", "*/device", "synthetic/*/analytic", "recorded/ip_batch_size",
                         "recorded/ip_pad_fraction", "recorded/ip_copy_fraction", "recorded/ip_synth_load_ms",
                         "recorded/ip_synth_compute_ms", "recorded/ip_pretok_rows", "recorded/ip_slow_every")
_COMMUNICATION_EXACT = ("profile", "params/*", "accum/*", "hsdp/*", "mismatch_messages", "bench/*/op",
                        "bench/*/bytes", "bench/*/world_size", "recorded/comm_accum*", "recorded/comm_hsdp_*",
                        "recorded/comm_factor_err", "recorded/comm_mismatch_detected", "recorded/comm_n_sizes",
                        "recorded/comm_world", "recorded/comm_*_mb", "recorded/comm_min_bytes")
# What a failure costs in time (restarts, restores, a straggler's verdict, an elastic run's degraded
# window and so its losses) is measured; the rates, the bit flips and the bit-exact restores are not.
_FAILURES_EXACT = ("profile", "params/*", "rate_per_gpu_day", "rates/*", "sdc/*", "bench/bytes",
                   "bench/restored_identical", "peer/bit_exact", "peer/loss", "peer/loss_reference",
                   "peer/disk_equals_peer", "goodput/state_gb", "goodput/per_gpu_day", "goodput/rows/*/gpus",
                   "goodput/rows/*/path", "goodput/rows/*/per_day", "goodput/rows/*/mtbf_h",
                   "recorded/fas_rate", "recorded/fas_gpus_*", "recorded/fas_per_day_*", "recorded/fas_mtbf_*",
                   "recorded/fas_gpu_years", "recorded/fas_cost_per_interruption_min", "recorded/fas_world",
                   "recorded/fas_flip_*", "recorded/fas_caught_*", "recorded/fas_repaired_differ",
                   "recorded/fas_missed_checks", "recorded/fas_before_differ", "recorded/fas_n_state",
                   "recorded/fas_fp_bytes", "recorded/fas_straggler_rank", "recorded/fas_bench_mb",
                   "recorded/fas_peer_kill_step", "recorded/fas_peer_bit_exact", "recorded/fas_peer_losses_equal",
                   "recorded/fas_peer_disk_same", "recorded/fas_replicas", "recorded/fas_kill_replica",
                   "recorded/fas_elastic_kill_step", "recorded/fas_elastic_steps", "recorded/fas_state_gb",
                   "recorded/fas_job_restart_min")
_PIPELINE_TIMING = ("bubble/*/measured", "bubble/*/low", "bubble/*/high", "stage_busy_s*", "recorded/pp_1f1b_*",
                    "recorded/pp_bubble_gap", "recorded/pp_bubble_hi", "recorded/pp_bubble_lo", "recorded/pp_zbv_*",
                    "recorded/pp_imbalance", "recorded/pp_interleaved_hi")

# Per lab: the paths ANY_LAB's names do not settle. First match wins.
LABS: dict[str, list[tuple[str, Kind]]] = {
    # a checkpoint's bytes include its folder's path, whose length differs from run to run
    "fault_tolerance": [(p, close(rel=1e-5)) for p in ("state_bytes", "bench/*/bytes", "recorded/ft_state_mb")]
                       + [(p, EXACT) for p in _FAULT_TOLERANCE_EXACT] + [("*", TIMING)],
    "failures_at_scale": [(p, EXACT) for p in _FAILURES_EXACT] + [("*", TIMING)],
    "input_pipeline": [(p, EXACT) for p in _INPUT_PIPELINE_EXACT] + [("*", TIMING)],
    "communication": [(p, EXACT) for p in _COMMUNICATION_EXACT] + [("*", TIMING)],
    "pipeline_parallel": [(p, TIMING) for p in _PIPELINE_TIMING],
    "composing": [("bubble/measured", TIMING), ("recorded/cmp_bubble", TIMING)],
    "strategy_cost": [("cpu_prediction/*", TIMING), ("recorded/sc_cpu_*", TIMING)],
    # SDPA's CPU kernel, against which the tiles are held, moved its last bits between two runs of
    # the same commit on one machine: an error between two fp32 kernels is held to 1e-5, not exactly
    # what one device achieves against its roofline (the FLOPs, bytes and bounds are exact)
    "inside_device": [(p, close(abs=1e-5)) for p in ("flash/max_err/*", "recorded/dev_flash_err")]
                     + [(p, TIMING) for p in ("ops/*/of_roofline", "ops/*/achieved_flops", "ops/*/bound",
                                              "recorded/dev_n_memory_bound", "recorded/dev_gflops",
                                              "recorded/dev_gbps", "recorded/dev_ridge", "recorded/dev_*_of_roof",
                                              "recorded/dev_time_memory_share", "recorded/dev_flop_memory_share",
                                              "recorded/dev_fp8_gemm_ratio",
                                              "recorded/dev_fusion_speedup")],
    "finetuning": [("samples/*", FROM_FLOATS)],
    "packing": [("training/*/loss", EXACT), ("training/*/padding", EXACT), ("training/*/real_tokens", EXACT),
                ("training/*/slots", EXACT), ("training/*", TIMING), ("bench/*/seconds", TIMING),
                ("pack/seconds", TIMING), ("speedup_real_tokens", TIMING), ("recorded/pk_bench_*_x", TIMING),
                ("recorded/pk_real_*", TIMING), ("recorded/pk_slots_ratio", TIMING),
                ("recorded/pk_*speedup", TIMING), ("recorded/pk_packed_vs_grouped", TIMING)],
}


def kind_of(lab: str, path: str) -> Kind:
    """The kind of the metric at ``path`` in ``lab``'s metrics (see the module's docstring). A key
    named as a timing (:data:`ANY_LAB`) makes its metric one wherever it is; then the lab's own
    patterns, first match first; what neither names is exact."""
    if path.startswith("environment/"):
        return CONTEXT
    if any(fnmatchcase(key, pattern) for key in path.split("/") for pattern, _ in ANY_LAB):
        return TIMING
    return next((kind for pattern, kind in LABS.get(lab, []) if fnmatchcase(path, pattern)), EXACT)
