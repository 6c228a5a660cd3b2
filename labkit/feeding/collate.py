"""Packed rows to model inputs, with no cross-contamination between the sequences of a row.

Krell et al. 2021 ("Efficient Sequence Packing without Cross-contamination", arXiv:2107.02027)
list what packing must change so that a packed row computes exactly what its sequences would alone:

* **position ids** restart at 0 for every sequence, so each sees the positions it would see alone;
* **a block-diagonal causal mask**: a token attends to earlier tokens *of its own sequence* only.
  ``doc_ids`` number the sequences of a row; ``labkit.core.model.GPT`` builds the mask from them
  (what ``flash_attn_varlen_func`` does with ``cu_seqlens``, as a dense boolean mask);
* **loss masking at boundaries**: the last token of a sequence has no next token of its own, so its
  label is -100 (``F.cross_entropy``'s ``ignore_index``), like every padding position.

Hugging Face's ``DataCollatorWithFlattening`` makes the same three choices for padding-free training.
"""
from __future__ import annotations

import time
from typing import Sequence

import numpy as np
import torch

from labkit.core.checks import non_negative_int, positive_int
from labkit.core.model import GPTConfig, build_model
from labkit.feeding.batching import make_batches

IGNORE = -100  # F.cross_entropy's default ignore_index
PAD_DOC = -1  # doc id of padding: attends only to padding, never seen by a real token


def segments(rows: Sequence[Sequence[int]], lengths: Sequence[int], capacity: int) -> list[list[tuple[int, int, int]]]:
    """``(index, start, length)`` of every piece in every row, following ``labkit.feeding.packing.pack``'s
    rule: the k-th appearance of an index is the piece starting at token ``k * capacity``."""
    positive_int("capacity", capacity)
    seen: dict[int, int] = {}
    out = []
    for row in rows:
        pieces = []
        for i in row:
            if not 0 <= i < len(lengths):
                raise ValueError(f"row index {i} is out of range for {len(lengths)} sequences")
            k = seen.get(i, 0)
            seen[i] = k + 1
            start = k * capacity
            if start >= lengths[i]:
                raise ValueError(f"index {i} appears {k + 1} times but its {lengths[i]} tokens make "
                                 f"only {-(-lengths[i] // capacity)} pieces of capacity={capacity}")
            pieces.append((i, start, min(capacity, lengths[i] - start)))
        if sum(p[2] for p in pieces) > capacity:
            raise ValueError(f"a row holds {sum(p[2] for p in pieces)} tokens, more than capacity={capacity}")
        out.append(pieces)
    return out


def collate(rows: Sequence[Sequence[int]], docs: Sequence[torch.Tensor], capacity: int,
            width: int | None = None, pad_id: int = 0) -> dict[str, torch.Tensor]:
    """Model inputs for ``rows`` of indices into ``docs`` (1-D token tensors), ``(len(rows), width)``.

    Returns ``input_ids``, ``labels`` (next token of the same sequence, -100 at each sequence's last
    token and at padding), ``position_ids`` (restarting per sequence), ``doc_ids`` (0, 1, ... per row,
    -1 for padding) and ``n_tokens`` (real tokens). ``width`` defaults to ``capacity``; pass the
    longest row's fill to pad a batch only as far as it needs.
    """
    lengths = [int(d.numel()) for d in docs]
    pieces = segments(rows, lengths, capacity)
    fills = [sum(p[2] for p in row) for row in pieces]
    width = capacity if width is None else width
    if not isinstance(width, int) or width < max(fills, default=0) or width <= 0:
        raise ValueError(f"width must be a positive integer >= the fullest row ({max(fills, default=0)}), got {width!r}")
    R = len(pieces)
    input_ids = torch.full((R, width), pad_id, dtype=torch.long)
    labels = torch.full((R, width), IGNORE, dtype=torch.long)
    position_ids = torch.zeros((R, width), dtype=torch.long)
    doc_ids = torch.full((R, width), PAD_DOC, dtype=torch.long)
    for r, row in enumerate(pieces):
        t = 0
        for d, (i, start, n) in enumerate(row):
            tok = docs[i][start:start + n].long()
            input_ids[r, t:t + n] = tok
            labels[r, t:t + n - 1] = tok[1:]  # labels[r, t + n - 1] stays -100: the boundary
            position_ids[r, t:t + n] = torch.arange(n)
            doc_ids[r, t:t + n] = d
            t += n
        position_ids[r, t:] = torch.arange(width - t)  # padding: any valid position, never a target
    return dict(input_ids=input_ids, labels=labels, position_ids=position_ids, doc_ids=doc_ids,
                n_tokens=torch.tensor(sum(fills)))


def train_policies(policies: Sequence[str], lengths: Sequence[int], docs: Sequence[torch.Tensor], capacity: int,
                   model_cfg: GPTConfig, batch_size: int, megabatch: int, lr: float, steps: int, warmup: int = 0,
                   seed: int = 0, device: str = "cpu") -> dict:
    """Train the GPT on each batching policy's own batches and measure its useful throughput.

    Each policy gets its own model and optimizer from the same seed; the policies take turns step by
    step, so a busy machine slows all of them alike. Packed rows get per-document position ids and
    the block-diagonal mask, so packing changes the batches, not what the model learns from a
    document. Per policy: real (non-pad) tokens, token slots, seconds, losses, real tokens/s, slots/s,
    the padding fraction and the median step in ms (``warmup`` steps excluded).
    """
    positive_int("steps", steps)
    non_negative_int("warmup", warmup)  # steps left out of the figures
    if not policies:
        raise ValueError("policies is empty; pass some of labkit.feeding.batching.POLICIES")
    dev = torch.device(device)

    def sync() -> None:
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)

    def stepper(policy: str):
        batches = make_batches(lengths, policy, max_len=capacity, batch_size=batch_size, megabatch=megabatch,
                               seed=seed)
        model = build_model(model_cfg, seed=seed).to(dev)
        opt = torch.optim.AdamW(model.parameters(), lr=lr)

        def step(i: int) -> tuple[float, int, int, float]:
            b = batches[i % len(batches)]
            x = {k: v.to(dev) for k, v in collate(b.rows, docs, capacity, width=b.width).items()}
            extra = dict(position_ids=x["position_ids"], doc_ids=x["doc_ids"]) if policy == "packed" else {}
            sync()
            t0 = time.perf_counter()
            _, loss = model(x["input_ids"], x["labels"], **extra)
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            sync()
            return time.perf_counter() - t0, int(x["n_tokens"]), x["input_ids"].numel(), loss.item()

        return step

    steppers = {p: stepper(p) for p in policies}
    log: dict[str, list] = {p: [] for p in policies}
    for i in range(warmup + steps):
        for p in policies:
            out = steppers[p](i)
            if i >= warmup:
                log[p].append(out)
    runs = {}
    for p, rec in log.items():
        sec, real, slots, loss = (np.array(c) for c in zip(*rec))
        runs[p] = dict(real_tokens=int(real.sum()), slots=int(slots.sum()), seconds=float(sec.sum()),
                       loss=loss.tolist(), real_per_s=float(real.sum() / sec.sum()),
                       slots_per_s=float(slots.sum() / sec.sum()), padding=float(1 - real.sum() / slots.sum()),
                       step_ms=float(np.median(sec) * 1e3))
    return runs
