"""The one place a run is validated: :func:`validate` takes the config, the model and the world size
and returns the run's parallelism with its degrees resolved, or raises one line naming the field,
before any rank starts (a launcher asks it) and again on each rank before its first collective
(:func:`labkit.train.loop.make_setup`).

The field-by-field checks of a config (types, ranges, what each strategy takes) are
:class:`labkit.train.config.TrainConfig`'s own, made as it is built; what a layout cannot do on a
model (:func:`labkit.parallel.layout.checks.check_layout`) and what the layout leaves ignored are checked
here, once the degrees are known.
"""
from __future__ import annotations

from dataclasses import replace

from labkit.core.data import check_shard
from labkit.core.model import GPTConfig
from labkit.parallel.layout.checks import check_layout
from labkit.parallel.layout.mesh import Degrees
from labkit.parallel.layout.parallelism import Parallelism
from labkit.train.config import TrainConfig
from labkit.train.strategies import DIMS, STRATEGIES, Strategy, expand, strategy


def validate(cfg: TrainConfig, model_cfg: GPTConfig, world: int) -> Parallelism:
    """The run's one :class:`~labkit.parallel.layout.parallelism.Parallelism`, its degrees resolved for
    ``world`` ranks, once every check has passed: arithmetic on the configs, no process group, so that a
    combination labkit cannot train is refused in one line before any rank starts (and each rank,
    under torchrun, refuses it again before its first collective). Nothing checks the layout later."""
    spec = strategy(cfg.strategy)
    if model_cfg.moe_experts and not spec.moe:
        raise ValueError(f"moe_experts={model_cfg.moe_experts} (a mixture-of-experts model) is not supported with "
                         f"strategy={spec.name!r}: its routing would be decided per rank, not over the global batch; "
                         f"use strategy {' / '.join(repr(s.name) for s in STRATEGIES.values() if s.moe)}")
    par = expand(spec, cfg)
    asked = par.asked  # the degrees given as numbers (-1 waits for the world size)
    if par.pp_impl is not None and par.pp == -1:
        asked = replace(asked, pp=world)
    check_layout(asked, model_cfg, None, par.microbatches if asked.pp > 1 or par.pipelined else None,
                 par.pp_schedule, par.pp_impl or "torch", par.sequence_parallel, split=par.pp_split)
    par = _resolve(spec, par, world)  # the model, then the world
    for name, least in spec.least:  # after -1 is resolved: what the name means takes at least that
        if getattr(par, name) < least:
            raise ValueError(f"{name}={getattr(par, name)} is too few for strategy={spec.name!r}: give {least} or "
                             f"more; {spec.summary}")
    _check_run(cfg, par, model_cfg)
    return par


def _check_run(cfg: TrainConfig, par: Parallelism, model_cfg: GPTConfig) -> None:
    """What the layout cannot do with this model and batch, one line naming the field: arithmetic
    on the configs alone, so a launcher can ask it before any rank starts."""
    d = par.degrees
    rows = check_shard(cfg.batch_size, d.data)
    check_layout(d, model_cfg, rows, par.microbatches if par.pipelined else None, par.pp_schedule,
                 par.pp_impl or "torch", par.sequence_parallel, cfg.activation_checkpointing, par.pp_split)
    if par.pipelined and cfg.grad_accum > 1:
        raise ValueError(f"grad_accum={cfg.grad_accum} is not used with a pipeline (pp={d.pp}): its "
                         "microbatches are the accumulation; set grad_accum=1 and microbatches instead")
    if rows % cfg.grad_accum:
        raise ValueError(f"grad_accum={cfg.grad_accum} must divide the {rows} rows each rank gets per "
                         f"step (batch_size={cfg.batch_size} over {d.data} ranks)")
    # Accepted and then ignored, these trained as something else (a GPU check passed fp32 as bf16 parameters)
    if par.fsdp_bf16 and d.tokens == 1 and par.dp_impl == "fsdp":
        where = f"{d.label()} on {d.world} ranks" if d.world > 1 else "one rank"
        raise ValueError(f"fsdp_bf16=True has no effect with {where}: FSDP2 wraps the weights only where ranks "
                         "hold different tokens (dp_replicate x dp_shard x cp > 1); use precision='bf16' here")
    if par.sequence_parallel and d.tp == 1:
        raise ValueError(f"sequence_parallel=True has no effect with tp=1 ({d.label()}): it splits what tensor "
                         "parallelism's ranks would each repeat; leave it out")


def _resolve(spec: Strategy, par: Parallelism, world: int) -> Parallelism:
    if spec.one_process and world != 1:
        raise ValueError(f"strategy={spec.name!r} runs on one process but world_size={world}; use 'ddp' (or "
                         "another strategy) for several ranks")
    par = par.resolve(world)
    degrees = par.degrees
    if spec.teaching and degrees.world > 1 and max(getattr(degrees, d) for d in DIMS) != world:
        raise ValueError(f"strategy={spec.name!r} is written by hand for one dimension only: its degree must be "
                         f"world_size={world}, here {degrees.label()}; strategy 'mesh' composes the library versions")
    return par


def degrees_for(cfg: TrainConfig, world: int) -> Degrees:
    """The degrees ``cfg``'s strategy gives it on ``world`` ranks; a one-line ValueError naming the field otherwise."""
    spec = strategy(cfg.strategy)
    return _resolve(spec, expand(spec, cfg), world).degrees
