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
import os
import shutil
import sysconfig
import time
from typing import Callable

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch import Tensor
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten


def silu_residual_rmsnorm(x: Tensor, bias: Tensor, residual: Tensor) -> Tensor:
    """An illustrative chain of the element-wise ops a block holds: a bias, an activation (SiLU),
    a residual add and an RMSNorm (Zhang & Sennrich 2019), written as eager PyTorch writes it (no
    weight: it would be one more multiply). Eight kernels eager."""
    y = F.silu(x + bias) + residual
    return y * torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + 1e-6)


def chain_inputs(tokens: int, width: int, device: str = "cpu", dtype: torch.dtype = torch.float32,
                 seed: int = 0) -> tuple[Tensor, Tensor, Tensor]:
    """Random ``x`` and ``residual`` of ``tokens`` x ``width`` and a ``bias`` of ``width``, for
    :func:`silu_residual_rmsnorm`."""
    g = torch.Generator(device=device).manual_seed(seed)
    return tuple(torch.randn(*s, device=device, dtype=dtype, generator=g) for s in ((tokens, width), (width,),
                                                                                   (tokens, width)))


def block_and_input(width: int, heads: int, batch: int, seq: int, device: str = "cpu",
                    dtype: torch.dtype = torch.float32, seed: int = 0) -> tuple[nn.Module, Tensor]:
    """One transformer block of the lab GPT (:class:`labkit.core.model.Block`), in eval mode, and a
    random input of ``batch`` x ``seq`` x ``width`` for it."""
    from labkit.core.model import Block, GPTConfig

    block = Block(GPTConfig(n_layer=1, n_head=heads, n_embd=width, block_size=seq)).to(device, dtype).eval()
    g = torch.Generator(device=device).manual_seed(seed)
    return block, torch.randn(batch, seq, width, device=device, dtype=dtype, generator=g)


def _nbytes(tree) -> int:
    return sum(t.numel() * t.element_size() for t in tree_flatten(tree)[0] if isinstance(t, Tensor))


class _Traffic(TorchDispatchMode):
    """Every aten op's inputs and outputs, in bytes, and the number of ops (eager: one kernel each).
    A view (a reshape, a transpose) launches nothing and moves nothing: it is not counted."""

    def __init__(self) -> None:
        super().__init__()
        self.bytes, self.ops = 0, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if not getattr(func, "is_view", False):
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
                      "kernels": sum(map(_launches, metrics.nodes_num_elem))}


def _launches(entry: tuple) -> bool:
    """Whether a node Inductor scheduled is a kernel: not a no-op, nor the ``MultiOutput`` that unpacks
    a fallback kernel's tuple of outputs (SDPA's, for one)."""
    node = entry[0]
    return type(node).__name__ != "NopKernelSchedulerNode" and type(getattr(node, "node", None)).__name__ != "MultiOutput"


def eager_and_compiled(fn: Callable, *args: Tensor, repeats: int = 10) -> dict[str, float | int | None]:
    """``fn`` on ``args`` eager and compiled: kernels and bytes each way (:func:`eager_traffic`,
    :func:`compile_with_traffic`), the seconds compiling took, the best time per call each way with
    the host's launches counted, and the eager call replayed as a CUDA graph (None off CUDA)."""
    require_compiler(args[0].device.type)
    eager = eager_traffic(fn, *args)
    compiled, info = compile_with_traffic(fn, *args)
    return {"eager_kernels": eager["kernels"], "eager_bytes": eager["bytes"],
            "compiled_kernels": info["kernels"], "compiled_bytes": info["bytes"], "compile_s": info["compile_s"],
            "eager_s": best_seconds(fn, *args, repeats=repeats, launches=True),
            "compiled_s": best_seconds(compiled, *args, repeats=repeats, launches=True),
            "graph_s": cuda_graph_seconds(fn, *args, repeats=repeats)}


def floor_bytes(args: tuple[Tensor, ...], out: Tensor) -> int:
    """The roofline's compulsory traffic: every input read once, the output written once."""
    return _nbytes(args) + _nbytes(out)


# Bytes written before each timed call on CUDA, to push the inputs out of L2 (50 MB on an H100 or
# H200): triton.testing.do_bench's 256 MB
L2_FLUSH_BYTES = 256 << 20


def best_seconds(fn: Callable, *args: Tensor, repeats: int = 10, launches: bool = False) -> float:
    """The fastest of ``repeats`` calls (after one warm-up). On a CPU, the host's clock around each.

    On CUDA, two events on the stream around each call, after L2 is overwritten (as
    ``triton.testing.do_bench`` times a kernel): the GPU's time from memory, not the host's clock,
    whose launch and synchronisation would add microseconds to a kernel that takes a few. With
    ``launches`` the device is idle when the first event is recorded, so the host's time to launch
    each kernel counts whenever the GPU waits for it, as in a step made of small kernels: the cost a
    CUDA graph removes."""
    with torch.no_grad():
        if args[0].is_cuda:
            return _cuda_best(fn, args, repeats, launches)
        fn(*args)
        best = float("inf")
        for _ in range(repeats):
            t0 = time.perf_counter()
            fn(*args)
            best = min(best, time.perf_counter() - t0)
    return best


def _cuda_best(fn: Callable, args: tuple[Tensor, ...], repeats: int, launches: bool) -> float:
    flush = torch.empty(L2_FLUSH_BYTES // 4, dtype=torch.int32, device=args[0].device)
    fn(*args)
    pairs = []
    for _ in range(repeats):
        flush.zero_()
        if launches:
            torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn(*args)
        end.record()
        pairs.append((start, end))
    torch.cuda.synchronize()
    return min(s.elapsed_time(e) for s, e in pairs) / 1e3  # elapsed_time is in milliseconds


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
    return best_seconds(lambda *_: graph.replay(), *args, repeats=repeats, launches=True)


def toolchain() -> dict[str, str | bool | None]:
    """What ``torch.compile`` needs besides torch: a C compiler (Inductor's CPU code, and Triton's
    launcher on a GPU), the Python headers to build against, and on CUDA Triton itself (Inductor's GPU
    code generator; a CUDA wheel requires it, but a trimmed image may lack it)."""
    import importlib.util

    cc = next((found for name in (os.environ.get("CC"), "gcc", "cc", "clang") if name
               for found in [shutil.which(name)] if found), None)
    headers = os.path.exists(os.path.join(sysconfig.get_paths()["include"], "Python.h"))
    return {"c_compiler": cc, "python_headers": headers, "triton": importlib.util.find_spec("triton") is not None}


def compiler_missing(device: str = "cpu") -> list[str]:
    """What ``torch.compile`` on ``device`` needs and this machine lacks, in words (empty: nothing)."""
    t = toolchain()
    wanted = (("triton", t["triton"] or not device.startswith("cuda")), ("a C compiler (set CC)", t["c_compiler"]),
              ("Python.h (the Python development headers)", t["python_headers"]))
    return [what for what, there in wanted if not there]


def require_compiler(device: str = "cpu") -> None:
    """Stop, as a missing package stops a lab (a skip that names it), before ``torch.compile`` fails half
    way through its first call for want of a tool (Inductor reports it deep in a traceback)."""
    missing = compiler_missing(device)
    if missing:
        # a ModuleNotFoundError with no module name: the lab runners report its words as what is missing
        raise ModuleNotFoundError(f"{', '.join(missing)} for torch.compile on {device}")
