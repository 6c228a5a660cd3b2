"""In-memory checkpoints: each rank's state kept in its own memory and in a peer's.

Gemini (Wang et al., SOSP 2023) checkpoints to the CPU memory of the training machines themselves,
each machine's checkpoint also placed on another machine, and falls back to remote storage only when
both copies are gone: a failed machine's replacement restores from its peer over the network instead
of reading storage. torchft recovers a replaced replica from a healthy one the same way, and
ByteCheckpoint (Wan et al. 2024) keeps disk saves off the critical path by staging in memory first.

:class:`PeerSnapshot` is that idea for ranks in a ring: :meth:`take` copies this rank's tensors to
host memory and exchanges copies with its neighbours (one ``batch_isend_irecv``: send to rank r+1,
receive from r-1), so rank r holds its own snapshot and rank r-1's. :meth:`restore` brings a
replaced rank's snapshot back from the rank that holds it; every other rank restores from its own
memory. It survives one lost rank (or any set of non-adjacent ones); two neighbours lost together
take a snapshot with them, and then the disk checkpoint is what is left. The tensors go as float32
(the lab's states are float32; a bf16 state would need its own buffer).
"""
from __future__ import annotations

import time

import torch
import torch.distributed as dist

from labkit.core.devices import comm_device


def _flat(tensors: dict[str, torch.Tensor]) -> torch.Tensor:
    return torch.cat([t.detach().reshape(-1).to("cpu", torch.float32) for t in tensors.values()])


def _exchange(sends: list[tuple[torch.Tensor, int]], recvs: list[tuple[torch.Tensor, int]]) -> None:
    """Point-to-point transfers in one ``batch_isend_irecv`` (NCCL pairs them; NOTES.md), through the
    communication device; host buffers in and out."""
    dev = comm_device()
    send_bufs = [(t.to(dev), peer) for t, peer in sends]
    recv_bufs = [(torch.empty_like(t, device=dev), peer) for t, peer in recvs]
    ops = [dist.P2POp(dist.isend, t, p) for t, p in send_bufs] + [dist.P2POp(dist.irecv, t, p) for t, p in recv_bufs]
    if ops:
        for work in dist.batch_isend_irecv(ops):
            work.wait()
    for (host, _), (buf, _) in zip(recvs, recv_bufs):
        host.copy_(buf)


def holder(rank: int, world: int) -> int:
    """The rank whose memory holds ``rank``'s snapshot besides its own: the next one in the ring."""
    return (rank + 1) % world


class PeerSnapshot:
    """This rank's snapshot (``own``) and its ring predecessor's (``held``), with the step they hold."""

    def __init__(self) -> None:
        self.step: int | None = None
        self.own: torch.Tensor | None = None
        self.held: torch.Tensor | None = None

    def take(self, step: int, tensors: dict[str, torch.Tensor]) -> float:
        """Snapshot ``tensors`` as of ``step`` here and on the next rank; a collective (a ring of
        point-to-point transfers). Returns the seconds it blocked."""
        t0 = time.perf_counter()
        rank, world = dist.get_rank(), dist.get_world_size()
        own = _flat(tensors)
        held = torch.empty_like(own)
        _exchange([(own, holder(rank, world))], [(held, (rank - 1) % world)])
        self.step, self.own, self.held = step, own, held
        return time.perf_counter() - t0

    def restore(self, tensors: dict[str, torch.Tensor], replaced: list[int]) -> float:
        """Load the snapshot into ``tensors`` (in place) on every rank; the ranks in ``replaced`` (new
        processes, nothing in memory) receive theirs from the rank after them, which holds it. A
        collective. Returns the seconds it took on this rank."""
        t0 = time.perf_counter()
        rank, world = dist.get_rank(), dist.get_world_size()
        sends, recvs = [], []
        if rank in replaced:
            self.own = torch.empty(sum(t.numel() for t in tensors.values()))
            recvs.append((self.own, holder(rank, world)))
        if (rank - 1) % world in replaced:
            if rank in replaced or self.held is None:
                raise RuntimeError(f"rank {(rank - 1) % world}'s snapshot was lost with rank {rank}: restore "
                                   "from disk")
            sends.append((self.held, (rank - 1) % world))
        _exchange(sends, recvs)
        offset = 0
        with torch.no_grad():
            for t in tensors.values():
                t.copy_(self.own[offset:offset + t.numel()].view(t.shape).to(t.dtype))
                offset += t.numel()
        return time.perf_counter() - t0


def bench_paths(numel: int, directory: str, repeats: int = 3) -> dict:
    """A rank function (:func:`labkit.launch.launch`, two ranks or more): ``numel`` float32 values of
    state per rank saved and restored both ways, the fastest of ``repeats``: to disk with
    :class:`labkit.fault_tolerance.Checkpointer` (fsynced, checksummed; restore verifies them) and to
    the peer's memory with :class:`PeerSnapshot` (restore: rank 1 as a replaced rank, its snapshot
    brought back by rank 2, or rank 0 of two). Checks that both restores return the state saved."""
    from labkit.fault_tolerance.checkpointer import Checkpointer

    rank = dist.get_rank()
    state = {"w": torch.randn(numel, generator=torch.Generator().manual_seed(rank))}
    times: dict[str, list[float]] = {"disk_save_s": [], "disk_restore_s": [], "peer_save_s": [], "peer_restore_s": []}
    same = True
    with Checkpointer(directory, keep_last=1) as ck:
        for i in range(repeats):
            dist.barrier()
            times["disk_save_s"].append(ck.save(i + 1, {"local": state}).total_s)
            dist.barrier()
            t0 = time.perf_counter()
            _, back = ck.load_latest()
            times["disk_restore_s"].append(time.perf_counter() - t0)
            same &= torch.equal(back["local"]["w"], state["w"])
            snap = PeerSnapshot()
            dist.barrier()
            times["peer_save_s"].append(snap.take(i + 1, state))
            target = {"w": torch.zeros(numel)}
            if rank == 1:
                snap.own = None  # a new process: nothing of its own in memory
            dist.barrier()
            times["peer_restore_s"].append(snap.restore(target, [1]))
            same &= torch.equal(target["w"], state["w"])
    return {"bytes": 4 * numel, "restored_identical": bool(same), **{k: min(v) for k, v in times.items()}}
