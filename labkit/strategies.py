"""Parallel strategies by name: each wraps the plain GPT from outside and says how to sync gradients.

``wrap(model, name, device)`` returns ``(model, finish_backward)``; the training loop calls
``finish_backward()`` between ``loss.backward()`` and the optimizer step and is otherwise identical
for every strategy.

* ``single``: one process, no wrapper; the reference every parallel run is held against.
* ``ddp``: ``torch.nn.parallel.DistributedDataParallel`` (PyTorch docs, "DistributedDataParallel").
* ``dp_naive`` / ``dp_bucketed``: the hand-written data parallel of :mod:`labkit.data_parallel`.
"""
from __future__ import annotations

from typing import Callable

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel

from labkit.data_parallel import BucketedDataParallel, NaiveDataParallel

STRATEGIES = ("single", "ddp", "dp_naive", "dp_bucketed")


def check_strategy(name: str, world_size: int) -> None:
    if name not in STRATEGIES:
        raise ValueError(f"strategy={name!r} is unknown; valid strategies: {list(STRATEGIES)}")
    if name == "single" and world_size != 1:
        raise ValueError(
            f"strategy='single' runs on one process but world_size={world_size}; "
            f"use one of {[s for s in STRATEGIES if s != 'single']} for several ranks"
        )
    if name != "single" and world_size > 1 and not dist.is_initialized():
        raise RuntimeError(f"strategy={name!r} needs a process group: start it with labkit.launch or torchrun")


def wrap(
    model: nn.Module, name: str, device: torch.device, bucket_cap_mb: float = 25.0
) -> tuple[nn.Module, Callable[[], None]]:
    world = dist.get_world_size() if dist.is_initialized() else 1
    check_strategy(name, world)
    if name == "single" or not dist.is_initialized():
        return model, lambda: None
    if name == "ddp":
        ids = [device.index] if device.type == "cuda" else None
        return DistributedDataParallel(model, device_ids=ids, bucket_cap_mb=bucket_cap_mb), lambda: None
    cls = NaiveDataParallel if name == "dp_naive" else BucketedDataParallel
    wrapped = cls(model) if cls is NaiveDataParallel else cls(model, bucket_cap_mb=bucket_cap_mb)
    return wrapped, wrapped.finish_gradient_sync
