"""Measure where the memory goes, on CPU as on GPU, to hold :mod:`labkit.memory` against.

* Model states: the bytes of the live parameter, gradient and optimizer-state tensors a rank holds,
  each storage counted once (tied weights share one; a DTensor shard counts its local part).
* Activations: a ``TorchDispatchMode`` keeps a weak reference to the storage of every tensor the
  forward pass creates; after forward, with only the loss kept, the storages still alive (and not
  parameters or inputs) are what autograd saved for backward, including what checkpointing
  caches, which ``saved_tensors_hooks`` alone would miss.
* At scale, on fake tensors: FSDP2 on a fake process group under ``FakeTensorMode``, with
  PyTorch's ``FSDPMemTracker``, measures a 7B model's per-rank memory without allocating it.
"""
from __future__ import annotations

from contextlib import nullcontext

import torch
import torch.nn as nn
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from labkit.memory.calculator import ModelStates


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def unique_storage_bytes(tensors) -> int:
    seen: dict[int, int] = {}
    for t in tensors:
        if isinstance(t, torch.Tensor):
            st = _local(t).untyped_storage()
            seen.setdefault(st.data_ptr() or id(st), st.nbytes())
    return sum(seen.values())


def measured_model_states(model: nn.Module, optimizer: torch.optim.Optimizer | None = None) -> ModelStates:
    """Bytes of parameters, gradients and optimizer state this rank holds right now."""
    params = list(model.parameters())
    opt_tensors = []
    if optimizer is not None:
        for state in optimizer.state.values():
            opt_tensors += [v for v in state.values() if isinstance(v, torch.Tensor)]
        # Tensors the optimizer steps that are not the model's own (DeepSpeed's fp32 master
        # partitions, say) are optimizer state too: the ZeRO paper counts them in K.
        own = {_local(p).untyped_storage().data_ptr() for p in params}
        opt_tensors += [p for g in optimizer.param_groups for p in g["params"]
                        if _local(p).untyped_storage().data_ptr() not in own]
    return ModelStates(params=unique_storage_bytes(params),
                       grads=unique_storage_bytes(p.grad for p in params if p.grad is not None),
                       optimizer=unique_storage_bytes(opt_tensors))


class SavedTensorTracker(TorchDispatchMode):
    """Weakly track the storage of every tensor produced while active."""

    def __init__(self) -> None:
        super().__init__()
        self.refs: dict[int, tuple[StorageWeakRef, int, str]] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor) and not t.is_meta:
                st = t.untyped_storage()
                key = st._cdata
                # A freed storage's address can be reused: only a live entry blocks a new one.
                if key not in self.refs or self.refs[key][0].expired():
                    self.refs[key] = (StorageWeakRef(st), st.nbytes(), func.overloadpacket.__name__)
        return out

    def alive(self, exclude: set[int] = frozenset()) -> dict[str, int]:
        """Bytes still alive, by the op that created them, minus storages in ``exclude``."""
        by_op: dict[str, int] = {}
        for key, (ref, nbytes, op) in self.refs.items():
            if key not in exclude and not ref.expired():
                by_op[op] = by_op.get(op, 0) + nbytes
        return by_op


def saved_activation_bytes(model: nn.Module, idx: torch.Tensor, targets: torch.Tensor,
                           autocast_dtype: torch.dtype | None = None) -> dict[str, int]:
    """Bytes autograd holds for backward after one forward pass, by creating op ("total" too)."""
    exclude = {_local(t).untyped_storage()._cdata for t in
               [*model.parameters(), *model.buffers(), idx, targets]}
    amp = (torch.autocast(idx.device.type, dtype=autocast_dtype) if autocast_dtype else nullcontext())
    tracker = SavedTensorTracker()
    with tracker, amp:
        loss = model(idx, targets)[1]  # the logits are dropped, as a training loop should
    by_op = tracker.alive(exclude)
    del loss  # frees the graph and everything it saved
    return {**by_op, "total": sum(by_op.values())}


def activation_bytes_per_layer_measured(cfg, micro_batch: int, autocast_dtype: torch.dtype | None = None,
                                        seed: int = 0, checkpointing: str = "none",
                                        device: str = "cpu") -> int:
    """Saved bytes per transformer layer: the difference between a 2L- and an L-layer model, over L.

    ``checkpointing`` is an activation-checkpointing policy of
    :mod:`labkit.parallel.activation_checkpointing` applied to both models.
    """
    from dataclasses import replace

    from labkit.core.model import build_model
    from labkit.parallel.activation_checkpointing import apply

    g = torch.Generator().manual_seed(seed)
    idx, tgt = torch.randint(0, cfg.vocab_size, (2, micro_batch, cfg.block_size), generator=g).to(device)
    small = saved_activation_bytes(apply(build_model(cfg, seed).to(device), checkpointing), idx, tgt, autocast_dtype)
    big_cfg = replace(cfg, n_layer=2 * cfg.n_layer)
    big = saved_activation_bytes(apply(build_model(big_cfg, seed).to(device), checkpointing), idx, tgt,
                                 autocast_dtype)
    return (big["total"] - small["total"]) // cfg.n_layer


def cp_activation_bytes(cfg, micro_batch: int, seed: int = 0) -> int:
    """Bytes this rank saves for backward in one forward of the GPT under context parallelism over
    the default group (every rank), its slice of each sequence with ring attention; a collective.
    One process (a group of one) measures the whole sequence."""
    import torch.distributed as dist

    from labkit.core.model import build_model
    from labkit.parallel.context.ring import ring_attention
    from labkit.parallel.context.layout import zigzag_shard

    C, r = (dist.get_world_size(), dist.get_rank()) if dist.is_initialized() else (1, 0)
    model = build_model(cfg, seed)
    if C > 1:
        for block in model.blocks:
            block.attn.attend = ring_attention
    g = torch.Generator().manual_seed(seed)
    idx, tgt = (zigzag_shard(t, C, r, dim=1) if C > 1 else t
                for t in torch.randint(0, cfg.vocab_size, (2, micro_batch, cfg.block_size), generator=g))
    return saved_activation_bytes(model, idx, tgt)["total"]


def fake_fsdp_memory(cfg, world_size: int = 8, micro_batch: int = 1) -> dict[str, int]:
    """Per-rank bytes of FSDP2 (fp32 Adam) for ``cfg`` on ``world_size`` ranks, on fake tensors.

    Nothing is allocated: the model, its shards and the step run under ``FakeTensorMode`` on a fake
    process group, and ``FSDPMemTracker`` tallies what each tensor would occupy. Returns the
    sharded parameters, gradients and optimizer states after a step, the activations held
    after forward, and at the step's peak the total and the transient part (parameters gathered
    for the layer at work, communication buffers, temporaries).
    """
    import torch.distributed as dist
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from labkit.core.model import GPT
    from labkit.parallel.fsdp import apply_fsdp
    from labkit.parallel.layout.mesh import Degrees, ParallelDims

    if dist.is_initialized():
        raise RuntimeError("fake_fsdp_memory needs a process without a process group")
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world_size)
    try:
        mesh = ParallelDims(Degrees(dp_shard=world_size)).dp_mesh()  # outside the fake mode, or it fails
        with FakeTensorMode():
            model = GPT(cfg)
            apply_fsdp([model], mesh)
            opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
            x = torch.randint(0, cfg.vocab_size, (micro_batch, cfg.block_size))
            tracker = FSDPMemTracker(model, opt)
            tracker.track_inputs((x,))
            with tracker:
                loss = model(x, x)[1]
                after_fw = tracker.get_tracker_snapshot("current")
                loss.backward()
                opt.step()
                after_step = tracker.get_tracker_snapshot("current")
    finally:
        dist.destroy_process_group()

    def pick(snap, name):
        return sum(v for dev in snap.values() for k, v in dev.items() if str(k).endswith(name))

    peak = tracker.get_tracker_snapshot("peak")
    transient = ("UNSHARDED_PARAM", "UNSHARDED_GRAD", "ALL_GATHER", "REDUCE_SCATTER", ".TEMP")
    return {"params": pick(after_step, "SHARDED_PARAM"), "grads": pick(after_step, "SHARDED_GRAD"),
            "optimizer": pick(after_step, ".OPT"), "activations": pick(after_fw, ".ACT"),
            "peak_total": pick(peak, "Total"), "peak_transient": sum(pick(peak, k) for k in transient),
            "n_params": GPT.count_params(cfg)}


def model_states_after_one_step(cfg, precision: str = "fp32", device: str = "cpu",
                                micro_batch: int = 2, seed: int = 0) -> ModelStates:
    """Measured model states of the GPT after one AdamW step (when Adam's states exist).

    ``precision="bf16"`` is pure bf16 training (weights, gradients and Adam states in bf16, the
    calculator's "bf16"); autocast leaves the weights in fp32, so it measures like "fp32".
    """
    from labkit.core.model import build_model

    if precision not in ("fp32", "bf16"):
        raise ValueError(f"precision={precision!r} cannot be measured here; valid: ['fp32', 'bf16']")
    model = build_model(cfg, seed).to(device)
    if precision == "bf16":
        model = model.to(torch.bfloat16)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    idx = torch.randint(0, cfg.vocab_size, (micro_batch, cfg.block_size), device=device)
    model(idx, idx)[1].backward()
    opt.step()
    return measured_model_states(model, opt)


def cuda_peak_step_bytes(cfg, micro_batch: int, precision: str = "fp32") -> int:
    """``torch.cuda.max_memory_allocated`` over one fp32/bf16-autocast training step (CUDA only)."""
    from labkit.core.model import build_model

    if not torch.cuda.is_available():
        raise RuntimeError("cuda_peak_step_bytes needs a CUDA device")
    model = build_model(cfg).cuda()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    idx = torch.randint(0, cfg.vocab_size, (micro_batch, cfg.block_size), device="cuda")
    amp = torch.autocast("cuda", dtype=torch.bfloat16) if precision == "bf16" else nullcontext()
    for _ in range(2):  # the second step has Adam's states allocated, as every later one will
        torch.cuda.reset_peak_memory_stats()
        with amp:
            loss = model(idx, idx)[1]
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return torch.cuda.max_memory_allocated()
