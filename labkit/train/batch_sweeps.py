"""Choosing the batch, measured: accumulation in the one training loop (:func:`labkit.train.train`),
the learning rate against the batch in fine-tuning (:mod:`labkit.memory.finetune_probe`).

* :func:`accumulation_sweep`: one global batch reached with 1, 2, 4... micro-batches per optimizer
  step (``--grad-accum``). Per step: the losses (equal to the unaccumulated run's to fp32 rounding,
  since the step's gradient is the mean over the same rows), the time, and the memory: the model
  states the loop counts plus the activations of one micro-batch, the largest thing accumulation
  shrinks (measured with :func:`labkit.memory.probe.saved_activation_bytes`; backward frees each
  micro-batch's activations before the next forward).
* :func:`lr_sweep`: the same number of fine-tuning steps at several batch sizes and learning rates,
  and :func:`best_lr`, the best rate per batch: how the best learning rate moves with the batch.
"""
from __future__ import annotations

import statistics
from dataclasses import replace

import torch
import torch.nn as nn

from labkit.core.checks import positive_int
from labkit.core.data import get_batch, load_corpus, train_val_split
from labkit.core.model import GPTConfig, build_model
from labkit.memory.finetune_probe import eval_loss, finetune, prepare
from labkit.memory.probe import saved_activation_bytes
from labkit.planning.batch import lr_optimum
from labkit.train.config import TrainConfig
from labkit.train.loop import train

QUIET = dict(progress=False, count_comm="none")


def accumulation_sweep(model_cfg: GPTConfig, global_batch: int, accums: list[int], steps: int,
                       lr: float = 1e-3, seed: int = 0, device: str = "cpu") -> list[dict]:
    """The same ``steps`` optimizer steps of ``global_batch`` rows with each number of micro-batches
    in ``accums``; one row per run with its losses, median step time (the first step left out) and
    bytes (model states, one micro-batch's activations, their sum), and the largest loss difference
    from the run with the fewest micro-batches."""
    positive_int("global_batch", global_batch)
    data = train_val_split(load_corpus()).train.to(device)
    base = TrainConfig(steps=steps, batch_size=global_batch, lr=lr, seed=seed, device=device, **QUIET)
    rows = []
    for k in sorted(accums):
        if global_batch % positive_int("accum", k):
            raise ValueError(f"accum={k} must divide global_batch={global_batch}")
        r = train(replace(base, grad_accum=k), model_cfg)
        micro = global_batch // k
        idx, tgt = get_batch(data, 0, micro, model_cfg.block_size, seed=seed)
        acts = saved_activation_bytes(build_model(model_cfg, seed=seed).to(device), idx, tgt)["total"]
        states = r["ranks"][0]["model_state_bytes"]["total"]
        rows.append({"accum": k, "micro_batch": micro, "loss": r["loss"],
                     "step_time_s": statistics.median(r["step_time_s"][1:] or r["step_time_s"]),
                     "state_bytes": states, "activation_bytes": acts, "total_bytes": states + acts})
    ref = rows[0]["loss"]
    for row in rows:
        row["max_loss_diff"] = max(abs(a - b) for a, b in zip(row["loss"], ref))
    return rows


def lr_sweep(base: nn.Module, train_data: torch.Tensor, val_data: torch.Tensor, batches: list[int],
             lrs: list[float], steps: int, seed: int = 0, eval_batches: int = 4) -> list[dict]:
    """Full fine-tuning of a copy of ``base`` for ``steps`` steps at each batch size and learning
    rate, on the same batches (:func:`labkit.memory.finetune_probe.finetune`); each row has the
    training losses and the validation loss after (fixed held-out batches: less noisy than the
    last training losses, which at a batch of 2 rows swing widely)."""
    rows = []
    for b in batches:
        for lr in lrs:
            model = prepare(base, "full")
            out = finetune(model, train_data, steps, batch_size=positive_int("batch", b), lr=lr, seed=seed)
            rows.append({"batch": b, "lr": lr, "losses": out["losses"],
                         "val_loss": eval_loss(model, val_data, batches=eval_batches)})
    return rows


def best_lr(rows: list[dict]) -> dict[int, float]:
    """The best learning rate per batch size of :func:`lr_sweep`'s rows
    (:func:`labkit.planning.batch.lr_optimum`: between the grid's points)."""
    out = {}
    for b in sorted({r["batch"] for r in rows}):
        pts = sorted((r["lr"], r["val_loss"]) for r in rows if r["batch"] == b)
        out[b] = lr_optimum([p[0] for p in pts], [p[1] for p in pts])
    return out
