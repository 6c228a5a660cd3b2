"""A run's layout as six degrees, with torchtitan's meanings (``ParallelDims``), and where each rank sits.

The world is ``pp x dp_replicate x dp_shard x cp x tp`` ranks. Expert parallelism is not a sixth
factor: as in torchtitan, the ``ep`` ranks are carved out of the ranks that already shard the dense
weights, so ``--dp-shard 2 --ep 2`` is two ranks, each holding half the experts, and degrees copied
from a torchtitan config mean the same run here. torchtitan lets ``ep`` take every ``cp`` rank too
(``ep % cp == 0``); labkit refuses a mixture of experts under context parallelism
(:func:`labkit.parallel.layout.checks.check_layout`), so here ``ep`` divides ``dp_shard``.

The mesh the ranks form has torchtitan's dimensions (:data:`MESH_DIMS`, outermost first): ``dp_shard``
is split into ``dp_shard_mod_ep`` (the ranks holding the same experts, which FSDP shards them over)
and ``ep`` inside it; without experts ``dp_shard_mod_ep`` is ``dp_shard`` itself.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, fields

from labkit.core.checks import positive_int

DIMS = ("pp", "dp_replicate", "dp_shard", "ep", "cp", "tp")  # the degrees, as a run asks for them
MESH_DIMS = ("pp", "dp_replicate", "dp_shard_mod_ep", "ep", "cp", "tp")  # the mesh they make
# Which mesh dimensions each degree's groups span: dp_shard holds the ep ranks inside it
_SPANS = {d: (d,) for d in DIMS} | {"dp_shard": ("dp_shard_mod_ep", "ep")}


@dataclass(frozen=True)
class Degrees:
    """How many ranks each parallelism spans; ``ep`` is carved out of ``dp_shard`` (module docstring)."""

    pp: int = 1
    dp_replicate: int = 1
    dp_shard: int = 1
    ep: int = 1
    cp: int = 1
    tp: int = 1

    def __post_init__(self) -> None:
        for f in fields(self):
            positive_int(f.name, getattr(self, f.name))
        if self.dp_shard % self.ep:
            raise ValueError(f"ep={self.ep} must divide dp_shard={self.dp_shard}: as in torchtitan, the expert-"
                             f"parallel ranks are carved out of the ranks that shard (--dp-shard {self.ep} "
                             f"--ep {self.ep} is {self.ep} ranks)")

    @property
    def world(self) -> int:
        return math.prod(self.mesh_sizes.values())

    @property
    def dp_shard_mod_ep(self) -> int:
        """Ranks holding the same experts, which FSDP shards them over (torchtitan's name)."""
        return self.dp_shard // self.ep

    @property
    def mesh_sizes(self) -> dict[str, int]:
        """The size of each of :data:`MESH_DIMS`."""
        return {"pp": self.pp, "dp_replicate": self.dp_replicate, "dp_shard_mod_ep": self.dp_shard_mod_ep,
                "ep": self.ep, "cp": self.cp, "tp": self.tp}

    @property
    def data(self) -> int:
        """Ranks reading different rows of the global batch."""
        return self.dp_replicate * self.dp_shard

    @property
    def tokens(self) -> int:
        """Ranks holding different tokens: every dense gradient is averaged over them."""
        return self.data * self.cp

    @property
    def shard(self) -> int:
        """Ranks each dense weight is sharded over (FSDP's shard group, torchtitan's ``dp_shard_cp``)."""
        return self.dp_shard * self.cp

    @property
    def replicate(self) -> int:
        """Copies of each dense weight's shard, all-reduced across."""
        return self.dp_replicate

    def check(self, world: int) -> None:
        """A ValueError in one line unless the degrees multiply to ``world``."""
        if self.world != world:
            raise ValueError(f"the degrees {self.label()} multiply to {self.world}, not world_size={world}: "
                             f"pp x dp_replicate x dp_shard x cp x tp must equal the number of ranks "
                             f"(ep is carved out of dp_shard)")

    def label(self) -> str:
        """``"pp=2 dp_shard=2 tp=2"``: the degrees above 1 (``"single"`` when none)."""
        return " ".join(f"{d}={getattr(self, d)}" for d in DIMS if getattr(self, d) > 1) or "single"

    def mesh_coords(self, rank: int) -> dict[str, int]:
        """Rank ``rank``'s place along each of :data:`MESH_DIMS`: row-major, the last fastest, as
        ``init_device_mesh`` numbers a mesh."""
        out, sizes = {}, self.mesh_sizes
        for d in reversed(MESH_DIMS):
            out[d], rank = rank % sizes[d], rank // sizes[d]
        return {d: out[d] for d in MESH_DIMS}

    def coords(self, rank: int) -> dict[str, int]:
        """Rank ``rank``'s place along each degree: its ``dp_shard`` coordinate counts the ``ep`` ranks
        inside (``dp_shard_mod_ep x ep + ep``)."""
        m = self.mesh_coords(rank)
        return {"pp": m["pp"], "dp_replicate": m["dp_replicate"], "dp_shard": m["dp_shard_mod_ep"] * self.ep + m["ep"],
                "ep": m["ep"], "cp": m["cp"], "tp": m["tp"]}

    def groups(self) -> dict[str, list[list[int]]]:
        """The ranks of every group along each degree above 1: the ranks that differ only there."""
        out: dict[str, list[list[int]]] = {}
        for d in DIMS:
            if getattr(self, d) > 1:
                keyed: dict[tuple, list[int]] = {}
                for r in range(self.world):
                    c = self.mesh_coords(r)
                    keyed.setdefault(tuple(v for k, v in c.items() if k not in _SPANS[d]), []).append(r)
                out[d] = list(keyed.values())
        return out

    def flags(self) -> list[str]:
        """The degree flags of ``python -m labkit.train`` for this layout."""
        return [x for d in DIMS if getattr(self, d) > 1 for x in ("--" + d.replace("_", "-"), str(getattr(self, d)))]
