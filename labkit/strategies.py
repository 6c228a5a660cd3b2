"""Parallel strategies by name: each wraps the plain GPT from outside and says how to sync gradients.

``wrap(model, name, device)`` returns ``(model, finish_backward)``; the training loop calls
``finish_backward()`` between ``loss.backward()`` and the optimizer step and is otherwise identical
for every strategy.

* ``single``: one process, no wrapper; the reference every parallel run is held against.
* ``ddp``: ``torch.nn.parallel.DistributedDataParallel`` (PyTorch docs, "DistributedDataParallel").
* ``dp_naive`` / ``dp_bucketed``: the hand-written data parallel of :mod:`labkit.data_parallel`.
* ``zero1`` / ``zero2`` / ``zero3``: DeepSpeed's ZeRO (:mod:`labkit.zero`); ``wrap`` leaves the
  model alone, the training loop hands it and its optimizer to ``deepspeed.initialize``.
* ``zero1_scratch``: ZeRO-1 by hand (:mod:`labkit.zero_scratch`); the sharding lives in its
  optimizer, so ``wrap`` leaves the model alone.
* ``fsdp``: FSDP2, ``torch.distributed.fsdp.fully_shard`` on every block, then on the root
  (PyTorch docs, "FSDP2"; Zhao et al. 2023): ZeRO stage 3. Parameters, gradients and optimizer
  states are sharded over the ranks; each block's parameters are all-gathered for its forward and
  again for its backward (unless ``reshard_after_forward=False``), gradients reduce-scattered.
"""
from __future__ import annotations

from typing import Callable

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel

from labkit.data_parallel import BucketedDataParallel, NaiveDataParallel

STRATEGIES = ("single", "ddp", "dp_naive", "dp_bucketed", "fsdp", "zero1", "zero2", "zero3", "zero1_scratch",
              "tp", "pp")  # tp/pp split the model itself: labkit.tensor_parallel, labkit.pipeline_parallel
# The ZeRO stage each strategy's memory follows (labkit.memory.model_state_breakdown).
ZERO_STAGE = {"single": 0, "ddp": 0, "dp_naive": 0, "dp_bucketed": 0, "fsdp": 3,
              "zero1": 1, "zero2": 2, "zero3": 3, "zero1_scratch": 1, "tp": 0, "pp": 0}
DEEPSPEED = ("zero1", "zero2", "zero3")  # wrapped by labkit.zero after the optimizer exists


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


def _fully_shard(model: nn.Module, device: torch.device, reshard_after_forward: bool,
                 cpu_offload: bool, bf16_params: bool) -> nn.Module:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard

    mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    kwargs = {"mesh": mesh, "reshard_after_forward": reshard_after_forward}
    if cpu_offload:
        # Pinned host memory makes the device copies asynchronous; it needs an accelerator to exist.
        kwargs["offload_policy"] = CPUOffloadPolicy(pin_memory=device.type == "cuda")
    if bf16_params:  # compute in bf16 on gathered copies, keep fp32 shards, reduce in fp32
        kwargs["mp_policy"] = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for block in model.blocks:  # one all-gather per block: only one block is ever unsharded
        fully_shard(block, **kwargs)
    return fully_shard(model, **kwargs)  # the root: embeddings, final norm, tied head


def _prime_buckets(ddp: DistributedDataParallel, device: torch.device) -> None:
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


def wrap(
    model: nn.Module, name: str, device: torch.device, bucket_cap_mb: float = 25.0,
    reshard_after_forward: bool = True, cpu_offload: bool = False, bf16_params: bool = False,
) -> tuple[nn.Module, Callable[[], None]]:
    world = dist.get_world_size() if dist.is_initialized() else 1
    check_strategy(name, world)
    if name == "fsdp" and dist.is_initialized():
        return _fully_shard(model, device, reshard_after_forward, cpu_offload, bf16_params), lambda: None
    if name in ("single", "zero1_scratch", *DEEPSPEED) or not dist.is_initialized():
        return model, lambda: None
    if name == "ddp":
        ids = [device.index] if device.type == "cuda" else None
        ddp = DistributedDataParallel(model, device_ids=ids, bucket_cap_mb=bucket_cap_mb)
        _prime_buckets(ddp, device)
        return ddp, lambda: None
    cls = NaiveDataParallel if name == "dp_naive" else BucketedDataParallel
    wrapped = cls(model) if cls is NaiveDataParallel else cls(model, bucket_cap_mb=bucket_cap_mb)
    return wrapped, wrapped.finish_gradient_sync
