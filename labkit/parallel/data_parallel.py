"""Data parallelism: torch DDP, and the same written by hand for teaching (``tests/`` hold the
hand-written variants equal to DDP).

Every rank keeps a full replica, runs forward and backward on its shard of the global batch, then
the gradients are averaged with an all-reduce so every replica takes the same optimizer step
(Li et al. 2020, "PyTorch Distributed: Experiences on Accelerating Data Parallel Training", VLDB).

* :class:`NaiveDataParallel` all-reduces every gradient, one call per parameter, after backward:
  correct, but communication starts only when computation has ended, and many small messages each
  pay the collective's latency.
* :class:`BucketedDataParallel` does what DDP does: gradients are grouped, in the reverse order
  backward produces them, into buckets of about ``bucket_cap_mb``; a bucket is all-reduced
  asynchronously the moment its last gradient is ready, so communication overlaps the rest of
  backward (Li et al. 2020, section 3.2.3).
"""
from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel

from labkit.core.checks import positive_number


def _broadcast_from_rank0(module: nn.Module) -> None:
    # Replicas must start identical; DDP does the same broadcast in its constructor.
    for t in list(module.parameters()) + list(module.buffers()):
        dist.broadcast(t.data, src=0)


class SyncOnRequest(nn.Module):
    """A wrapper whose gradients are synchronised only when the loop calls ``finish_gradient_sync``
    (after the last micro-batch), so accumulation has nothing to skip."""

    def __init__(self, module: nn.Module) -> None:
        super().__init__()
        self.module = module

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    @contextmanager
    def no_sync(self) -> Iterator[None]:
        yield

    def finish_gradient_sync(self) -> None:
        raise NotImplementedError


class NaiveDataParallel(SyncOnRequest):
    """All-reduce each gradient after backward; call :meth:`finish_gradient_sync` before the step."""

    def __init__(self, module: nn.Module) -> None:
        super().__init__(module)
        _broadcast_from_rank0(module)

    def finish_gradient_sync(self) -> None:
        world = dist.get_world_size()
        for p in self.module.parameters():
            if p.requires_grad and p.grad is not None:
                dist.all_reduce(p.grad)
                p.grad.div_(world)


class BucketedDataParallel(nn.Module):
    """Bucketed all-reduce overlapped with backward, as torch DDP's reducer does it."""

    def __init__(self, module: nn.Module, bucket_cap_mb: float = 25.0) -> None:
        super().__init__()
        positive_number("bucket_cap_mb", bucket_cap_mb)
        self.module = module
        _broadcast_from_rank0(module)
        # Reverse registration order approximates the order backward produces gradients in.
        params = [p for p in module.parameters() if p.requires_grad][::-1]
        cap = int(bucket_cap_mb * 2**20)
        self.buckets: list[list[nn.Parameter]] = []
        size = cap  # forces a new bucket for the first parameter
        for p in params:
            nbytes = p.numel() * p.element_size()
            if size + nbytes > cap and (not self.buckets or self.buckets[-1]):
                self.buckets.append([])
                size = 0
            self.buckets[-1].append(p)
            size += nbytes
        self._bucket_of = {p: i for i, b in enumerate(self.buckets) for p in b}
        self._pending = [len(b) for b in self.buckets]
        self._works: dict[int, tuple[dist.Work, torch.Tensor]] = {}
        self._sync = True
        for p in params:
            p.register_post_accumulate_grad_hook(self._grad_ready)

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    @contextmanager
    def no_sync(self) -> Iterator[None]:
        """Accumulate gradients locally (DDP's ``no_sync``): the buckets go out during the backward
        after this block, once the gradients hold every micro-batch."""
        self._sync = False
        try:
            yield
        finally:
            self._sync = True

    def _launch(self, i: int) -> None:
        bucket = self.buckets[i]
        flat = torch.cat([
            (p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1) for p in bucket
        ])
        self._works[i] = (dist.all_reduce(flat, async_op=True), flat)

    def _grad_ready(self, p: torch.Tensor) -> None:
        if not self._sync:
            return
        i = self._bucket_of[p]
        self._pending[i] -= 1
        if self._pending[i] == 0:
            self._launch(i)

    def finish_gradient_sync(self) -> None:
        """Wait for every bucket's all-reduce and write the averaged gradients back."""
        for i in range(len(self.buckets)):
            if i not in self._works:  # a parameter got no gradient this step: reduce zeros for it
                self._launch(i)
        world = dist.get_world_size()
        for i, (work, flat) in self._works.items():
            work.wait()
            flat.div_(world)
            offset = 0
            for p in self.buckets[i]:
                n = p.numel()
                view = flat[offset : offset + n].view_as(p)
                if p.grad is None:
                    p.grad = view.clone()
                else:
                    p.grad.copy_(view)
                offset += n
        self._works.clear()
        self._pending = [len(b) for b in self.buckets]


def wrap_ddp(model: nn.Module, device: torch.device, bucket_cap_mb: float = 25.0,
             group: dist.ProcessGroup | None = None) -> DistributedDataParallel:
    """``torch.nn.parallel.DistributedDataParallel`` (PyTorch docs, "DistributedDataParallel") over
    ``group`` (default: every rank) with its gradient buckets settled before the first step
    (:func:`prime_buckets`)."""
    ids = [device.index] if device.type == "cuda" else None
    ddp = DistributedDataParallel(model, device_ids=ids, bucket_cap_mb=bucket_cap_mb, process_group=group)
    prime_buckets(ddp, device)
    return ddp


def prime_buckets(ddp: DistributedDataParallel, device: torch.device) -> None:
    """Let DDP settle its gradient buckets before the first real step.

    DDP starts with buckets in parameter order and, after the first backward, rebuilds them in the
    order gradients became ready. Which elements share a bucket decides where each one falls in the
    ring all-reduce's chunks, and so the order in which more than two ranks' values are summed. A
    run resumed from a checkpoint would take its first step with the initial buckets where the
    uninterrupted run used rebuilt ones: on 4 ranks that step differs in the last bits. One
    backward of zeros on a one-token batch (parameters untouched, RNG restored) rebuilds the
    buckets up front, so every run, fresh or resumed, sums in the same order at every step.
    """
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        out = ddp(torch.zeros(1, 1, dtype=torch.long, device=device))
        logits = out[0] if isinstance(out, tuple) else out
        (logits.sum() * 0).backward()
    ddp.zero_grad(set_to_none=True)
