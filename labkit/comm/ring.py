"""The ring all-reduce written out with point-to-point messages, for teaching.

Ring all-reduce (Patarasuk & Yuan 2009; popularised for deep learning by Baidu's ring-allreduce and
Horovod, Sergeev & Del Balso 2018): N ranks in a ring, the tensor cut into N chunks; N-1 steps of
reduce-scatter then N-1 steps of all-gather, each step sending one chunk of size Psi/N to the next
rank. Every rank therefore sends ``2 (N-1)/N * Psi`` bytes, independent of N for large N.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from labkit.comm.p2p import exchange
from labkit.core.checks import positive_int
from labkit.core.devices import comm_device


def ring_bytes_per_rank(payload_bytes: int, world_size: int) -> float:
    """Bytes each rank sends in a ring all-reduce of ``payload_bytes``: 2(N-1)/N * Psi."""
    positive_int("world_size", world_size)
    return 2 * (world_size - 1) / world_size * payload_bytes


def ring_all_reduce(tensor: torch.Tensor, group: dist.ProcessGroup | None = None) -> int:
    """Sum ``tensor`` over all ranks in place with the ring algorithm; return bytes this rank sent.

    Written with point-to-point messages only, for teaching; ``tests/`` hold it equal to
    ``dist.all_reduce``. Each of the 2(N-1) steps sends one chunk to the next rank and receives one
    from the previous as a single group (:func:`labkit.comm.p2p.exchange`): on two ranks both
    neighbours are the same peer, and a send posted before its receive would wait forever under NCCL.
    """
    n = dist.get_world_size(group)
    rank = dist.get_rank(group)
    if n == 1:
        return 0
    to_global = (lambda r: dist.get_global_rank(group, r)) if group is not None else (lambda r: r)
    nxt, prv = to_global((rank + 1) % n), to_global((rank - 1) % n)
    chunks = list(tensor.view(-1).tensor_split(n))
    recv_buf = torch.empty_like(chunks[0])
    sent = 0

    def step(send_idx: int, recv_idx: int) -> torch.Tensor:
        nonlocal sent
        # Empty chunks (a tensor smaller than the ring) are skipped on both sides alike: the chunk
        # rank r receives is the chunk rank r-1 sends.
        buf, out = recv_buf[: chunks[recv_idx].numel()], chunks[send_idx].contiguous()
        exchange([(out, nxt)], [(buf, prv)], group)
        sent += out.numel() * out.element_size()
        return buf

    # Reduce-scatter: after step s, rank r holds the partial sum of chunk (r - s - 1) over s+2 ranks;
    # after N-1 steps it owns the complete sum of chunk (r + 1) mod N.
    for s in range(n - 1):
        chunks[(rank - s - 1) % n] += step((rank - s) % n, (rank - s - 1) % n)
    # All-gather: pass the completed chunks around the ring.
    for s in range(n - 1):
        chunks[(rank - s) % n].copy_(step((rank + 1 - s) % n, (rank - s) % n))
    return sent


def ring_check(numel: int, seed: int = 0) -> dict:
    """Run on every rank: the hand-written ring against ``dist.all_reduce`` on the same tensor.

    Returns this rank's bytes sent, the ring formula's prediction and the largest difference between
    the two sums.
    """
    positive_int("numel", numel)
    rank, n = dist.get_rank(), dist.get_world_size()
    device = comm_device()
    x = torch.randn(numel, generator=torch.Generator().manual_seed(seed + rank)).to(device)
    ours, ref = x.clone(), x.clone()
    sent = ring_all_reduce(ours)
    dist.all_reduce(ref)
    payload = x.numel() * x.element_size()
    return {"rank": rank, "world_size": n, "payload_bytes": payload, "bytes_sent": sent,
            "formula_bytes": ring_bytes_per_rank(payload, n),
            "max_abs_diff": (ours - ref).abs().max().item()}
