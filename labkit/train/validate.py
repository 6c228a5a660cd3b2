"""The one place a run is validated: :func:`validate` takes the config, the model and the world size
and returns the degrees, or raises one line naming the field, before any rank starts (a launcher asks
it) and again on each rank before its first collective (:func:`labkit.train.loop.make_setup`).

The field-by-field checks of a config (types, ranges, what each strategy takes) are
:class:`labkit.train.config.TrainConfig`'s own, made as it is built; what a layout cannot do on a
model (:func:`labkit.parallel.layout.checks.check_layout`) and what the layout leaves ignored are checked
here, once the degrees are known.
"""
from __future__ import annotations

import math

from labkit.core.data import check_shard
from labkit.core.model import GPTConfig
from labkit.parallel.layout.checks import check_layout
from labkit.parallel.layout.mesh import Degrees
from labkit.train.config import TrainConfig
from labkit.train.strategies import DIMS, STRATEGIES, WHY, Strategy, strategy


def validate(cfg: TrainConfig, model_cfg: GPTConfig, world: int) -> Degrees:
    """The layout ``cfg`` gives ``world`` ranks, once every check has passed: arithmetic on the configs,
    no process group, so that a combination labkit cannot train is refused in one line before any
    rank starts (and each rank, under torchrun, refuses it again before its first collective)."""
    spec = strategy(cfg.strategy)
    if model_cfg.moe_experts and not spec.moe:
        raise ValueError(f"moe_experts={model_cfg.moe_experts} (a mixture-of-experts model) is not supported with "
                         f"strategy={spec.name!r}: its routing would be decided per rank, not over the global batch; "
                         f"use strategy {' / '.join(repr(s.name) for s in STRATEGIES.values() if s.moe)}")
    # the degrees given as numbers (-1 waits for the world size)
    asked = {dim: getattr(cfg, name) for dim, name in spec.degrees if getattr(cfg, name) > 0 and dim != spec.rest}
    if spec.pp_impl is not None:
        asked["pp"] = cfg.pp if cfg.pp > 0 else world
    if "ep" in asked and "dp_shard" not in asked:  # the ranks it is carved from, before the world is known
        asked["dp_shard"] = asked["ep"]
    staged = spec.pp_impl is not None or asked.get("pp", 1) > 1
    check_layout(Degrees(**asked), model_cfg, None, cfg.microbatches if staged else None, cfg.pp_schedule,
                 spec.pp_impl or "torch", cfg.sequence_parallel, split=cfg.pp_split)  # the model, then the world
    degrees = degrees_for(cfg, world)
    for name, least in spec.least:  # after -1 is resolved: what the name means takes at least that
        if getattr(degrees, name) < least:
            raise ValueError(f"{name}={getattr(degrees, name)} is too few for strategy={spec.name!r}: give {least} or "
                             f"more; {spec.summary}")
    _check_run(cfg, spec, model_cfg, degrees)
    return degrees


def _check_run(cfg: TrainConfig, spec: Strategy, model_cfg: GPTConfig, d: Degrees) -> None:
    """What the layout ``d`` cannot do with this model and batch, one line naming the field: arithmetic
    on the configs alone, so a launcher can ask it before any rank starts."""
    pipelined = spec.pp_impl is not None or d.pp > 1
    rows = check_shard(cfg.batch_size, d.data)
    check_layout(d, model_cfg, rows, cfg.microbatches if pipelined else None, cfg.pp_schedule,
                 spec.pp_impl or "torch", cfg.sequence_parallel, cfg.activation_checkpointing, cfg.pp_split)
    if pipelined and cfg.grad_accum > 1:
        raise ValueError(f"grad_accum={cfg.grad_accum} is not used with a pipeline (pp={d.pp}): its "
                         "microbatches are the accumulation; set grad_accum=1 and microbatches instead")
    if rows % cfg.grad_accum:
        raise ValueError(f"grad_accum={cfg.grad_accum} must divide the {rows} rows each rank gets per "
                         f"step (batch_size={cfg.batch_size} over {d.data} ranks)")
    # Accepted and then ignored, these trained as something else (a GPU check passed fp32 as bf16 parameters)
    if cfg.fsdp_bf16 and d.tokens == 1 and spec.dp_impl == "fsdp":
        where = f"{d.label()} on {d.world} ranks" if d.world > 1 else "one rank"
        raise ValueError(f"fsdp_bf16=True has no effect with {where}: FSDP2 wraps the weights only where ranks "
                         "hold different tokens (dp_replicate x dp_shard x cp > 1); use precision='bf16' here")
    if cfg.sequence_parallel and d.tp == 1:
        raise ValueError(f"sequence_parallel=True has no effect with tp=1 ({d.label()}): it splits what tensor "
                         "parallelism's ranks would each repeat; leave it out")


def degrees_for(cfg: TrainConfig, world: int) -> Degrees:
    """The layout ``cfg``'s strategy gives it on ``world`` ranks; a one-line ValueError naming the field otherwise."""
    spec = strategy(cfg.strategy)
    if spec.one_process and world != 1:
        raise ValueError(f"strategy={spec.name!r} runs on one process but world_size={world}; use 'ddp' (or "
                         "another strategy) for several ranks")
    given: dict[str, int] = {}
    for dim, name in spec.degrees:
        value = getattr(cfg, name) or (spec.unset if dim != spec.rest else 0)  # 0: not given
        if value:
            given[dim] = value
        if value > 0 and world % value:
            raise ValueError(f"{name}={value} must divide world_size={world}: {WHY.get(dim, '')}".rstrip(": "))
    rest = [d for d, v in given.items() if v == -1]
    if len(rest) > 1:
        raise ValueError(f"{' and '.join(f'{d}=-1' for d in rest)}: only one degree can take the ranks the others "
                         "leave; give the others as numbers")
    if rest == ["ep"]:  # ep is carved out of dp_shard: the ranks left shard the weights and split the experts
        if "dp_shard" in given:
            raise ValueError(f"ep=-1 with dp_shard={given['dp_shard']}: ep is carved out of dp_shard, so -1 "
                             "cannot take the ranks left; give ep as a number")
        given["dp_shard"], rest = -1, ["dp_shard"]
    elif given.get("ep", 1) > 1 and spec.rest != "dp_shard" and "dp_shard" not in given:
        given["dp_shard"] = given["ep"]  # ep is carved out of dp_shard (torchtitan): the least that holds it
    if not rest and spec.rest not in given:
        given[spec.rest], rest = -1, [spec.rest]
    # ep spans no ranks of its own: it is carved out of dp_shard (labkit.parallel.layout.degrees)
    others = math.prod(v for d, v in given.items() if d not in (*rest, "ep"))
    if rest:
        if world % others:
            known = Degrees(**{d: v for d, v in given.items() if d not in (*rest, "ep")})
            raise ValueError(f"the degrees {known.label()} multiply to {others}, which does not divide "
                             f"world_size={world}: the ranks left over form the {rest[0]} dimension")
        given[rest[0]] = world // others
    if given.get("ep") == -1:
        given["ep"] = given["dp_shard"]
    degrees = Degrees(**given)
    degrees.check(world)
    if spec.teaching and degrees.world > 1 and max(getattr(degrees, d) for d in DIMS) != world:
        raise ValueError(f"strategy={spec.name!r} is written by hand for one dimension only: its degree must be "
                         f"world_size={world}, here {degrees.label()}; strategy 'mesh' composes the library versions")
    return degrees
