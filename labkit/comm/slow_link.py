"""A slower wire, emulated: a DDP communication hook that holds each bucket back for its transfer time.

PyTorch's DDP communication hooks (PyTorch docs, "DDP Communication Hooks") replace the all-reduce of
each gradient bucket. :func:`slow_link_hook` runs the real all-reduce, then keeps the bucket's result
back for the time its ring bytes, 2(n-1)/n of the bucket, would take over a link of ``gbps`` GB/s,
plus a fixed cost per message (the link's alpha in Hockney's alpha + beta * S).
The waiting happens on one background thread, in bucket order, as buckets queue on one real link:
backward goes on meanwhile, so what a slow link costs is only the part that compute cannot hide,
as on a real cluster. It lets a 2-core laptop show what an Ethernet-class link does to a run.
"""
# No `from __future__ import annotations`: DDP checks the hook's annotations as objects.
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable

import torch
import torch.distributed as dist

from labkit.core.checks import non_negative_number, positive_number


def slow_link_hook(gbps: float,
                   latency_ms: float = 0.0) -> Callable[[Any, dist.GradBucket], torch.futures.Future]:
    """A hook for ``DistributedDataParallel.register_comm_hook(None, hook)``: the mean of every
    bucket, delivered no earlier than a link of ``gbps`` GB/s (1e9 bytes) and a fixed
    ``latency_ms`` per message (the alpha of alpha + beta * S) would deliver it."""
    positive_number("gbps", gbps)
    non_negative_number("latency_ms", latency_ms)
    link = ThreadPoolExecutor(1, thread_name_prefix="labkit-slow-link")
    free_at = [0.0]  # when the emulated link has finished the buckets queued so far

    def hook(state: object, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
        buf = bucket.buffer()
        n = dist.get_world_size()
        work = dist.all_reduce(buf, async_op=True)
        wire_s = latency_ms / 1e3 + 2 * (n - 1) / n * buf.numel() * buf.element_size() / (gbps * 1e9)
        fut = torch.futures.Future()

        def deliver() -> None:
            try:
                work.wait()
                free_at[0] = max(free_at[0], time.perf_counter()) + wire_s
                time.sleep(max(0.0, free_at[0] - time.perf_counter()))
                fut.set_result(buf.div_(n))
            except BaseException as e:  # noqa: BLE001 - handed to DDP, which raises it in backward
                fut.set_exception(e)

        link.submit(deliver)
        return fut

    return hook
