"""A run's parallelism, said once: the six degrees as asked and how each parallelism is done.

torchtitan keeps one ``[parallelism]`` section in its job config: the degrees (``-1`` takes the ranks
the others leave) and the implementation choices (pipeline schedule, microbatches, FSDP's
resharding). :class:`Parallelism` is that section. A strategy preset of :mod:`labkit.train.strategies`
is only a name that expands to one (``--strategy tp`` is ``--tp -1``); :func:`labkit.train.validate.validate`
resolves its degrees for the world size (:meth:`Parallelism.resolve`); placement
(:func:`labkit.parallel.compose.place`) and the loop read nothing else about the layout.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from labkit.parallel.layout.degrees import DIMS, Degrees

if TYPE_CHECKING:
    from labkit.parallel.pipeline.stages import Split

# Why each degree must divide the world size, in the words of the one-line error
WHY = {"tp": "(data-parallel x tensor-parallel ranks)",
       "cp": "groups of cp ranks share each sequence, the world_size/cp groups are data parallel",
       "ep": "each group of ep ranks holds all the experts, carved out of the dp_shard ranks",
       "pp": "pp stages, the world_size/pp groups of them data parallel",
       "dp_replicate": "each of the replicas holds a copy sharded over world_size/replicas ranks"}


@dataclass(frozen=True)
class Parallelism:
    """The degrees (torchtitan's ``ParallelDims`` meanings; at most one is -1, the ranks the others
    leave; ``ep=-1`` is ``ep = dp_shard``) and the implementation of each parallelism."""

    pp: int = 1
    dp_replicate: int = 1
    dp_shard: int = -1
    ep: int = 1
    cp: int = 1
    tp: int = 1
    # "fsdp" (FSDP2, HSDP, or replication through it), "ddp", "naive", "bucketed", or "none" (a
    # hand-written ZeRO optimizer, or DeepSpeed's engine, synchronises the gradients itself)
    dp_impl: str = "fsdp"
    tp_impl: str = "dtensor"  # or "scratch": the hand-written column/row-parallel layers
    pp_impl: str | None = None  # "torch" or "scratch": runs the pipeline schedule (even on one stage)
    pp_schedule: str = "1f1b"
    pp_split: Split | None = None  # stages per rank, first and last stage's layers (None: the schedule's)
    microbatches: int = 1
    sequence_parallel: bool = False
    reshard_after_forward: bool = True
    cpu_offload: bool = False
    fsdp_bf16: bool = False
    bucket_cap_mb: float = 25.0
    sync_each_microbatch: bool = False  # not only the last micro-batch's backward synchronises

    @property
    def pipelined(self) -> bool:
        """Whether a pipeline schedule runs the step (a ``pp`` preset runs one even on one stage)."""
        return self.pp_impl is not None or self.pp > 1

    @property
    def asked(self) -> Degrees:
        """The degrees known before the world size, for the checks on the model alone: the ones given
        as numbers (dp_shard only as the least that holds ep)."""
        given = {d: getattr(self, d) for d in DIMS if getattr(self, d) > 0 and d != "dp_shard"}
        if "ep" in given:
            given["dp_shard"] = given["ep"]
        return Degrees(**given)

    def resolve(self, world: int) -> Parallelism:
        """The same parallelism with its -1 replaced by the ranks the others leave of ``world``; a
        one-line ValueError naming the degree when they cannot make ``world`` ranks."""
        for d in DIMS:
            value = getattr(self, d)
            if value > 0 and world % value:
                raise ValueError(f"{d}={value} must divide world_size={world}: {WHY.get(d, '')}".rstrip(": "))
        rest = [d for d in DIMS if getattr(self, d) == -1 and d != "ep"]
        # ep spans no ranks of its own: it is carved out of dp_shard (labkit.parallel.layout.degrees)
        others = math.prod(getattr(self, d) for d in DIMS if d not in (*rest, "ep"))
        resolved = {}
        if rest:
            if world % others:
                known = Degrees(**{d: getattr(self, d) for d in DIMS if d not in (*rest, "ep")})
                raise ValueError(f"the degrees {known.label()} multiply to {others}, which does not divide "
                                 f"world_size={world}: the ranks left over form the {rest[0]} dimension")
            resolved[rest[0]] = world // others
        if self.ep == -1:
            resolved["ep"] = resolved.get("dp_shard", self.dp_shard)
        out = replace(self, **resolved)
        out.degrees.check(world)
        return out

    @property
    def degrees(self) -> Degrees:
        """The six degrees, once resolved (:meth:`resolve`)."""
        return Degrees(**{d: getattr(self, d) for d in DIMS})
