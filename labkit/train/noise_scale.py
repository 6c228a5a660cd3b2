"""The gradient noise scale of the lab GPT, measured while it trains (McCandlish et al. 2018).

Each optimizer step accumulates ``accum`` micro-batches of ``micro_batch`` sequences, as gradient
accumulation (or ``accum`` data-parallel ranks) would. The micro-batches' own gradients are the
small batch ``b = micro_batch`` of the paper's appendix A.1 and their mean, the step's gradient,
the big batch ``B = accum x micro_batch``: the two squared norms cost nothing beyond the step, and
:mod:`labkit.planning.batch` turns them into ``|G|^2``, ``tr(Sigma)`` and ``B_simple``. The unit of a
batch here is a sequence of ``block_size`` tokens (one row), the unit the loss averages over.

The step itself is the plain AdamW step of the other labs (gradient clipped to norm 1 after the
norms are taken), so the run doubles as the lab's pretraining: :func:`pretrain_measuring_noise`
returns the trained model with its losses and noise-scale estimates.
"""
from __future__ import annotations

import time

import torch
import torch.nn as nn

from labkit.core.checks import positive_int, positive_number
from labkit.core.data import get_batch
from labkit.core.model import GPTConfig, build_model
from labkit.planning.batch import NoiseScale, two_batch_estimates


def accumulate_with_norms(model: nn.Module, micros: list[tuple[torch.Tensor, torch.Tensor]]
                          ) -> tuple[float, float, float]:
    """Gradients of the mean loss over ``micros`` put in ``.grad``; return the mean loss, the mean
    squared norm of the micro-batches' own gradients and the squared norm of their mean (fp32)."""
    params = [p for p in model.parameters() if p.requires_grad]
    total = [torch.zeros_like(p, dtype=torch.float32) for p in params]
    loss_sum, sq_small = 0.0, 0.0
    for x, y in micros:
        loss = model(x, y)[1]
        grads = torch.autograd.grad(loss, params)
        sq_small += float(sum(g.float().pow(2).sum() for g in grads))
        for t, g in zip(total, grads):
            t.add_(g.float(), alpha=1 / len(micros))
        loss_sum += loss.item()
    sq_big = float(sum(t.pow(2).sum() for t in total))
    for p, t in zip(params, total):
        p.grad = t.to(p.dtype)
    return loss_sum / len(micros), sq_small / len(micros), sq_big


def window_estimates(history: list[dict], window: int, b_small: int, b_big: int) -> list[dict]:
    """``B_simple`` over consecutive windows of ``window`` steps: the ratio of the window's mean
    ``tr(Sigma)`` and mean ``|G|^2`` (the paper's ratio of averages), with the window's mean loss."""
    positive_int("window", window)
    rows = []
    for start in range(0, len(history) - window + 1, window):
        part = history[start:start + window]
        g2 = sum(h["g2"] for h in part) / window
        trace = sum(h["trace"] for h in part) / window
        rows.append({"first_step": start, "last_step": start + window - 1, "g2": g2, "trace": trace,
                     "b_simple": trace / g2 if g2 > 0 else float("inf"),
                     "loss": sum(h["loss"] for h in part) / window, "b_small": b_small, "b_big": b_big})
    return rows


def pretrain_measuring_noise(model_cfg: GPTConfig, data: torch.Tensor, steps: int, micro_batch: int = 4,
                             accum: int = 4, lr: float = 3e-3, seed: int = 0, window: int = 25,
                             grad_clip: float = 1.0) -> dict:
    """Train a fresh GPT for ``steps`` AdamW steps of ``accum`` x ``micro_batch`` rows of ``data``,
    measuring the noise scale at every step; return the model, per-step records and window estimates.

    The batches are :func:`labkit.core.data.get_batch`'s for ``(seed, step)``, the ones
    ``python -m labkit.train --batch-size accum*micro_batch`` draws; the model trains on the device
    ``data`` is on."""
    positive_int("steps", steps)
    positive_int("micro_batch", micro_batch)
    if positive_int("accum", accum) < 2:
        raise ValueError(f"accum={accum}: the noise scale needs at least 2 micro-batches per step")
    positive_number("lr", lr)
    model = build_model(model_cfg, seed=seed).to(data.device).train()  # where the data is
    opt = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.95), weight_decay=0.0)
    noise, history, times = NoiseScale(), [], []
    b_big = micro_batch * accum
    for step in range(steps):
        x, y = get_batch(data, step, b_big, model_cfg.block_size, seed=seed)
        t0 = time.perf_counter()
        loss, sq_small, sq_big = accumulate_with_norms(model, list(zip(x.split(micro_batch),
                                                                       y.split(micro_batch))))
        if grad_clip:
            torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
        times.append(time.perf_counter() - t0)
        noise.update(sq_small, sq_big, micro_batch, b_big)
        g2, trace = two_batch_estimates(sq_small, sq_big, micro_batch, b_big)
        history.append({"step": step, "loss": loss, "sq_small": sq_small, "sq_big": sq_big, "g2": g2,
                        "trace": trace})
    return {"model": model, "history": history, "losses": [h["loss"] for h in history],
            "step_times_s": times, "b_simple": noise.b_simple, "b_small": micro_batch, "b_big": b_big,
            "windows": window_estimates(history, min(window, steps), micro_batch, b_big)}
