"""What a run measures besides its loss: speed (tokens/s, model TFLOP/s, MFU), peak memory, traces.

* **Speed.** Steps are timed with the device synchronised at both ends. ``tokens_per_s`` is the
  global batch's tokens over the median step time (the first step, which allocates and warms
  caches, and steps run under the collective counter are left out). Model FLOPs per token are
  :func:`labkit.planning.cost.flops_per_token`; ``mfu`` divides the model FLOP/s each device does
  by its datasheet peak (:mod:`labkit.planning.accelerators`) for the dtype the matmuls run in, or
  by ``peak_tflops`` when given; it stays None on a CPU without one. ``mfu`` counts the causal half
  of the attention scores (what causal kernels compute); ``mfu_palm`` all of them, the convention
  PaLM, Megatron-LM and torchtitan publish (about 10% higher for GPT-2 small at 1,024 tokens).
  ``hfu`` counts the FLOPs of recomputation too (Chowdhery et al. 2022, appendix B).
* **Memory.** On CUDA each rank reports its allocator's peak, allocated and reserved.
* **Traces.** ``profile_steps="A:B"`` records steps A to B-1 with ``torch.profiler`` into one
  Chrome-trace JSON per rank (open it in Perfetto or chrome://tracing); ``memory_snapshot`` (CUDA)
  records the allocator's history for PyTorch's memory visualizer.
* **Determinism.** ``deterministic`` turns on ``torch.use_deterministic_algorithms`` and sets the
  cuBLAS workspace it needs, so a resumed GPU run can be bit-identical too, at some speed.
"""
from __future__ import annotations

import os
import resource
import statistics
from contextlib import AbstractContextManager, nullcontext
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from labkit.planning.accelerators import datasheet
from labkit.planning.cost import flops_per_token
from labkit.train.config import parse_steps

if TYPE_CHECKING:
    from labkit.core.model import GPTConfig
    from labkit.train.config import TrainConfig

# what the matmuls run in, by precision (FP8 is emulated: its matmuls run in fp32)
MATMUL_DTYPE = {"fp32": "fp32", "bf16": "bf16", "fp16": "fp16", "fp8": "fp32", "fp8-block": "fp32"}


def set_up(cfg: TrainConfig, device: torch.device) -> None:
    """Process-wide settings a run asks for: TF32 matmuls, deterministic algorithms, allocator history."""
    if cfg.deterministic:
        # cuBLAS needs a fixed workspace for deterministic matmuls (CUDA docs, cuBLAS "Results
        # reproducibility"); it is read when the first handle is made, so before any matmul.
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True)
        torch.backends.cudnn.benchmark = False
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = cfg.tf32
        torch.backends.cudnn.allow_tf32 = cfg.tf32
        torch.cuda.reset_peak_memory_stats(device)
        if cfg.memory_snapshot:
            torch.cuda.memory._record_memory_history(max_entries=100_000)


class StepProfiler(AbstractContextManager):
    """``torch.profiler`` over the steps ``cfg.profile_steps`` names, one trace file per rank."""

    def __init__(self, cfg: TrainConfig, device: torch.device, rank: int) -> None:
        self.window = parse_steps(cfg.profile_steps, cfg.steps) if cfg.profile_steps else range(0)
        self.path = Path(cfg.profile_dir) / f"trace_rank{rank}.json"
        self.device, self.prof = device, None

    def step(self, step: int) -> AbstractContextManager:
        """The context to run ``step`` in: it starts and stops the profiler at the window's edges."""
        from torch.profiler import ProfilerActivity, profile, record_function

        if step not in self.window:
            return nullcontext()
        if self.prof is None:
            acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if self.device.type == "cuda" else [])
            self.prof = profile(activities=acts)
            self.prof.__enter__()
        return record_function(f"labkit step {step}")

    def after(self, step: int) -> None:
        if self.prof is not None and step == self.window[-1]:
            self.prof.__exit__(None, None, None)
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self.prof.export_chrome_trace(str(self.path))
            self.prof = None

    def __exit__(self, *exc: object) -> None:
        if self.prof is not None:
            self.prof.__exit__(None, None, None)
            self.prof = None


def peak_memory(device: torch.device) -> dict[str, int | None]:
    """This rank's peak memory: the CUDA allocator's (None on CPU) and the process's resident maximum."""
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB
    if device.type != "cuda":
        return {"allocated": None, "reserved": None, "process_max_rss": rss}
    return {"allocated": torch.cuda.max_memory_allocated(device), "reserved": torch.cuda.max_memory_reserved(device),
            "process_max_rss": rss}


def allocated(device: torch.device) -> int | None:
    """Bytes the CUDA allocator hands out now (None on CPU): after a step, before the gradients are
    freed, that is the model states plus the batch, to hold against :mod:`labkit.memory`. cuBLAS's
    workspaces (one per handle, 32 MiB each under ``CUBLAS_WORKSPACE_CONFIG=:4096:8``) come from the
    same allocator and are no model state: they are released first (cuBLAS takes them again at its
    next matmul)."""
    if device.type != "cuda":
        return None
    clear = getattr(torch._C, "_cuda_clearCublasWorkspaces", None)  # a private hook: asked for, not assumed
    if clear is not None:
        torch.cuda.synchronize(device)
        clear()
    return torch.cuda.memory_allocated(device)


def finish(cfg: TrainConfig, device: torch.device, rank: int) -> None:
    """Write the allocator's history, when asked for (before the process lets go of it)."""
    if cfg.memory_snapshot and device.type == "cuda":
        path = Path(f"{cfg.memory_snapshot}.rank{rank}.pickle")
        path.parent.mkdir(parents=True, exist_ok=True)
        torch.cuda.memory._dump_snapshot(str(path))
        torch.cuda.memory._record_memory_history(enabled=None)


def _peak_tflops(cfg: TrainConfig, device: torch.device) -> float | None:
    if cfg.peak_tflops:
        return cfg.peak_tflops
    if device.type != "cuda":
        return None
    # the device's own share of its card: a MIG slice is compared with its SMs, not the whole GPU's
    props = torch.cuda.get_device_properties(device)
    sheet = datasheet(torch.cuda.get_device_name(device), props.multi_processor_count)
    dtype = "tf32" if cfg.precision == "fp32" and cfg.tf32 else MATMUL_DTYPE[cfg.precision]
    return sheet["peak_tflops"][dtype] if sheet else None


def speed(cfg: TrainConfig, model_cfg: GPTConfig, device: torch.device, world: int, times: list[float],
          timed: list[bool]) -> dict[str, float | None]:
    """tokens/s, model TFLOP/s (the whole job and per device), MFU and HFU from the timed steps."""
    usable = [t for i, (t, ok) in enumerate(zip(times, timed)) if ok and i > 0] or times
    if not usable:
        return {"tokens_per_s": None, "model_tflops_per_s": None, "mfu": None, "mfu_palm": None, "hfu": None,
                "peak_tflops": None}
    step_s = statistics.median(usable)
    tokens_per_s = cfg.batch_size * model_cfg.block_size / step_s
    args = (model_cfg.n_layer, model_cfg.n_embd, model_cfg.block_size, model_cfg.vocab_size)
    model_tflops = tokens_per_s * flops_per_token(*args) / 1e12
    published_tflops = tokens_per_s * flops_per_token(*args, causal=False) / 1e12
    recompute = "full" if cfg.activation_checkpointing == "full" else "none"
    hardware_tflops = tokens_per_s * flops_per_token(*args, recompute=recompute) / 1e12
    peak = _peak_tflops(cfg, device)
    return {"tokens_per_s": tokens_per_s, "median_step_s": step_s, "model_tflops_per_s": model_tflops,
            "model_tflops_per_s_per_device": model_tflops / world, "peak_tflops": peak,
            "mfu": model_tflops / world / peak if peak else None,
            "mfu_palm": published_tflops / world / peak if peak else None,
            "hfu": hardware_tflops / world / peak if peak else None}
