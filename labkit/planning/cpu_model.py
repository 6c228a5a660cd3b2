"""The planner's step-time model on this machine: CPU ranks over gloo, calibrated here, then held
against the labs' measured steps.

The same :func:`labkit.planning.step_model.predict` that is held against published GPU runs
(:mod:`labkit.planning.published`), given the rates this machine achieves instead of a datasheet's.
Each is measured by :func:`calibrate_on_rank` on every rank at once (so the ranks share the cores as
they do in training), none fitted to the steps it then predicts:

* **matmul rate**: fp32 GEMMs of three sizes, the fastest (a rank's roofline compute peak);
* **memory bandwidth**: copying a 64 MB tensor (the roofline's other roof);
* **operator overhead**: a training step of a GPT so small its arithmetic is nothing, divided by the
  operators it dispatched: what Python, the dispatcher and autograd cost around every kernel, with
  the labs' collective counter on as it is in their CPU runs. An operator on a DTensor costs more
  (its sharding is propagated on the host): a step of a tensor-parallel MLP of width 8, timed the same
  way, less its plain operators and its all-reduces.
  The run's own operators are counted, not timed (:class:`labkit.comm.counter.CommCounter`);
* **gloo**: all-reduce and all-gather timed over message sizes and fitted with the latency-bandwidth
  model (:func:`labkit.comm.alpha_beta.fit`); the step model's start-up latency and per-ring-step
  latency are solved from the two fits (an all-reduce on two ranks takes two ring steps, an
  all-gather one), its bandwidth is the all-reduce's.

A lab's model is tiny: its steps are made of operator overheads and collective latencies, which is
what the model predicts for it, and what a GPU run at scale is not made of.
"""
from __future__ import annotations

import os
import statistics
import time
from dataclasses import asdict
from typing import Any

import torch
import torch.distributed as dist

from labkit.comm.alpha_beta import fit
from labkit.comm.bench import bench
from labkit.comm.counter import CommCounter
from labkit.device.measure import measure_rates
from labkit.planning.hardware import Hardware, Link
from labkit.planning.step_model import Operators

GLOO_SIZES = [1 << k for k in range(10, 23, 2)]  # 1 KiB to 4 MiB


def operator_seconds(steps: int = 30) -> float:
    """Seconds per operator of a training step whose arithmetic is negligible (a 2-layer GPT of width
    8 on 8 tokens, AdamW), with the collective counter on: fixed cost over operators dispatched."""
    from labkit.core.model import GPT, GPTConfig

    torch.manual_seed(0)
    cfg = GPTConfig(n_layer=2, n_head=2, n_embd=8, block_size=8, vocab_size=64, dropout=0.0)
    model = GPT(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x = torch.randint(0, cfg.vocab_size, (1, cfg.block_size))
    best = float("inf")
    for _ in range(steps):
        t0 = time.perf_counter()
        with CommCounter() as c:
            _, loss = model(x, x)
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
        best = min(best, (time.perf_counter() - t0) / sum(c.ops.values()))
    return best


def dtensor_operator_seconds(op_s: float, all_reduce_s: float, steps: int = 30) -> float:
    """Seconds per DTensor operator: a training step of a tensor-parallel MLP of width 8 (Megatron-LM's
    column- then row-parallel pair, AdamW over its sharded weights), with the collective counter on,
    less its plain operators at ``op_s`` and its all-reduces at ``all_reduce_s``, over its DTensor
    operators. Call on every rank."""
    from torch import nn
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    from labkit.parallel.layout.mesh import Degrees, ParallelDims

    mesh = ParallelDims(Degrees(tp=dist.get_world_size())).submesh("tp")
    torch.manual_seed(0)
    mlp = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 8))
    parallelize_module(mlp, mesh, {"0": ColwiseParallel(), "2": RowwiseParallel()})
    opt = torch.optim.AdamW(mlp.parameters(), lr=1e-3)
    x = torch.randn(4, 8)
    best = float("inf")
    for _ in range(steps):
        dist.barrier()
        t0 = time.perf_counter()
        with CommCounter() as c:
            mlp(x).sum().backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
        rest = time.perf_counter() - t0 - c.ops["plain"] * op_s - sum(c.calls.values()) * all_reduce_s
        best = min(best, max(0.0, rest) / max(1, c.ops["dtensor"]))
    return best


def gloo_link(rows: list[dict]) -> dict[str, float]:
    """Start-up latency, per-step latency and bus bandwidth of the step model's link, from the comm
    bench's all-reduce and all-gather rows on two ranks (see the module docstring)."""
    fits = {op: fit([r["bytes"] for r in rows if r["op"] == op], [r["time_us"] * 1e-6 for r in rows if r["op"] == op])
            for op in ("all_reduce", "all_gather")}
    ar, ag = fits["all_reduce"], fits["all_gather"]
    step = max(0.0, ar.alpha_s - ag.alpha_s)  # all-reduce: base + 2 steps; all-gather: base + 1
    return {"base_latency_s": max(0.0, ar.alpha_s - 2 * step), "step_latency_s": step,
            "busbw_gb_per_s": ar.bandwidth_gbps, "all_reduce_alpha_s": ar.alpha_s, "all_gather_alpha_s": ag.alpha_s}


def calibrate_on_rank(sizes: list[int] | None = None) -> dict[str, Any]:
    """Every rate of the module docstring, measured on this rank while the others measure theirs
    (``labkit.launch.launch(calibrate_on_rank, world_size=2)``)."""
    rows = bench(["all_reduce", "all_gather"], sizes or GLOO_SIZES, torch.device("cpu"), warmup=3, target_ms=20.0)
    link = gloo_link([asdict(r) for r in rows])
    dist.barrier()
    out = {**measure_rates(), "op_s": operator_seconds(), **link}
    out["dtensor_op_s"] = dtensor_operator_seconds(out["op_s"], link["all_reduce_alpha_s"])
    return {**out, "ranks": dist.get_world_size(), "cores": os.cpu_count() or 1}


def combine(per_rank: list[dict[str, Any]]) -> dict[str, Any]:
    """One calibration from every rank's: the fastest rank's operator costs (another process on the
    machine, a notebook's kernel, can take a share of one rank's core while it measures), the
    slowest rank's rates (a step waits for its slowest rank); gloo's fits are the ranks' own."""
    out = dict(per_rank[0])
    for key in ("op_s", "dtensor_op_s"):
        out[key] = min(c[key] for c in per_rank)
    for key in ("matmul_flops", "bytes_per_s"):
        out[key] = min(c[key] for c in per_rank)
    return out


def cpu_hardware(cal: dict[str, Any], world: int) -> Hardware:
    """A :class:`~labkit.planning.hardware.Hardware` for ``world`` ranks on this machine's cores, from
    a calibration on ``cal["ranks"]`` ranks: ranks beyond the cores time-share them, so rates divide
    and per-operator and per-message costs multiply by ``world / max(cores, calibrated ranks)``."""
    slow = max(1.0, world / max(cal["cores"], cal["ranks"]))
    link = Link("gloo over TCP on this machine", cal["step_latency_s"] * slow, cal["busbw_gb_per_s"] / slow,
                "measured here: all-reduce and all-gather on two ranks, latency-bandwidth fits")
    return Hardware("this machine's CPU, a share of its cores per rank", cal["matmul_flops"] / slow / 1e12,
                    cal["bytes_per_s"] / slow / 1e9, 1.0, 1.0, 1.0, link, link, world,
                    "measured here (labkit.planning.cpu_model.calibrate_on_rank)",
                    base_latency_s=cal["base_latency_s"] * slow, op_overhead_s=cal["op_s"] * slow,
                    dtensor_op_overhead_s=cal["dtensor_op_s"] * slow)


def counted_operators(result: dict, microbatches: int) -> Operators:
    """The operators a run's rank dispatched in its last counted step, per micro-batch and in the
    optimizer step, from ``operators_per_step`` (:func:`labkit.train.train` records it)."""
    counts = [c for c in result["operators_per_step"] if c is not None]
    if not counts:
        raise ValueError("the run counted no step: train with count_comm='every' or 'last'")
    last = counts[-1]
    fb, total = last["fwd_bwd"], last["total"]
    return Operators(micro_batch=fb.get("plain", 0) / microbatches,
                     micro_batch_dtensor=fb.get("dtensor", 0) / microbatches,
                     step=total.get("plain", 0) - fb.get("plain", 0),
                     step_dtensor=total.get("dtensor", 0) - fb.get("dtensor", 0))


def measured_step(result: dict) -> float:
    """The median step of a training run, without its first (warm-up) step."""
    times = result["step_time_s"]
    return statistics.median(times[1:] or times)
