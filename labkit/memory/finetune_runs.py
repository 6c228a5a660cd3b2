"""The fine-tuning lab's runs side by side, and the calculator held against them.

:func:`run_methods` fine-tunes copies of one pretrained GPT by each method
(:func:`labkit.memory.finetune_probe.prepare`: full, LoRA at several ranks, QLoRA) on the same
batches, keeps the trained models (for samples), and checks that training left every frozen tensor
bit-identical (:func:`frozen_snapshot`), NF4 codes and quantisation constants included.

:func:`calculator_check` measures one step of each method in the dtypes the calculator
(:func:`labkit.memory.finetune.estimate_finetune`) assumes and sets the two side by side, kind by
kind. The lab runs LoRA in fp32 (so that its runs compare within fp32's tolerance); the calculator
knows LoRA over a 16-bit base only, so that check uses a bf16 copy of the base (bf16 adapters, and
AdamW's moments in the parameters' dtype: the calculator's ``bf16`` recipe, 2 + 2 + 4 bytes).
"""
from __future__ import annotations

import copy

import torch
import torch.nn as nn

from labkit.core.data import get_batch
from labkit.memory.calculator import model_shape
from labkit.memory.finetune import estimate_finetune
from labkit.memory.finetune_probe import bytes_by_kind, eval_loss, finetune, prepare
from labkit.memory.lora import trainable_parameters
from labkit.memory.qlora import nf4_bytes, quant_state_tensors

# the lab's kinds (labkit.memory.finetune_probe.KINDS) under the calculator's names
CALC_KIND = {"frozen": "frozen_weights", "trainable": "trained_weights", "gradients": "grads",
             "optimizer": "optimizer", "activations": "activations"}


def frozen_snapshot(model: nn.Module) -> list[torch.Tensor]:
    """Copies of every tensor fine-tuning must not change: frozen parameters, buffers and the NF4
    quantisation constants."""
    frozen = [p for p in model.parameters() if not p.requires_grad] + list(model.buffers())
    return [t.detach().clone() for t in frozen + quant_state_tensors(model)]


def frozen_unchanged(model: nn.Module, snapshot: list[torch.Tensor]) -> bool:
    """Whether every tensor of :func:`frozen_snapshot` is still bit-identical."""
    now = frozen_snapshot(model)
    return len(now) == len(snapshot) and all(torch.equal(a, b) for a, b in zip(now, snapshot))


def run_methods(base: nn.Module, train: torch.Tensor, val: torch.Tensor, runs: list[tuple[str, int]],
                steps: int, batch_size: int = 16, lr: dict | None = None, seed: int = 0,
                eval_batches: int = 8) -> tuple[list[dict], dict]:
    """Fine-tune a copy of ``base`` for each ``(method, rank)`` of ``runs`` (rank 0 for full) on the
    same ``steps`` batches of ``train``; ``lr`` maps a method to its learning rate.

    Returns one row per run (trainable parameters, bytes by kind of the first step, median step time,
    validation loss before and after, the frozen tensors' check) and ``{label: trained model}``."""
    lr = {"full": 1e-3, "lora": 3e-3, "qlora": 3e-3, **(lr or {})}
    rows, models = [], {}
    for method, r in runs:
        with torch.random.fork_rng(devices=[]):  # the adapters' random A: the same draw for each rank
            torch.manual_seed(seed)
            model = prepare(base, method, r=r or 8)
        snap = frozen_snapshot(model)
        before = eval_loss(model, val, batches=eval_batches, batch_size=batch_size)
        out = finetune(model, train, steps, batch_size=batch_size, lr=lr[method], seed=seed)
        times = sorted(out["step_times_s"]) or [float("nan")]
        label = method if method == "full" else f"{method} r={r}"
        rows.append({"run": label, "method": method, "r": r or None,
                     "dtype": "fp32" if method != "qlora" else "NF4 base, bf16",
                     "trainable_params": trainable_parameters(model), **out["bytes"],
                     "step_time_s": times[len(times) // 2], "val_loss_before": before,
                     "val_loss_after": eval_loss(model, val, batches=eval_batches, batch_size=batch_size),
                     "losses": out["losses"], "frozen_unchanged": frozen_unchanged(model, snap)})
        models[label] = model
    return rows, models


def nf4_table_bytes(model: nn.Module) -> int:
    """Bytes of the NF4 and 8-bit lookup tables (fixed per quantised weight), which the calculator's
    per-weight 4.127 bits leave out."""
    return sum(nf4_bytes(m)["tables"] for m in model.modules()
               if getattr(getattr(m, "weight", None), "quant_state", None) is not None)


def calculator_check(base: nn.Module, data: torch.Tensor, rank: int = 16, micro_batch: int = 16,
                     seed: int = 0, methods: tuple[str, ...] = ("full", "lora", "qlora")) -> list[dict]:
    """One measured training step of each method against the calculator, kind by kind.

    full: fp32 (the calculator's ``fp32`` recipe, 4 + 4 + 8 bytes); lora: a bf16 copy of the base
    with bf16 adapters; qlora: NF4 + bf16 as in the lab (both the ``bf16`` recipe, 2 + 2 + 4:
    ``torch.optim.AdamW`` keeps its moments in the parameters' dtype). Each row holds both sets of
    bytes, their relative differences and the NF4 lookup tables' bytes."""
    block = base.config.block_size
    shape = model_shape(base.config)
    idx, tgt = get_batch(data, 0, micro_batch, block, seed=seed)
    rows = []
    for method in methods:
        precision = "fp32" if method == "full" else "bf16"
        src = copy.deepcopy(base).to(torch.bfloat16) if method == "lora" else base
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            model = prepare(src, method, r=rank)
        opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
        measured = bytes_by_kind(model, opt, idx, tgt)
        e = estimate_finetune(shape, method, rank=rank, targets="all", micro_batch=micro_batch,
                              seq_len=block, precision=precision)
        calc = {k: getattr(e, CALC_KIND[k]) for k in CALC_KIND}
        rows.append({"method": method, "precision": precision, "measured": measured, "calculator": calc,
                     "rel_diff": {k: measured[k] / calc[k] - 1 if calc[k] else float(measured[k] != 0)
                                  for k in CALC_KIND},
                     "nf4_tables": nf4_table_bytes(model), "n_trainable_tensors":
                         len([p for p in model.parameters() if p.requires_grad]),
                     "trainable_params": e.trainable_params})
    return rows
