"""Take loading and the host-to-device copy off the training loop's critical path.

:class:`BackgroundPrefetcher` pulls batches ``depth`` ahead on a thread; on CUDA it also copies
each batch from pinned memory on a side stream so the copy of batch k+1 overlaps the compute of
batch k (the ``data_prefetcher`` of NVIDIA Apex's ImageNet example,
https://github.com/NVIDIA/apex/blob/master/examples/imagenet/main_amp.py, and PyTorch's "pinned
memory" notes, https://pytorch.org/tutorials/intermediate/pinmem_nonblock.html). :mod:`labkit.feeding.stalls`
measures what it buys.
"""
from __future__ import annotations

import queue
import threading
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

from labkit.core.checks import positive_int


def to_device(batch: Any, device: torch.device, non_blocking: bool = False) -> Any:
    """The batch with every tensor moved to ``device`` (tuples, lists and dicts walked)."""
    if isinstance(batch, torch.Tensor):
        return batch.to(device, non_blocking=non_blocking)
    if isinstance(batch, (list, tuple)):
        return type(batch)(to_device(b, device, non_blocking) for b in batch)
    if isinstance(batch, dict):
        return {k: to_device(v, device, non_blocking) for k, v in batch.items()}
    return batch


def batch_tensors(batch: Any) -> list[torch.Tensor]:
    """Every tensor in the batch (tuples, lists and dicts walked), in order."""
    if isinstance(batch, torch.Tensor):
        return [batch]
    if isinstance(batch, (list, tuple)):
        return [t for b in batch for t in batch_tensors(b)]
    if isinstance(batch, dict):
        return [t for v in batch.values() for t in batch_tensors(v)]
    return []



@dataclass
class _OnDevice:
    batch: Any
    ready: Any  # torch.cuda.Event recorded after the copy on the side stream


class BackgroundPrefetcher:
    """Pull batches from ``loader`` on a background thread, ``depth`` ahead of the training loop.

    Moves loading off the critical path without worker processes: it overlaps waits that release
    the GIL (file and network reads, sleeps, most of torch's C++ ops) with compute, but not pure
    Python work, which the GIL serializes. With ``device`` on CUDA it also copies each batch from
    pinned memory on a side stream, so the copy of batch k+1 overlaps the compute of batch k (the
    ``data_prefetcher`` of NVIDIA Apex's ImageNet example).
    """

    _END = object()

    def __init__(self, loader: Iterable, depth: int = 2, device: str | None = None) -> None:
        positive_int("depth", depth)
        self.loader, self.depth = loader, depth
        self.device = torch.device(device) if device is not None else None
        if self.device is not None and self.device.type == "cuda" and not torch.cuda.is_available():
            raise ValueError("device='cuda' but CUDA is not available; use device=None or 'cpu'")

    def _fill(self, q: queue.Queue, stop: threading.Event) -> None:
        stream = torch.cuda.Stream(self.device) if self.device is not None and self.device.type == "cuda" else None
        try:
            for batch in self.loader:
                if stream is not None:
                    with torch.cuda.stream(stream):
                        batch = to_device(batch, self.device, non_blocking=True)
                        done = torch.cuda.Event()
                        done.record(stream)
                    batch = _OnDevice(batch, done)
                while not stop.is_set():
                    try:
                        q.put(batch, timeout=0.1)
                        break
                    except queue.Full:
                        continue
                if stop.is_set():
                    return
            q.put(self._END)
        except BaseException as e:  # noqa: BLE001 - re-raised on the consumer's thread
            q.put(e)

    def __iter__(self) -> Iterator:
        q: queue.Queue = queue.Queue(maxsize=self.depth)
        stop = threading.Event()
        t = threading.Thread(target=self._fill, args=(q, stop), daemon=True)
        t.start()
        try:
            while True:
                item = q.get()
                if item is self._END:
                    return
                if isinstance(item, BaseException):
                    raise item
                if isinstance(item, _OnDevice):
                    main = torch.cuda.current_stream(self.device)
                    main.wait_event(item.ready)
                    for t in batch_tensors(item.batch):
                        # Memory allocated on the side stream is now used on the main one: tell
                        # the caching allocator, or it may reuse the block too early.
                        t.record_stream(main)
                    item = item.batch
                yield item
        finally:
            stop.set()
            t.join(timeout=5)
