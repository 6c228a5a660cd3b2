"""Collectives: the ring all-reduce written out, and a counter of what the real ones are sent.

Ring all-reduce (Patarasuk & Yuan 2009; popularised for deep learning by Baidu's ring-allreduce and
Horovod, Sergeev & Del Balso 2018): N ranks in a ring, the tensor cut into N chunks; N-1 steps of
reduce-scatter then N-1 steps of all-gather, each step sending one chunk of size Psi/N to the next
rank. Every rank therefore sends ``2 (N-1)/N * Psi`` bytes, independent of N for large N.

:class:`CommCounter` is a ``TorchDispatchMode``: every c10d collective (the ops DDP's C++ reducer,
FSDP2 and DTensor all dispatch through) passes through it, so it counts calls and payload bytes of
any strategy without patching ``torch.distributed``.
"""
from __future__ import annotations

from collections import defaultdict

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode


def ring_bytes_per_rank(payload_bytes: int, world_size: int) -> float:
    """Bytes each rank sends in a ring all-reduce of ``payload_bytes``: 2(N-1)/N * Psi."""
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size!r}")
    return 2 * (world_size - 1) / world_size * payload_bytes


def ring_all_reduce(tensor: torch.Tensor, group: dist.ProcessGroup | None = None) -> int:
    """Sum ``tensor`` over all ranks in place with the ring algorithm; return bytes this rank sent.

    Written with point-to-point ``isend``/``recv`` only, for teaching; ``tests/`` hold it equal to
    ``dist.all_reduce``.
    """
    n = dist.get_world_size(group)
    rank = dist.get_rank(group)
    if n == 1:
        return 0
    nxt, prv = (rank + 1) % n, (rank - 1) % n
    to_global = (lambda r: dist.get_global_rank(group, r)) if group is not None else (lambda r: r)
    flat = tensor.view(-1)
    chunks = list(flat.tensor_split(n))
    recv_buf = torch.empty_like(chunks[0]) if chunks[0].numel() else chunks[0]
    sent = 0

    def exchange(send_idx: int, recv_idx: int) -> torch.Tensor:
        nonlocal sent
        buf = recv_buf[: chunks[recv_idx].numel()]
        out = chunks[send_idx]
        # Empty chunks (tensor smaller than the ring) are skipped on both sides alike: the chunk
        # rank r receives is the chunk rank r-1 sends.
        req = dist.isend(out.contiguous(), to_global(nxt), group=group) if out.numel() else None
        if buf.numel():
            dist.recv(buf, to_global(prv), group=group)
        if req is not None:
            req.wait()
        sent += out.numel() * out.element_size()
        return buf

    # Reduce-scatter: after step s, rank r holds the partial sum of chunk (r - s - 1) over s+2 ranks;
    # after N-1 steps it owns the complete sum of chunk (r + 1) mod N.
    for s in range(n - 1):
        send_idx, recv_idx = (rank - s) % n, (rank - s - 1) % n
        chunks[recv_idx] += exchange(send_idx, recv_idx)
    # All-gather: pass the completed chunks around the ring.
    for s in range(n - 1):
        send_idx, recv_idx = (rank + 1 - s) % n, (rank - s) % n
        chunks[recv_idx].copy_(exchange(send_idx, recv_idx))
    return sent


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


class CommCounter(TorchDispatchMode):
    """Count collective calls and payload bytes per op name while active.

    ``with CommCounter() as c: step()`` then ``c.bytes["allreduce"]``, ``c.calls["allreduce"]``.
    Op names drop the namespace and the trailing underscore (``c10d.allreduce_`` -> ``allreduce``).
    """

    NAMESPACES = ("c10d", "_c10d_functional")
    # DTensor's functional collectives are followed by a wait_tensor on their result and wrapped for
    # autograd: ops in these namespaces that move no data (counting them would double the bytes).
    NO_DATA = ("wait_tensor", "wrap_tensor_autograd")
    # The functional collectives under the c10d names that ring_volume and the labs use.
    C10D_NAME = {"all_reduce": "allreduce", "all_gather_into_tensor": "allgather_base",
                 "reduce_scatter_tensor": "reduce_scatter_base"}

    def __init__(self) -> None:
        super().__init__()
        self.bytes: dict[str, int] = defaultdict(int)
        self.calls: dict[str, int] = defaultdict(int)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.namespace in self.NAMESPACES:
            name = func._schema.name.split("::")[-1].rstrip("_").lstrip("_")
            if name not in self.NO_DATA:
                name = self.C10D_NAME.get(name, name)
                self.calls[name] += 1
                self.bytes[name] += _payload_bytes(name, args)
        return func(*args, **(kwargs or {}))

    @property
    def total_bytes(self) -> int:
        return sum(self.bytes.values())


def ring_check(numel: int, seed: int = 0) -> dict:
    """Run on every rank: the hand-written ring against ``dist.all_reduce`` on the same tensor.

    Returns this rank's bytes sent, the ring formula's prediction and the largest difference between
    the two sums.
    """
    if numel < 1:
        raise ValueError(f"numel must be a positive integer, got {numel!r}")
    rank, n = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else "cpu"
    x = torch.randn(numel, generator=torch.Generator().manual_seed(seed + rank)).to(device)
    ours, ref = x.clone(), x.clone()
    sent = ring_all_reduce(ours)
    dist.all_reduce(ref)
    payload = x.numel() * x.element_size()
    return {"rank": rank, "world_size": n, "payload_bytes": payload, "bytes_sent": sent,
            "formula_bytes": ring_bytes_per_rank(payload, n),
            "max_abs_diff": (ours - ref).abs().max().item()}
