"""Point-to-point orders that work on gloo and would hang on NCCL fail here, on CPU.

NCCL: a send completes only once the peer has posted the matching receive, and the operations
between two ranks run in posting order. gloo buffers sends, so only a replay of what each rank
posted (``labkit.comm.p2p.deadlock``) shows an order that hangs on GPUs.
"""
import pytest

import rank_fns
from labkit.comm.p2p import Op, deadlock
from labkit.launch import launch


def _posts(out) -> dict:
    return {r: [Op(**o) for o in ops] for r, ops in enumerate(out)}


def test_the_checker_knows_nccls_rule():
    send, recv = (lambda peer, g=None, b=False: Op("send", peer, 8, g, b)), (lambda peer, g=None, b=True: Op("recv", peer, 8, g, b))
    # both isend then recv: each send waits for a receive queued behind the other's send
    assert "deadlock" in deadlock({0: [send(1), recv(1)], 1: [send(0), recv(0)]})
    assert deadlock({0: [send(1), recv(1)], 1: [recv(0), send(0)]}) is None  # one side receives first
    assert deadlock({0: [send(1, 1, True), recv(1, 1)], 1: [send(0, 2, True), recv(0, 2)]}) is None  # grouped
    assert "expects 4" in deadlock({0: [send(1)], 1: [Op("recv", 0, 4, None, True)]})
    # a cycle of blocking receives across three ranks
    assert "deadlock" in deadlock({0: [recv(2), send(1)], 1: [recv(0), send(2)], 2: [recv(1), send(0)]})


def _old_ring(n: int) -> dict:
    """The ring all-reduce's posts before it paired them: isend to the next rank, then recv."""
    return {r: [op for _ in range(2 * (n - 1)) for op in (Op("send", (r + 1) % n, 4, None, False),
                                                          Op("recv", (r - 1) % n, 4, None, True))]
            for r in range(n)}


def _old_pipeline(schedule: str, p: int, m: int) -> dict:
    """The hand-written pipeline's posts before it paired them: recv before, isend after each action."""
    from labkit.parallel.pipeline.stages import schedule_order

    posts = {}
    for s in range(p):
        ops = []
        for kind, _ in schedule_order(schedule, p, s, m):
            if kind == "F":
                ops += [Op("recv", s - 1, 4, None, True)] if s > 0 else []
                ops += [Op("send", s + 1, 4, None, False)] if s < p - 1 else []
            else:
                ops += [Op("recv", s + 1, 4, None, True)] if s < p - 1 else []
                ops += [Op("send", s - 1, 4, None, False)] if s > 0 else []
        posts[s] = ops
    return posts


def test_the_old_orders_fail_the_rule():
    assert "deadlock" in deadlock(_old_ring(2))  # two ranks: both neighbours are the same peer
    assert "deadlock" in deadlock(_old_pipeline("1f1b", 2, 4))  # activation k+1 crosses gradient k


@pytest.mark.parametrize("n", [2, 3])
def test_ring_all_reduce_pairs_its_messages(n):
    posts = _posts(launch(rank_fns.p2p_posts, "ring", numel=1000, world_size=n))
    assert all(ops for ops in posts.values()) and deadlock(posts) is None


@pytest.mark.parametrize("schedule, p, m", [("1f1b", 2, 4), ("gpipe", 2, 3), ("1f1b", 4, 4), ("1f1b", 3, 5)])
def test_hand_written_pipeline_pairs_its_messages(schedule, p, m):
    posts = _posts(launch(rank_fns.p2p_posts, "pipeline", schedule=schedule, m=m, world_size=p))
    assert all(ops for ops in posts.values()) and deadlock(posts) is None
