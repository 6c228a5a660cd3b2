"""What one rank trains once the model is placed on the mesh, and what differs in its step because of it.

:func:`labkit.parallel.compose.place` returns a :class:`Placed`; the training loop's step asks it
only these things: the batch this rank's tokens are cut from (:meth:`Placed.shard_batch`), whether to
synchronise gradients after a micro-batch (:meth:`Placed.sync`), what must happen to gradients
between the last backward and clipping (:meth:`Placed.finish_gradients`), which ranks share each
gradient for the global norm (:meth:`Placed.norm_groups`), and the whole model back
(:meth:`Placed.full_state_dict`).
"""
from __future__ import annotations

from contextlib import nullcontext
from dataclasses import dataclass, field
from typing import Any, Callable, ContextManager

import torch
import torch.distributed as dist
import torch.nn as nn

from labkit.parallel.clipping import dtensor_groups
from labkit.parallel.layout.mesh import ParallelDims


@dataclass(eq=False)
class Placed:
    model: nn.Module  # what forward calls: the GPT, a data-parallel wrapper of it, or this rank's stages
    module: nn.Module  # the same without a wrapper: state dicts and checkpoints read it (GPT names)
    dims: ParallelDims
    parts: list[nn.Module]  # the GPT, or the pipeline stages this rank holds
    experts: set[int] = field(default_factory=set)  # ids of this rank's expert parameters
    scratch_tp: bool = False  # hand-written TP shards (plain tensors, ``tp_shard_dim``)
    pipeline: Any = None  # a labkit.parallel.pipeline.runner.Pipeline when the layers are staged
    fsdp_roots: list[nn.Module] = field(default_factory=list)
    # This rank's tokens' share of the global batch's tokens, which its loss is multiplied by before
    # backward when its data parallelism sums gradients (FSDP2, labkit.parallel.compose); 1: it
    # averages (DDP, the hand-written versions, ZeRO-1 by hand, DeepSpeed), or the rank is alone
    loss_weight: float = 1.0
    # What a technique must do to the gradients between the last backward and clipping, registered by
    # the placement that makes it necessary, in placement order (labkit.parallel.compose.place)
    finishers: list[Callable[[], None]] = field(default_factory=list)

    @property
    def params(self) -> list[nn.Parameter]:
        return [p for p in self.model.parameters() if p.requires_grad]

    def shard_batch(self, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's tokens of its rows: under context parallelism, its two zig-zag chunks of each."""
        cp = self.dims.degrees.cp
        if cp == 1:
            return x, y
        from labkit.parallel.context.layout import zigzag_shard

        r = self.dims.coords["cp"]
        return zigzag_shard(x, cp, r, dim=1), zigzag_shard(y, cp, r, dim=1)

    def sync(self, last: bool) -> ContextManager:
        """Synchronise gradients after this micro-batch only when ``last`` (accumulation skips the rest)."""
        for root in self.fsdp_roots:
            root.set_requires_gradient_sync(last)  # reduce-scatter only after the last micro-batch
        return self.model.no_sync() if not last and hasattr(self.model, "no_sync") else nullcontext()

    def finish_gradients(self) -> None:
        """Between the last backward and clipping: what each technique registered (:attr:`finishers`):
        sequence-parallel gradients still ``Partial`` reduced, a hand-written data parallel's
        synchronisation, the two copies of a tied matrix summed."""
        for finish in self.finishers:
            finish()

    def norm_groups(self, p: torch.Tensor) -> tuple:
        """The groups ``p``'s gradient is split over, each element counted once in the global norm:
        its DTensor shards (TP, FSDP), the EP group for an expert, the pipeline's stages for all."""
        if self.scratch_tp:
            groups = (self.dims.group("tp"),) if getattr(p, "tp_shard_dim", None) is not None else ()
        else:
            groups = dtensor_groups(p)
        if id(p) in self.experts and self.dims.degrees.ep > 1:
            groups += (self.dims.group("ep"),)
        if self.dims.degrees.pp > 1:
            groups += (self.dims.group("pp"),)
        return tuple(g for g in groups if g is not None and dist.get_world_size(g) > 1)

    @property
    def state_aliases(self) -> dict[str, str]:
        """Parameters whose optimizer state a checkpoint keeps under another's name: the last stage's
        copy of the tied matrix, under the embedding's (as one process keeps it), so that a checkpoint
        reads the same whichever layout wrote it."""
        return {"head.weight": "wte.weight"} if self.norm_skip else {}

    @property
    def norm_skip(self) -> list[torch.Tensor]:
        """Copies counted elsewhere: the last stage's head, whose twin on the first stage is counted."""
        last = self.pipeline.last if self.pipeline is not None else None
        return [last.head.weight] if last is not None and self.dims.degrees.pp > 1 else []

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """One process's state dict on every rank, on the CPU (a collective): DTensor and hand-written
        shards gathered, the stages' and the experts' parts merged."""
        out = {}
        for name, t in self.module.state_dict(keep_vars=True).items():
            if hasattr(t, "full_tensor"):
                t = t.full_tensor()
            elif getattr(t, "tp_shard_dim", None) is not None:
                parts = [torch.empty_like(t) for _ in range(self.dims.degrees.tp)]
                dist.all_gather(parts, t.detach().contiguous(), group=self.dims.group("tp"))
                t = torch.cat(parts, dim=t.tp_shard_dim)
            out[name] = t.detach().cpu().clone()
        for dim in ("pp", "ep"):
            if self.dims.group(dim) is not None:
                from labkit.core.devices import gather_objects

                for part in gather_objects(out, self.dims.group(dim)):
                    out.update(part)
        return out
