"""Count what the real collectives are handed: calls and payload bytes per op, for any strategy.

:class:`CommCounter` is a ``TorchDispatchMode``: every c10d collective (the ops DDP's C++ reducer,
FSDP2 and DTensor all dispatch through) passes through it, so it counts calls and payload bytes of
any strategy without patching ``torch.distributed``. :func:`ring_volume` turns those payloads into
the bytes a rank sends under ring algorithms, the unit of the ZeRO paper's volume accounting.
"""
from __future__ import annotations

from collections import defaultdict

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode


def _tensor_bytes(a) -> int:
    if isinstance(a, torch.Tensor):
        return a.numel() * a.element_size()
    if isinstance(a, (list, tuple)) and a:
        flat = [t for x in a for t in (x if isinstance(x, (list, tuple)) else [x])]
        if all(isinstance(t, torch.Tensor) for t in flat):
            return sum(t.numel() * t.element_size() for t in flat)
    return 0


def _payload_bytes(name: str, args: tuple) -> int:
    """Bytes of the *whole* tensor a collective works on, whichever argument holds it.

    All-reduce and broadcast: the tensor. All-gather: the gathered output (the first argument of
    ``_allgather_base_``). Reduce-scatter: the full input (the second argument of
    ``_reduce_scatter_base_``). This is the Psi of the ZeRO paper's volume accounting.
    """
    tensors = [a for a in args if _tensor_bytes(a)]
    if not tensors:
        return 0
    if "reduce_scatter" in name and len(tensors) > 1:
        return _tensor_bytes(tensors[1])
    return _tensor_bytes(tensors[0])


# Bytes each rank sends per byte of payload, for ring algorithms over N ranks: an all-reduce is a
# reduce-scatter plus an all-gather, each moving (N-1)/N of the payload.
RING_FACTOR = {"allreduce": 2, "allgather_base": 1, "allgather": 1, "reduce_scatter_base": 1,
               "reduce_scatter": 1, "reduce": 1}


def ring_volume(bytes_by_op: dict[str, int], world_size: int) -> float:
    """Bytes one rank sends for these collectives under ring algorithms: sum of factor x (N-1)/N x payload."""
    frac = (world_size - 1) / world_size
    return sum(RING_FACTOR.get(op, 0) * b * frac for op, b in bytes_by_op.items())


def _group_name(func, args: tuple) -> str:
    """The name of the process group a collective runs on ("?" where it cannot be told): c10d ops
    carry the group object, functional ones its name (their last string argument)."""
    if func.namespace == "_c10d_functional":
        names = [a for a in args if isinstance(a, str)]
        return names[-1] if names else "?"
    for a in args:
        if type(a).__name__ == "ScriptObject":
            try:
                return dist.ProcessGroup.unbox(a).group_name
            except RuntimeError:  # another script object (a ReduceOp)
                continue
    return "?"


class CommCounter(TorchDispatchMode):
    """Count collective calls and payload bytes per op name while active.

    ``with CommCounter() as c: step()`` then ``c.bytes["allreduce"]``, ``c.calls["allreduce"]``.
    Op names drop the namespace and the trailing underscore (``c10d.allreduce_`` -> ``allreduce``).
    ``c.ops`` counts every other operator dispatched, ``"plain"`` and ``"dtensor"`` apart (an operator
    on a DTensor is counted once, not its local work): what an overhead-bound step is made of
    (:mod:`labkit.planning.cpu_model`).
    """

    NAMESPACES = ("c10d", "_c10d_functional")
    # DTensor's functional collectives are followed by a wait_tensor on their result and wrapped for
    # autograd: ops in these namespaces that move no data (counting them would double the bytes).
    NO_DATA = ("wait_tensor", "wrap_tensor_autograd")
    # The functional collectives under the c10d names that ring_volume and the labs use.
    # Coalesced forms (several tensors in one call, as FSDP2 and bucketed reductions issue them) count
    # under the plain names, so the ring model weighs them too.
    C10D_NAME = {"all_reduce": "allreduce", "all_gather_into_tensor": "allgather_base",
                 "reduce_scatter_tensor": "reduce_scatter_base", "all_reduce_coalesced": "allreduce",
                 "allreduce_coalesced": "allreduce", "all_gather_into_tensor_coalesced": "allgather_base",
                 "allgather_into_tensor_coalesced": "allgather_base",
                 "reduce_scatter_tensor_coalesced": "reduce_scatter_base"}

    def __init__(self) -> None:
        super().__init__()
        self.bytes: dict[str, int] = defaultdict(int)
        self.calls: dict[str, int] = defaultdict(int)
        # payload bytes per process group (its name) and op: which mesh dimension carried what
        self.by_group: dict[str, dict[str, int]] = defaultdict(lambda: defaultdict(int))
        self.ops: dict[str, int] = defaultdict(int)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func.namespace in self.NAMESPACES:
            raw = func._schema.name.split("::")[-1].rstrip("_").lstrip("_")
            if raw not in self.NO_DATA:
                name = self.C10D_NAME.get(raw, raw)
                self.calls[name] += 1
                # A functional all-gather is handed its input shard: its payload is what it returns
                gathered = func.namespace == "_c10d_functional" and raw.startswith("all_gather")
                nbytes = _tensor_bytes(out) if gathered else _payload_bytes(name, args)
                self.bytes[name] += nbytes
                self.by_group[_group_name(func, args)][name] += nbytes
        else:
            self.ops["dtensor" if any(t.__name__ == "DTensor" for t in types) else "plain"] += 1
        return out

    @property
    def total_bytes(self) -> int:
        return sum(self.bytes.values())
