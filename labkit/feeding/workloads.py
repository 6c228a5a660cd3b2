"""Workloads for the input-pipeline lab: loaders whose cost per sample is known and controllable.

* :class:`SleepBatches` - each item is a whole batch that takes exactly ``load_s`` to produce: the
  synthetic loader the analytic bound is checked against.
* :class:`TextSamples` - what a real text loader does per sample: cut a speech out of the
  Shakespeare corpus, tokenize it (GPT-2's pre-tokenization regex, then bytes), augment it (a
  random crop), pad it to ``block_size``. Its cost is set by ``io_ms`` (a sleep: waiting on storage
  or the network, which leaves the CPU free), ``cpu_ms`` (real tokenizer work repeated until that
  much CPU time is spent, which competes with compute for the cores), ``slow_every``/``slow_ms``
  (one sample in ``slow_every`` is a cold read: remote storage's latency tail) and ``setup_ms``
  (paid once per worker process: opening shards, loading a tokenizer).
* :func:`pretokenize` / :class:`MemmapSamples` - the same rows written once to a ``np.memmap``
  file and read back with no per-sample work.
* :func:`straggler_run` - a rank function for ``labkit.launch``: DDP where one rank's loader is
  slow, to show the others' wait hidden inside the all-reduce (so counted as busy).
"""
from __future__ import annotations

import os
import re
import time
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import Dataset

from labkit.core.data import load_corpus

PAD_ID = 0  # byte 0 never occurs in the corpus text, so it can mark padding
IGNORE = -100  # F.cross_entropy's default ignore_index: pads add nothing to the loss
# GPT-2's pre-tokenizer (Radford et al. 2019, encoder.py), in stdlib-re form (\w for \p{L}\p{N}).
_PRETOKENIZE = re.compile(r"""'s|'t|'re|'ve|'m|'ll|'d| ?[^\W\d_]+| ?\d+| ?[^\s\w]+|\s+(?!\S)|\s+""")


def _check(name: str, value, low: float = 0.0, integer: bool = False, strict: bool = False) -> None:
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and np.isfinite(value)
    ok = ok and (value > low if strict else value >= low) and (not integer or isinstance(value, int))
    if not ok:
        kind = "an integer" if integer else "a finite number"
        raise ValueError(f"{name} must be {kind} {'>' if strict else '>='} {low:g}, got {value!r}")


class SleepBatches(Dataset):
    """``n`` batches of shape ``(rows, cols)``; producing one takes ``load_s`` seconds of sleep.

    Use with ``DataLoader(SleepBatches(...), batch_size=None)`` so that one item is one batch. A sleep
    models I/O-bound loading and, unlike CPU work, stays exact when other processes load the cores.
    """

    def __init__(self, n: int, load_s: float, rows: int = 4, cols: int = 16) -> None:
        _check("n", n, 0, integer=True, strict=True)
        _check("load_s", load_s)
        _check("rows", rows, 0, integer=True, strict=True)
        _check("cols", cols, 0, integer=True, strict=True)
        self.n, self.load_s, self.shape = n, float(load_s), (rows, cols)

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> list[list[int]]:
        time.sleep(self.load_s)
        return [[i % 256] * self.shape[1]] * self.shape[0]


def speeches(corpus: str | Path | None = None) -> list[str]:
    """The corpus cut at blank lines: one speech per item (7,222 in the shipped Shakespeare)."""
    text = load_corpus(corpus).numpy().tobytes().decode("utf-8", errors="replace")
    return [s for s in text.split("\n\n") if s.strip()]


def tokenize(text: str) -> list[int]:
    """Byte-level ids after GPT-2's pre-tokenization split (the split is the work; ids are bytes)."""
    return [b for piece in _PRETOKENIZE.findall(text) for b in piece.encode("utf-8")]


class TextSamples(Dataset):
    """Padded next-byte rows ``(x, y)`` built per sample from the corpus, at a controllable cost.

    ``x`` is padded with :data:`PAD_ID` and ``y`` with :data:`IGNORE`, so the model computes on the
    pads (they take compute) but learns nothing from them (they are not useful tokens).
    """

    def __init__(self, block_size: int = 128, n: int | None = None, io_ms: float = 0.0,
                 cpu_ms: float = 0.0, slow_every: int = 0, slow_ms: float = 0.0, setup_ms: float = 0.0,
                 seed: int = 0, corpus: str | Path | None = None) -> None:
        _check("block_size", block_size, 0, integer=True, strict=True)
        for name, v in (("io_ms", io_ms), ("cpu_ms", cpu_ms), ("slow_ms", slow_ms), ("setup_ms", setup_ms)):
            _check(name, v)
        _check("slow_every", slow_every, 0, integer=True)
        self.docs = speeches(corpus)
        if n is not None:
            _check("n", n, 0, integer=True, strict=True)
        self.n = n if n is not None else len(self.docs)
        self.block_size, self.seed = block_size, seed
        self.io_ms, self.cpu_ms, self.setup_ms = io_ms, cpu_ms, setup_ms
        self.slow_every, self.slow_ms = slow_every, slow_ms
        self._ready_pid: int | None = None

    def __len__(self) -> int:
        return self.n

    def io_seconds(self, i: int) -> float:
        """The I/O wait of sample ``i``: ``io_ms``, or ``slow_ms`` for every ``slow_every``-th sample."""
        slow = self.slow_every and i % self.slow_every == self.slow_every - 1
        return (self.slow_ms if slow else self.io_ms) / 1e3

    def row(self, i: int) -> np.ndarray:
        """Sample ``i`` as ``block_size + 1`` byte ids (0-padded) and no waiting: the pure function."""
        if not 0 <= i < self.n:
            raise IndexError(f"sample index {i} out of range for {self.n} samples")
        doc = self.docs[i % len(self.docs)]
        ids = tokenize(doc)
        # Augmentation: a random crop when the speech is longer than the context.
        g = np.random.default_rng((self.seed, i, 2))
        start = int(g.integers(0, len(ids) - self.block_size)) if len(ids) > self.block_size + 1 else 0
        out = np.zeros(self.block_size + 1, dtype=np.uint8)
        piece = ids[start:start + self.block_size + 1]
        out[:len(piece)] = piece
        return out

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        if self._ready_pid != os.getpid():  # once per process: a fresh worker pays it again
            time.sleep(self.setup_ms / 1e3)
            self._ready_pid = os.getpid()
        time.sleep(self.io_seconds(i))
        if self.cpu_ms:  # a real tokenizer's cost: re-run the split until cpu_ms of CPU time is spent
            t_end, doc = time.thread_time() + self.cpu_ms / 1e3, self.docs[i % len(self.docs)]
            while time.thread_time() < t_end:
                tokenize(doc)
        return rows_to_xy(self.row(i))


def rows_to_xy(row: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
    """``(x, y)`` from one stored row: pads are 0 in ``x`` and ignored in ``y``."""
    r = torch.from_numpy(np.asarray(row, dtype=np.int64))
    x, y = r[:-1].clone(), r[1:].clone()
    y[y == PAD_ID] = IGNORE
    return x, y


def pretokenize(ds: TextSamples, path: str | Path) -> Path:
    """Write every row of ``ds`` to a ``.npy`` memory map at ``path`` once, with no I/O or CPU cost."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    mm = np.lib.format.open_memmap(path, mode="w+", dtype=np.uint8, shape=(len(ds), ds.block_size + 1))
    for i in range(len(ds)):
        mm[i] = ds.row(i)
    mm.flush()
    del mm
    return path


class MemmapSamples(Dataset):
    """Rows from a :func:`pretokenize` file; each worker maps the file itself, lazily, after the fork."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        if not self.path.is_file():
            raise ValueError(f"path={str(self.path)!r} is not a file; write one with pretokenize(ds, path)")
        self.n = int(np.load(self.path, mmap_mode="r").shape[0])
        self._mm: np.memmap | None = None
        self._pid: int | None = None

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        if self._pid != os.getpid():
            self._mm, self._pid = np.load(self.path, mmap_mode="r"), os.getpid()
        return rows_to_xy(self._mm[i])


def epochs(loader: Iterable, n: int) -> Iterator:
    """The loader's batches for ``n`` epochs back to back (a new iterator, as a trainer makes, each)."""
    _check("n", n, 0, integer=True, strict=True)
    for _ in range(n):
        yield from loader


def gpt_train_step(model: torch.nn.Module, opt: torch.optim.Optimizer
                   ) -> Callable[[tuple[torch.Tensor, torch.Tensor]], torch.Tensor]:
    """A step function for :func:`labkit.feeding.stalls.measure_stalls`: forward, backward, AdamW."""

    def step(batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        x, y = batch
        loss = model(x, y)[1]
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.detach()

    return step


def straggler_run(cfg: dict) -> dict:
    """One DDP rank (under ``labkit.launch``): a balanced phase, then one where rank 1 loads slowly.

    ``cfg``: ``block_size, batch_size, steps, warmup, io_ms, slow_io_ms, n_layer, n_head, n_embd,
    seed``. Returns each phase's :meth:`StallReport.summary` for this rank.
    """
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP
    from torch.utils.data import DataLoader

    from labkit.core.devices import comm_device
    from labkit.core.model import GPTConfig, build_model
    from labkit.feeding.stalls import measure_stalls

    rank = dist.get_rank()
    # Where the group's collectives run: a CUDA job's group is "cpu:gloo,cuda:nccl", which torch 2.11's
    # get_backend returns whole, so an equality with "nccl" put the GPU job's ranks on the CPU
    dev = comm_device()
    mcfg = GPTConfig(block_size=cfg["block_size"], n_layer=cfg["n_layer"], n_head=cfg["n_head"],
                     n_embd=cfg["n_embd"])
    model = build_model(mcfg, seed=cfg["seed"]).to(dev)
    model = DDP(model, device_ids=[dev.index] if dev.type == "cuda" else None)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    step = gpt_train_step(model, opt)
    out = {}
    for phase in ("balanced", "straggler"):
        io = cfg["slow_io_ms"] if (phase == "straggler" and rank == 1) else cfg["io_ms"]
        ds = TextSamples(cfg["block_size"], n=cfg["batch_size"] * cfg["steps"], io_ms=io, seed=cfg["seed"] + rank)
        loader = DataLoader(ds, batch_size=cfg["batch_size"], num_workers=0)
        dist.barrier()
        rep = measure_stalls(loader, step, steps=cfg["steps"], device=dev, warmup=cfg["warmup"],
                             pad_id=PAD_ID, progress=False)
        out[phase] = rep.summary()
    return out
