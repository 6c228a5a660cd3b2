"""A run's figures beyond the loss: its layout, and for each dimension in use what the formula predicts.

:func:`layout_fields` adds to the metrics the degrees, the model-state bytes a rank should hold, and,
per parallelism present, the formula the lab holds the measurement against: tensor parallelism's
activation bytes (Shoeybi et al. 2019), the pipeline's bubble (Narayanan et al. 2021), ring
attention's K/V bytes (Liu et al. 2023), hybrid sharding's bytes per mesh dimension (Zhao et al. 2023).
"""
from __future__ import annotations

import statistics
from dataclasses import asdict
from typing import TYPE_CHECKING, Any

from labkit.memory.calculator import model_state_breakdown
from labkit.parallel.pipeline import stages as pipe
from labkit.parallel.activation_checkpointing import parse_policy
from labkit.parallel.fsdp import hsdp_formula
from labkit.parallel.pipeline.timeline import Event, bubble_formula, bubble_fraction

if TYPE_CHECKING:
    from labkit.parallel.pipeline.runner import Pipeline
    from labkit.train.setup import Setup


def _fp32_adamw_states(n: float) -> dict[str, int]:
    # fp32 AdamW: 4 bytes of weights, 4 of gradients, 8 of moments per parameter the rank holds
    return {"params": round(4 * n), "grads": round(4 * n), "optimizer": round(8 * n), "grad_accum": 0}


def predicted_model_states(setup: Setup) -> dict[str, int]:
    """What this rank should hold: DeepSpeed's partitions with their fp32 master copy; otherwise fp32
    AdamW on its parameters, sharded over the dense shard group (the ZeRO paper's 1/N)."""
    from labkit.core.model import GPT

    d, spec, n_params = setup.dims.degrees, setup.spec, GPT.count_params(setup.model_cfg)
    if spec.deepspeed:
        return asdict(model_state_breakdown(n_params, setup.dims.world, spec.zero_stage, "fp32_master"))
    if setup.par.dp_impl != "fsdp":  # replicated, or the hand-written ZeRO-1's optimizer slice
        return asdict(model_state_breakdown(n_params, setup.dims.world, spec.zero_stage, "fp32"))
    from labkit.parallel.layout.sizes import params_on_rank

    dense, experts = params_on_rank(setup.model_cfg, d, setup.dims.coords["pp"],
                                    setup.par.pp_schedule if setup.par.pipelined else None)
    return _fp32_adamw_states(dense / d.shard + experts / d.dp_shard_mod_ep)


def _recomputed(policy: str, layers: int) -> int:
    """Blocks whose forward runs again in backward under ``policy`` (ring attention's exchanges with it:
    the selective policies keep only aten matmul and SDPA outputs, so the ring's Function reruns too)."""
    kind, k = parse_policy(policy)
    return 0 if kind == "none" else (-(-layers // k) if kind == "every" else layers)


def pipeline_rank_figures(pipeline: Pipeline, peaks: list[int]) -> dict[str, Any]:
    saved = [e.saved_bytes for st in pipeline.timeline.steps for e in st if e.kind == "F"]
    return {"peak_activation_bytes": peaks, "activation_bytes_per_microbatch": statistics.median(saved) if saved else 0,
            "events": [[e.__dict__ for e in st] for st in pipeline.timeline.steps]}


def _pipeline_fields(setup: Setup, ranks: list[dict]) -> dict[str, Any]:
    par, d = setup.par, setup.dims.degrees
    steps = len(ranks[0]["events"])
    steps_events = [[Event(**e) for r in ranks if _same_pipeline(r, ranks[0]) for e in r["events"][i]]
                    for i in range(steps)]
    per_step = [bubble_fraction(evs) for evs in steps_events]
    for r in ranks:
        del r["events"]
    split = par.pp_split
    virtual, n_stages = split.v, split.n_stages(d.pp)
    stage_params = [sum(pipe.stage_params(setup.model_cfg, n_stages, i, split.first_less, split.last_less)
                        for i in split.indices(r, d.pp)) for r in range(d.pp)]
    return {"pp": d.pp, "microbatches": par.microbatches, "pp_schedule": par.pp_schedule,
            "impl": par.pp_impl or "torch", "virtual_stages": virtual,
            "stage_layers": split.bounds(setup.model_cfg.n_layer, d.pp),
            "bubble_fraction": statistics.median(per_step[1:] or per_step) if per_step else None,
            "bubble_fraction_per_step": per_step, "bubble_formula": (None if par.pp_schedule in pipe.ZERO_BUBBLE  # no closed form: measured
                                                      else bubble_formula(d.pp, par.microbatches, virtual)),
            "timeline": [e.__dict__ for e in steps_events[-1]] if steps_events else [],
            "predicted_params_per_rank": stage_params}


def _same_pipeline(r: dict, first: dict) -> bool:
    """Whether rank ``r`` is a stage of the pipeline rank 0 belongs to (same place off the pp dimension)."""
    return all(r["coords"][k] == first["coords"][k] for k in r["coords"] if k != "pp")


def layout_fields(setup: Setup, ranks: list[dict]) -> dict[str, Any]:
    """The run's layout and, for each dimension the strategy uses, its formula (module docstring)."""
    from labkit.core.model import GPT
    from labkit.parallel import tensor_parallel as tpar
    from labkit.parallel.context.layout import cp_comm_bytes

    cfg, m, dims = setup.cfg, setup.model_cfg, setup.dims
    d, named = dims.degrees, {dim for dim, _ in setup.spec.degrees}
    n_params = GPT.count_params(m)
    out: dict[str, Any] = {"degrees": asdict(d), "layout": d.label(),
                           "predicted_model_state_bytes": predicted_model_states(setup)}
    rows = cfg.batch_size // dims.data_world
    if "tp" in named:
        out.update(tp=d.tp, dp=dims.data_world, impl=setup.par.tp_impl, sequence_parallel=setup.par.sequence_parallel,
                   comm_formula_bytes_per_step=m.n_layer * tpar.comm_bytes_per_layer(
                       rows, m.block_size // d.cp, m.n_embd, 4 if cfg.precision == "fp32" else 2))
    if "cp" in named:
        per_call = cp_comm_bytes("ring", rows, m.n_head // d.tp, m.block_size, m.n_embd // m.n_head, d.cp)
        layers = m.n_layer // d.pp
        out.update(cp=d.cp, dp=dims.data_world, kv_formula_bytes_per_step=layers * (
            per_call["forward"] + per_call["backward"]) + _recomputed(cfg.activation_checkpointing, layers)
            * per_call["forward"])
    if "ep" in named and d.ep > 1:  # on the mesh, a degree of 1 would say dp = world over a TP layout
        out.update(ep=d.ep, dp=dims.world // d.ep)
    if "dp_replicate" in named and setup.par.dp_impl == "fsdp":
        psi = 4 * n_params
        out.update(replicas=d.dp_replicate, shard_group=d.shard,
                   comm_formula=hsdp_formula(psi, dims.world, dims.world // d.shard))
    if setup.placed.pipeline is not None:
        out.update(_pipeline_fields(setup, ranks))
    return out
