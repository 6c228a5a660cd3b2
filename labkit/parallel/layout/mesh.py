"""One device mesh for every layout: the degree of each parallelism, and every process group a run uses.

In the spirit of torchtitan's ``ParallelDims`` and picotron's process-group manager, a run's layout is
six degrees with torchtitan's meanings (:class:`~labkit.parallel.layout.degrees.Degrees`: the world is
``pp x dp_replicate x dp_shard x cp x tp``, and ``ep`` is carved out of ``dp_shard``), and one object
(:class:`ParallelDims`) builds the mesh once, with ``init_device_mesh``, and hands out every group,
rank and world size that placing the model, reading the data, reducing the loss, clipping and
checkpointing need. Nothing else in labkit builds a process group for a parallelism.

Dimensions, outermost first. Ranks are numbered as ``init_device_mesh`` numbers them, the last
dimension fastest, so an inner dimension's groups are neighbouring ranks: one node's GPUs.

* ``pp``, pipeline stages: one activation per micro-batch to the next stage, the least traffic of
  all, so stages may sit on different nodes (Narayanan et al. 2021, section 3.2, takeaway 1).
* ``dp_replicate``: copies of the model, their gradients all-reduced once per step (HSDP's replicate
  dimension, Zhao et al. 2023): little traffic, across nodes.
* ``dp_shard``: FSDP's shard group (ZeRO-3): an all-gather and a reduce-scatter per block. With
  experts it is two mesh dimensions, ``dp_shard_mod_ep`` outside and ``ep`` inside.
* ``ep``: experts split over ranks, two all-to-alls of tokens per MoE block each way.
* ``cp``: each sequence split over ranks, its K and V passed round a ring in every attention.
* ``tp``, innermost: two all-reduces of activations per block in forward and two in backward, on the
  critical path: NVLink only.

Who holds what. The global batch's rows are split over ``dp_replicate x dp_shard`` (the *data*
ranks); ``cp`` splits each row's tokens; ``tp`` and ``pp`` ranks share rows. The ranks holding
different tokens, ``dp_replicate x dp_shard x cp`` (the *token* ranks), are data parallel for every
dense weight: its gradient is averaged over them. The dense weights are sharded (FSDP2) over
``dp_shard x cp``, ranks that must reduce their gradients together anyway (torchtitan's
``dp_shard_cp``), and replicated over ``dp_replicate``; when that product is 1 they are only
replicated. Experts are split over ``ep``, sharded over ``dp_shard_mod_ep`` and replicated over
``dp_replicate``, as torchtitan places them.
"""
from __future__ import annotations

import torch.distributed as dist

from labkit.parallel.layout.degrees import DIMS, MESH_DIMS, Degrees

__all__ = ["DIMS", "MESH_DIMS", "Degrees", "ParallelDims", "alone_mesh"]


class ParallelDims:
    """The mesh of a run and every group cut from it (a collective: every rank builds it, in order).

    One mesh, the world unflattened once: ``mesh`` has the dimensions of :data:`MESH_DIMS` above 1; ``dense``
    holds the 1-D meshes ``pp``, ``replicate``, ``shard`` and ``tp`` (and HSDP's 2-D ``("replicate",
    "shard")``), the data-parallel dimensions regrouped as FSDP2 takes them (module docstring), cut from
    that mesh without splitting it again (:func:`_built`; HSDP keeps a shard of 1).
    """

    def __init__(self, degrees: Degrees, device_type: str = "cpu") -> None:
        self.degrees, self.device_type = degrees, device_type
        self.rank, self.world = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
        degrees.check(self.world)
        self.coords = degrees.coords(self.rank)
        # tokens_group: the token ranks of this rank's (pp, tp) place, over which the loss and MoE
        # routing are summed; pp_ends_group: the first and last stage, the tied embedding's holders
        self.mesh = self.dense = self.tokens_group = self.pp_ends_group = None
        if self.world > 1:
            self.mesh, self.dense, self.tokens_group, self.pp_ends_group = _built(degrees, device_type, self.rank)

    def __getattr__(self, name: str) -> int:  # ``dims.tp`` etc: the degrees
        if name in DIMS:
            return getattr(self.degrees, name)
        raise AttributeError(name)

    # -- groups, None where the dimension is 1 (nothing to talk to) --
    def group(self, dim: str) -> dist.ProcessGroup | None:
        """The group of ranks that differ only along ``dim`` (one of :data:`DIMS`)."""
        d = self.degrees
        if getattr(d, dim) == 1:
            return None
        if dim == "dp_shard" and d.ep > 1:  # dp_shard is two mesh dimensions, ep inside
            if d.dp_shard_mod_ep == 1:
                return self.mesh["ep"].get_group()
            if d.cp > 1:  # no view holds dp_shard alone then (a MoE refuses cp anyway)
                raise ValueError(f"no single group spans dp_shard in {d.label()}; ask for 'ep' or the dense 'shard'")
            return self.dense_group("shard")  # dp_shard x cp, cp = 1
        return self.mesh["dp_shard_mod_ep" if dim == "dp_shard" else dim].get_group()

    def dense_group(self, dim: str) -> dist.ProcessGroup | None:
        """The ``replicate`` or ``shard`` group of the dense weights (module docstring)."""
        dense = self.dense
        return dense[dim].get_group() if dense is not None and _size(dense, dim) > 1 else None

    def submesh(self, dim: str):
        """``dim``'s 1-D device mesh (DTensor's tensor-parallel mesh, torch's context_parallel)."""
        return self.dense[dim] if dim in ("tp", "pp") else self.mesh[dim]

    def dp_mesh(self):
        """FSDP2's mesh for the dense weights: 1-D ``shard`` (FSDP), or 2-D ``(replicate, shard)`` (HSDP;
        a shard dimension of 1 is pure replication); None on one token rank."""
        d = self.degrees
        if d.tokens == 1:
            return None
        return self.dense["shard"] if d.replicate == 1 else self.dense["replicate", "shard"]

    def expert_mesh(self):
        """FSDP2's mesh for this rank's experts, as :meth:`dp_mesh` over ``(dp_replicate,
        dp_shard_mod_ep)``, the ranks holding the same experts; None when no other rank holds them."""
        d = self.degrees
        if d.dp_replicate * d.dp_shard_mod_ep == 1:
            return None
        return self.mesh["dp_shard_mod_ep"] if d.dp_replicate == 1 else self.mesh["dp_replicate", "dp_shard_mod_ep"]


    # -- this rank's place --
    @property
    def data_rank(self) -> int:
        """Which share of every global batch this rank reads (row-major over dp_replicate, dp_shard)."""
        c, d = self.coords, self.degrees
        return c["dp_replicate"] * d.dp_shard + c["dp_shard"]

    @property
    def data_world(self) -> int:
        return self.degrees.data

    @property
    def tokens_rank(self) -> int:
        """This rank's place among the token ranks: its rows, then its slice of them."""
        return self.data_rank * self.degrees.cp + self.coords["cp"]

    def pp_peer(self, stage_rank: int) -> int:
        """The global rank of pipeline rank ``stage_rank`` at this rank's place in the other dimensions."""
        stride = self.world // self.degrees.pp
        return self.rank % stride + stage_rank * stride

    def dim_of_groups(self) -> dict[str, str]:
        """Each group's name -> the mesh dimension it spans (for counting bytes per dimension)."""
        out: dict[str, str] = {}
        if self.mesh is None:
            return out
        for view, names in ((self.dense, ("replicate", "shard", "tp", "pp")), (self.mesh, MESH_DIMS)):
            for d in names:
                if _size(view, d) > 1:
                    out.setdefault(view[d].get_group().group_name, d)
        if self.tokens_group is not None:
            out.setdefault(self.tokens_group.group_name, "tokens")
        return out


def alone_mesh(device_type: str = "cpu"):
    """A 1-D mesh of one rank (a process group of one must exist): FSDP2 in a group of one still wraps,
    casts to its compute dtype and reshards, which is what a GPU check on one GPU can exercise of it
    (:class:`ParallelDims` builds no mesh for one rank, and labkit's loop trains it without FSDP2)."""
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh(device_type, (1,), mesh_dim_names=("shard",))


# Groups live as long as the process (each gloo group keeps its threads and sockets), so a process that
# trains one layout many times (a lab, a test's grid) builds that layout's groups once: 20 fresh meshes
# per rank left 8 ranks on 2 cores 4x slower a step, measured.
_BUILT: dict[tuple[str, Degrees], tuple] = {}


def _built(d: Degrees, device_type: str, rank: int) -> tuple:
    """``(mesh, dense, tokens_group, pp_ends_group)`` of a layout, built by every rank together the
    first time the default group asks for it.

    The world is split once, into the dimensions of :data:`MESH_DIMS` (each split a collective over every
    rank; on CUDA with a bound device, one NCCL communicator per rank per dimension). Every other view is
    cut from that one mesh, as torchtitan's ``ParallelDims`` slices and flattens its world mesh: the
    dense weights' ``shard`` and the ``tokens`` are flattened from neighbouring dimensions, a new group
    only where they span more than one (a dimension alone is its own group, and tokens over the shard's
    dimensions are the shard's), and HSDP's 2-D mesh is two 1-D meshes side by side
    (``DeviceMesh._concatenate``: no group made). Unflattening the world once per view, as labkit did
    before, split every dimension three times: communicators, warnings and start-up time for nothing."""
    world_group = dist.distributed_c10d._get_default_group()
    hit = _BUILT.get((device_type, d))
    if hit is not None and hit[0] is world_group:
        return hit[1:]
    from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

    world = init_device_mesh(device_type, (d.world,), mesh_dim_names=("world",))
    # HSDP's 2-D meshes keep a shard dimension of 1 (replication alone); FSDP2 takes them so.
    mesh = _view(world, d.mesh_sizes, keep="dp_shard_mod_ep" if d.dp_replicate > 1 else "")
    made: dict[tuple[str, ...], object] = {}
    dense = {"pp": _joined(mesh, ("pp",), "pp", made), "replicate": _joined(mesh, ("dp_replicate",), "", made),
             "shard": _joined(mesh, ("dp_shard_mod_ep", "ep", "cp"), "shard", made),
             "tp": _joined(mesh, ("tp",), "", made)}
    if dense["replicate"] is not None:
        dense["replicate", "shard"] = DeviceMesh._concatenate([dense["replicate"], dense["shard"]])
    tokens = _joined(mesh, ("dp_replicate", "dp_shard_mod_ep", "ep", "cp"), "tokens", made)
    tokens_group = tokens.get_group() if d.tokens > 1 else None
    pp_ends = _pp_ends(d, mesh, rank)
    _BUILT[(device_type, d)] = (world_group, mesh, dense, tokens_group, pp_ends)
    return mesh, dense, tokens_group, pp_ends


def _size(view, dim: str) -> int:
    """``dim``'s size in a view (1 where the view left it out): the mesh, or the dense meshes by name."""
    if isinstance(view, dict):
        return view[dim].size() if view.get(dim) is not None else 1
    return view[dim].size() if dim in view.mesh_dim_names else 1


def _joined(mesh, dims: tuple[str, ...], name: str, made: dict):
    """The 1-D mesh over ``dims`` of ``mesh`` together: a dimension above 1 alone is itself; several are
    flattened into ``name`` (once: ``made`` keeps what was flattened); none above 1, the kept dimension
    of 1 (HSDP's shard), or None."""
    there = [n for n in dims if n in mesh.mesh_dim_names]
    above = tuple(n for n in there if mesh[n].size() > 1)
    if len(above) > 1:
        if above not in made:
            made[above] = mesh[above]._flatten(name)
        return made[above]
    return mesh[(above or there)[0]] if there else None


def _view(world, sizes: dict[str, int], keep: str = ""):
    """``world`` unflattened into the dimensions of ``sizes`` above 1 (and ``keep``): DeviceMesh builds
    world-many groups for every dimension, each creation synchronised over all ranks, so a dimension
    of 1 would cost as much as one of 2 and hold nothing."""
    names = tuple(n for n, size in sizes.items() if size > 1 or n == keep)
    return world._unflatten(0, tuple(sizes[n] for n in names), names)


def _pp_ends(d: Degrees, mesh, rank: int) -> dist.ProcessGroup | None:
    """The first and last pipeline stage at this rank's place in the other dimensions, the two holders
    of the tied embedding / head matrix (Megatron-LM's embedding group): the pp group when pp = 2."""
    if d.pp == 1:
        return None
    if d.pp == 2:
        return mesh["pp"].get_group()
    stride, mine = d.world // d.pp, None
    for q in range(stride):  # every rank takes part in creating every group, in the same order
        group = dist.new_group([q, q + (d.pp - 1) * stride])
        mine = group if rank % stride == q else mine
    return mine
