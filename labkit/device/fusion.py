"""Fusion: the same memory-bound ops, eager (one kernel each, every intermediate through memory)
and compiled by ``torch.compile`` (TorchInductor fuses them into one loop: inputs read once, the
output written once; Ansel et al. 2024, "PyTorch 2", ASPLOS).

Bytes are measured both ways: eager, as the inputs and outputs of every aten op a dispatch mode
sees; compiled, as Inductor counts the buffers its generated kernels read and write (its
``inductor_metrics`` log, ``num_bytes_accessed``). The roofline's floor is the chain's own inputs and
output. On a GPU, what is left after fusion is the launch of each kernel (a few microseconds of
host time each); CUDA graphs record a sequence of kernels once and replay it with one launch
(:func:`cuda_graph_seconds`).
"""
from __future__ import annotations

import contextlib
import io
import logging
import time
from typing import Callable

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten


def silu_residual_rmsnorm(x: Tensor, bias: Tensor, residual: Tensor) -> Tensor:
    """A chain of memory-bound ops as a Llama block has them: a bias, SiLU, the residual add, then
    RMSNorm (Zhang & Sennrich 2019) written as eager PyTorch writes it (no weight: it would be one
    more multiply). Eight kernels eager."""
    y = F.silu(x + bias) + residual
    return y * torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + 1e-6)


def _nbytes(tree) -> int:
    return sum(t.numel() * t.element_size() for t in tree_flatten(tree)[0] if isinstance(t, Tensor))


class _Traffic(TorchDispatchMode):
    """Every aten op's inputs and outputs, in bytes, and the number of ops (eager: one kernel each)."""

    def __init__(self) -> None:
        super().__init__()
        self.bytes, self.ops = 0, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.bytes += _nbytes((args, kwargs)) + _nbytes(out)
        self.ops += 1
        return out


def eager_traffic(fn: Callable, *args: Tensor) -> dict[str, int]:
    with torch.no_grad(), _Traffic() as t:
        fn(*args)
    return {"bytes": t.bytes, "kernels": t.ops}


def compile_with_traffic(fn: Callable, *args: Tensor) -> tuple[Callable, dict[str, float]]:
    """``torch.compile(fn)``, compiled now on ``args``: the compiled function, the seconds compiling
    took, the kernels Inductor generated and the bytes they access (its own count)."""
    from torch._inductor import metrics

    metrics.reset()
    quiet = logging.getLogger("torch._inductor")
    level = quiet.level
    # Inductor counts bytes only while its metrics log is on; the log's handler, made now, writes to
    # a buffer, not to the notebook
    with contextlib.redirect_stderr(io.StringIO()):
        torch._logging.set_logs(inductor_metrics=True)
        quiet.setLevel(logging.WARNING)
        try:
            torch._dynamo.reset()
            compiled = torch.compile(fn)
            t0 = time.perf_counter()
            # Inductor's cache would skip the scheduler that counts (and the time it takes)
            with torch.no_grad(), torch._inductor.config.patch(fx_graph_cache=False):
                compiled(*args)
            seconds = time.perf_counter() - t0
        finally:
            torch._logging.set_logs()
            quiet.setLevel(level)
    return compiled, {"compile_s": seconds, "bytes": metrics.num_bytes_accessed,
                      "kernels": len(metrics.nodes_num_elem)}


def floor_bytes(args: tuple[Tensor, ...], out: Tensor) -> int:
    """The roofline's compulsory traffic: every input read once, the output written once."""
    return _nbytes(args) + _nbytes(out)


def best_seconds(fn: Callable, *args: Tensor, repeats: int = 10) -> float:
    """The fastest of ``repeats`` calls (after one warm-up), the device synchronised around each."""
    sync = torch.cuda.synchronize if args[0].is_cuda else (lambda: None)
    with torch.no_grad():
        fn(*args)
        best = float("inf")
        for _ in range(repeats):
            sync()
            t0 = time.perf_counter()
            fn(*args)
            sync()
            best = min(best, time.perf_counter() - t0)
    return best


def cuda_graph_seconds(fn: Callable, *args: Tensor, repeats: int = 10) -> float | None:
    """One replay of ``fn`` captured as a CUDA graph (one launch for all its kernels); None off CUDA."""
    if not args[0].is_cuda:
        return None
    with torch.no_grad():
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # warm-up outside the capture, as the CUDA graphs docs ask
            fn(*args)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            fn(*args)
    return best_seconds(lambda *_: graph.replay(), *args, repeats=repeats)
