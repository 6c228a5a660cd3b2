"""Measure fine-tuning side by side: full, LoRA at several ranks, QLoRA, by memory kind and time.

Full fine-tuning trains and keeps gradients and Adam's two moments for every weight; LoRA (Hu et al.
2021, arXiv:2106.09685) freezes the weights and trains ``r (in + out)`` per adapted linear; QLoRA
(Dettmers et al. 2023, arXiv:2305.14314) also stores the frozen linears in 4-bit NF4 and computes in
bf16. :func:`bytes_by_kind` counts, for one training step of a model prepared by :func:`prepare`:

* ``frozen``: parameters that need no gradient, plus the NF4 quantisation constants (absmax values,
  lookup tables), which live on the weight's quant state, not in ``parameters()``;
* ``trainable``: parameters that need a gradient (every weight in full fine-tuning, else adapters);
* ``gradients`` after backward, ``optimizer`` states after the step (AdamW: two moments and a step);
* ``activations``: what autograd holds for backward after forward (:mod:`labkit.memory.probe`).

Each storage is counted once (the tied embedding and head are one tensor).
"""
from __future__ import annotations

import copy
import time

import torch
import torch.nn as nn

from labkit.core.checks import one_of, positive_int
from labkit.core.data import get_batch
from labkit.memory.probe import saved_activation_bytes, unique_storage_bytes
from labkit.memory.lora import DEFAULT_TARGETS, apply_lora, peft_lora, trainable_parameters
from labkit.memory.qlora import qlora, quant_state_tensors, quantize_nf4

METHODS = ("full", "lora", "qlora")
KINDS = ("frozen", "trainable", "gradients", "optimizer", "activations")


def prepare(base: nn.Module, method: str, r: int = 8, alpha: float = 16.0, impl: str = "scratch",
            targets=DEFAULT_TARGETS, seed: int = 0) -> nn.Module:
    """A copy of ``base`` ready to fine-tune by ``method``, with this course's LoRA or ``peft``'s.

    ``full`` trains everything in the base's dtype; ``lora`` trains adapters over the frozen base
    in its dtype; ``qlora`` stores the targeted linears in NF4 and the rest, adapters included, in bf16.
    The adapters' random initial values come from ``seed``, not from whatever the global RNG holds.
    """
    one_of("method", method, METHODS, "methods")
    one_of("impl", impl, ("scratch", "peft"), "implementations")
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return _prepare(base, method, r, alpha, impl, targets)


def _prepare(base: nn.Module, method: str, r: int, alpha: float, impl: str, targets) -> nn.Module:
    model = copy.deepcopy(base)
    if method == "full":
        return model.requires_grad_(True)
    if impl == "scratch":
        return apply_lora(model, r, alpha, 0.0, targets) if method == "lora" else qlora(model, r, alpha, 0.0, targets)
    if method == "qlora":
        quantize_nf4(model, targets)
        return peft_lora(model, r, alpha, 0.0, targets, adapter_dtype=torch.bfloat16)
    return peft_lora(model, r, alpha, 0.0, targets)


def _trainable(model: nn.Module) -> list[nn.Parameter]:
    return [p for p in model.parameters() if p.requires_grad]


def bytes_by_kind(model: nn.Module, optimizer: torch.optim.Optimizer, idx: torch.Tensor,
                  targets: torch.Tensor) -> dict[str, int]:
    """Bytes by kind (:data:`KINDS`, and ``total``) over one training step on ``(idx, targets)``.

    The step is taken: gradients are counted after backward, optimizer states after the step.
    """
    frozen = [p for p in model.parameters() if not p.requires_grad] + quant_state_tensors(model)
    trainable = _trainable(model)
    activations = saved_activation_bytes(model, idx, targets)["total"]
    optimizer.zero_grad(set_to_none=True)
    model(idx, targets)[1].backward()
    grads = unique_storage_bytes(p.grad for p in trainable if p.grad is not None)
    optimizer.step()
    opt = [v for s in optimizer.state.values() for v in s.values() if isinstance(v, torch.Tensor)]
    out = {"frozen": unique_storage_bytes(frozen), "trainable": unique_storage_bytes(trainable),
           "gradients": grads, "optimizer": unique_storage_bytes(opt), "activations": activations}
    return {**out, "total": sum(out.values())}


def finetune(model: nn.Module, data: torch.Tensor, steps: int, batch_size: int = 16, lr: float = 1e-3,
             block_size: int | None = None, seed: int = 0) -> dict:
    """``steps`` of AdamW on ``data`` (bytes); the bytes by kind of the first step, losses, step times."""
    positive_int("steps", steps)
    block_size = block_size or _gpt(model).config.block_size
    opt = torch.optim.AdamW(_trainable(model), lr=lr, weight_decay=0.0)
    model.train()
    idx, tgt = get_batch(data, 0, batch_size, block_size, seed=seed)
    first = bytes_by_kind(model, opt, idx, tgt)
    losses, times = [], []
    for step in range(1, steps):
        idx, tgt = get_batch(data, step, batch_size, block_size, seed=seed)
        t0 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        loss = model(idx, tgt)[1]
        loss.backward()
        opt.step()
        times.append(time.perf_counter() - t0)
        losses.append(loss.item())
    return {"bytes": first, "losses": losses, "step_times_s": times}


def _gpt(model: nn.Module) -> nn.Module:
    """The GPT inside a ``peft`` wrapper (or the model itself)."""
    return model.get_base_model() if hasattr(model, "get_base_model") else model


@torch.no_grad()
def eval_loss(model: nn.Module, data: torch.Tensor, batches: int = 8, batch_size: int = 16,
              seed: int = 1234) -> float:
    """Mean loss over ``batches`` fixed batches of ``data`` (fp32 mean of the model's losses)."""
    block = _gpt(model).config.block_size
    was = model.training
    model.train()  # train mode: bitsandbytes' CPU eval path repacks 4-bit weights (see qlora)
    losses = [model(*get_batch(data, s, batch_size, block, seed=seed))[1].float().item()
              for s in range(batches)]
    model.train(was)
    return sum(losses) / len(losses)


def compare(base: nn.Module, train: torch.Tensor, val: torch.Tensor, ranks=(4, 16, 64), steps: int = 50,
            impl: str = "scratch", **kw) -> list[dict]:
    """One row per run (full, LoRA at each of ``ranks``, QLoRA at the middle rank): trainable
    parameters, bytes by kind, median step time and validation loss before and after."""
    runs = [("full", 0)] + [("lora", r) for r in ranks] + [("qlora", sorted(ranks)[len(ranks) // 2])]
    rows = []
    for method, r in runs:
        with torch.random.fork_rng(devices=[]):  # the adapters' random A: one draw for every impl
            torch.manual_seed(0)
            model = prepare(base, method, r=r or 8, impl=impl)
        before = eval_loss(model, val)
        out = finetune(model, train, steps, **kw)
        times = sorted(out["step_times_s"]) or [float("nan")]
        rows.append({"method": method, "r": r or None, "trainable_params": trainable_parameters(model),
                     **out["bytes"], "step_time_s": times[len(times) // 2],
                     "val_loss_before": before, "val_loss_after": eval_loss(model, val),
                     "final_train_loss": out["losses"][-1] if out["losses"] else float("nan")})
    return rows
