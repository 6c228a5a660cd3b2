"""Text in and out of the byte-level GPT: a second corpus in another style, and samples.

* :func:`source_corpus`: the Python source of PyTorch's ``torch.nn.modules`` (``Linear``, ``Conv2d``,
  ``Transformer``...), read from the installed torch, as one byte tensor. Nothing to download, a
  style (indentation, ``def``, ``self.``, docstrings) a model pretrained on Shakespeare has never
  seen: the fine-tuning lab's task. Fixed for a pinned torch, so the lab's losses are held exactly
  against the regression baseline (labkit's own source, the earlier corpus, changed with every commit).
* :func:`generate`: sample a continuation of a prompt from the GPT (or a model wrapping it, as
  ``peft``'s do), one byte at a time, with a seeded generator so that a page of the book always
  shows the same sample.
"""
from __future__ import annotations

from pathlib import Path

import torch
import torch.nn as nn

from labkit.core.checks import positive_int, positive_number

SOURCE_DIR = Path(torch.nn.modules.__file__).resolve().parent  # the installed torch's nn modules


def source_corpus(root: str | Path | None = None, pattern: str = "*.py") -> torch.Tensor:
    """Every file matching ``pattern`` under ``root`` (default: torch's ``nn/modules``), in path order,
    joined by blank lines, as a 1-D ``uint8`` tensor of bytes."""
    base = Path(root) if root is not None else SOURCE_DIR
    files = sorted(p for p in base.rglob(pattern) if p.is_file() and "__pycache__" not in p.parts)
    if not files:
        raise ValueError(f"root={str(base)!r} holds no file matching {pattern!r}")
    text = b"\n\n".join(p.read_bytes() for p in files)
    return torch.frombuffer(bytearray(text), dtype=torch.uint8)


def _block_size(model: nn.Module) -> int:
    inner = model.get_base_model() if hasattr(model, "get_base_model") else model
    return inner.config.block_size


@torch.no_grad()
def generate(model: nn.Module, prompt: str, new_tokens: int = 200, temperature: float = 0.8,
             top_k: int | None = 40, seed: int = 0) -> str:
    """``prompt`` and ``new_tokens`` sampled bytes after it, decoded as UTF-8 (bad bytes replaced).

    The model stays in the mode it is in: a bitsandbytes 4-bit layer called in eval mode without
    gradients repacks its weight for a CPU kernel (see :mod:`labkit.memory.qlora`), and the lab
    GPT has no dropout to switch off.
    """
    positive_int("new_tokens", new_tokens)
    positive_number("temperature", temperature)
    if top_k is not None:
        positive_int("top_k", top_k)
    data = prompt.encode("utf-8")
    if not data:
        raise ValueError("prompt must not be empty: the model needs at least one byte to continue")
    block = _block_size(model)
    device = next(model.parameters()).device
    idx = torch.tensor([list(data)], dtype=torch.long, device=device)
    g = torch.Generator(device=device).manual_seed(seed)
    for _ in range(new_tokens):
        logits = model(idx[:, -block:])[0][:, -1, :].float() / temperature
        if top_k is not None:
            kth = torch.topk(logits, min(top_k, logits.size(-1))).values[:, -1:]
            logits = logits.masked_fill(logits < kth, float("-inf"))
        nxt = torch.multinomial(torch.softmax(logits, dim=-1), 1, generator=g)
        idx = torch.cat([idx, nxt], dim=1)
    return bytes(idx[0].tolist()).decode("utf-8", errors="replace")
