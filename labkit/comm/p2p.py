"""Point-to-point messages that cannot deadlock under NCCL, and a checker that proves it on CPU.

NCCL's rule (NCCL docs, "Point-to-point communication"; PyTorch's ``batch_isend_irecv``): a send
to a peer does not complete until the peer has posted the matching receive, and the operations
between two ranks run in the order they were posted. Two ranks that each post a send and then a
receive to the other wait on each other forever once the messages outgrow NCCL's buffers. gloo
buffers sends and never shows it. :func:`exchange` posts a rank's sends and receives as one group
(``dist.batch_isend_irecv``, one ``ncclGroupStart/End``): they progress together.

:class:`P2PRecorder` records every point-to-point operation a rank posts (through the real
``torch.distributed`` calls, so the run itself goes on, on gloo) and :func:`deadlock` replays the
ranks' records under NCCL's rule: the test suite holds the hand-written ring all-reduce and pipeline
to it, so an order that works on gloo and hangs on GPUs fails on CPU.
"""
from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as _c10d


def exchange(sends: list[tuple[torch.Tensor, int]], recvs: list[tuple[torch.Tensor, int]],
             group: dist.ProcessGroup | None = None) -> None:
    """Send each ``(tensor, peer)`` of ``sends`` and fill each of ``recvs`` from its peer, as one group;
    returns when all are done. Peers are global ranks."""
    ops = [dist.P2POp(_c10d.isend, t, p, group) for t, p in sends if t.numel()]
    ops += [dist.P2POp(_c10d.irecv, t, p, group) for t, p in recvs if t.numel()]
    if ops:
        for work in dist.batch_isend_irecv(ops):
            work.wait()


@dataclass(eq=False)  # an operation is itself: two sends of the same size to the same peer are not one
class Op:
    kind: str  # "send" | "recv"
    peer: int
    numel: int
    group: int | None  # operations posted together (one batch_isend_irecv) share a number
    blocking: bool  # the host waits for it before posting anything else
    done: bool = False


class P2PRecorder:
    """While active, record this rank's point-to-point posts (``ops``), in order, and let them run."""

    NAMES = ("isend", "irecv", "send", "recv", "batch_isend_irecv")

    def __init__(self) -> None:
        self.ops: list[Op] = []
        self._saved: dict[str, Any] = {}
        self._batches = 0

    def _wrap(self, name: str, fn):
        def recorded(*args: Any, **kwargs: Any):
            if name == "batch_isend_irecv":
                self._batches += 1
                for p in args[0]:
                    kind = "send" if p.op is _c10d.isend else "recv"
                    self.ops.append(Op(kind, p.peer, p.tensor.numel(), self._batches, True))
            else:
                tensor, peer = args[0], args[1] if len(args) > 1 else kwargs.get("dst", kwargs.get("src"))
                self.ops.append(Op("send" if "send" in name else "recv", peer, tensor.numel(), None,
                                   name in ("send", "recv")))
            return fn(*args, **kwargs)
        return recorded

    def __enter__(self) -> "P2PRecorder":
        for name in self.NAMES:
            self._saved[name] = getattr(dist, name)
        for name in self.NAMES:
            setattr(dist, name, self._wrap(name, self._saved[name]))
        return self

    def __exit__(self, *exc: object) -> None:
        for name, fn in self._saved.items():
            setattr(dist, name, fn)


def deadlock(posts: dict[int, list[Op]]) -> str | None:
    """Replay every rank's posts under NCCL's rule; None when they all complete, else what is stuck.

    Each ordered pair of ranks is one in-order stream: an operation can run once everything posted
    before it to the same peer has finished, or when it belongs to the same group as the first
    unfinished one. The j-th send from a to b meets the j-th receive at b from a. A blocking post
    (``send``, ``recv``, or a group its poster waits for) stops its rank from posting more until done.
    """
    posts = {r: [Op(o.kind, o.peer, o.numel, o.group, o.blocking) for o in ops] for r, ops in posts.items()}
    streams: dict[tuple[int, int], list[Op]] = defaultdict(list)
    pc = {r: 0 for r in posts}

    def runnable(stream: list[Op], op: Op) -> bool:
        first = next((o for o in stream if not o.done), None)
        i = stream.index(op)
        return all(o.done for o in stream[:i]) or (op.group is not None and op.group == first.group)

    def waiting(r: int) -> bool:  # the rank's last post blocks it and is not done
        if pc[r] == 0:
            return False
        last = posts[r][pc[r] - 1]
        unit = [o for o in posts[r][:pc[r]] if o is last or (last.group is not None and o.group == last.group)]
        return last.blocking and not all(o.done for o in unit)

    progress = True
    while progress:
        progress = False
        for r, ops in posts.items():  # post until blocked; a group is posted whole
            while pc[r] < len(ops) and not waiting(r):
                first = ops[pc[r]]
                while pc[r] < len(ops) and (ops[pc[r]] is first or (first.group is not None
                                                                      and ops[pc[r]].group == first.group)):
                    streams[(r, ops[pc[r]].peer)].append(ops[pc[r]])
                    pc[r] += 1
                progress = True
        for (a, b), out in list(streams.items()):  # match sends a -> b with receives at b from a
            sends = [o for o in out if o.kind == "send"]
            recvs = [o for o in streams.get((b, a), []) if o.kind == "recv"]
            for s, rv in zip(sends, recvs):
                if s.done:
                    continue
                if runnable(out, s) and runnable(streams[(b, a)], rv):
                    if s.numel != rv.numel:
                        return f"rank {a} sends {s.numel} elements to rank {b}, which expects {rv.numel}"
                    s.done = rv.done = True
                    progress = True
                break  # in order: a later send cannot overtake this one
    stuck = {r: next((f"{o.kind} {'to' if o.kind == 'send' else 'from'} rank {o.peer}"
                      for o in ops if not o.done), None) for r, ops in posts.items()}
    stuck = {r: s for r, s in stuck.items() if s is not None}
    unposted = {r for r in posts if pc[r] < len(posts[r])}
    if stuck or unposted:
        return "deadlock under NCCL: " + "; ".join(f"rank {r} waits on its {s}" for r, s in sorted(stuck.items()))
    return None
