"""Byte-level language-modelling data over the tiny-Shakespeare corpus shipped with labkit.

Every byte is a token (vocabulary 256), so there is no tokenizer to download. Batches are a pure
function of ``(seed, step)``: the *global* batch of a step is the same whatever the world size, and
rank ``r`` of ``N`` takes rows ``[r*B/N, (r+1)*B/N)`` of it. That is what makes a data-parallel run
comparable with a single-process run step by step, and a resumed run identical to an uninterrupted one
(the data position is just the step number).
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from labkit.core.checks import positive_int

CORPUS = Path(__file__).parent.parent / "corpus" / "tinyshakespeare.txt"


def load_corpus(path: str | Path | None = None) -> torch.Tensor:
    """The corpus as a 1-D ``uint8`` tensor of bytes (default: the shipped Shakespeare text)."""
    p = Path(path) if path is not None else CORPUS
    if not p.is_file():
        raise FileNotFoundError(
            f"corpus={str(p)!r} is not a file; pass the path of a text file, or leave corpus=None "
            f"for the shipped corpus at {CORPUS}"
        )
    raw = p.read_bytes()
    if len(raw) < 2:  # before frombuffer, whose own words for an empty file name no file
        raise ValueError(f"corpus={str(p)!r} holds {len(raw)} bytes; it needs at least 2 (an empty file?)")
    return torch.frombuffer(bytearray(raw), dtype=torch.uint8)


@dataclass(frozen=True)
class Split:
    train: torch.Tensor
    val: torch.Tensor


def train_val_split(data: torch.Tensor, val_fraction: float = 0.1) -> Split:
    if not 0.0 < val_fraction < 1.0:
        raise ValueError(f"val_fraction must be in (0, 1), got {val_fraction!r}")
    n = int(len(data) * (1 - val_fraction))
    return Split(train=data[:n], val=data[n:])


def check_shard(batch_size: int, world_size: int) -> int:
    """Rows per rank; a clear error when the global batch cannot be split evenly."""
    positive_int("world_size", world_size)
    positive_int("batch_size", batch_size)
    if batch_size % world_size:
        valid = [n for n in range(1, batch_size + 1) if batch_size % n == 0]
        raise ValueError(
            f"world_size={world_size} does not divide the global batch_size={batch_size}; "
            f"valid world sizes for this batch: {valid} (or change batch_size)"
        )
    return batch_size // world_size


def get_batch(
    data: torch.Tensor,
    step: int,
    batch_size: int,
    block_size: int,
    seed: int = 0,
    rank: int = 0,
    world_size: int = 1,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Inputs and next-byte targets, ``(B/N, block_size)`` int64 each, for ``rank`` at ``step``.

    The random offsets come from a generator seeded by ``(seed, step)`` alone, so no global RNG
    state is read or changed and any step can be produced on any rank in any order.
    """
    local = check_shard(batch_size, world_size)
    if not 0 <= rank < world_size:
        raise ValueError(f"rank must be in [0, {world_size}), got {rank!r}")
    if len(data) <= block_size:
        raise ValueError(
            f"block_size={block_size} needs a corpus longer than {block_size} bytes, got {len(data)}"
        )
    g = torch.Generator().manual_seed(seed * 1_000_003 + step)
    starts = torch.randint(len(data) - block_size, (batch_size,), generator=g)
    starts = starts[rank * local : (rank + 1) * local]
    rows = torch.stack([data[s : s + block_size + 1] for s in starts.tolist()]).long()
    return rows[:, :-1].contiguous(), rows[:, 1:].contiguous()


def decode(tokens: torch.Tensor) -> str:
    return bytes(tokens.to(torch.uint8).tolist()).decode("utf-8", errors="replace")
