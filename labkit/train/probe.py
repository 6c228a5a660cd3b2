"""What the loop measures around each step, kept out of the step: time, bytes, memory, routing.

One :class:`Probe` per run. Around every step (:meth:`Probe.step`) it times the step with the device
synchronised and, when due (``count_comm``), counts every collective with one
:class:`~labkit.comm.counter.CommCounter`, by op and by mesh dimension; the step calls
:meth:`Probe.mark` once, after forward and backward, to split what they sent from the update's.
After the step it reads what the placement recorded (a pipeline's timeline, ring attention's K/V
bytes, the experts' all-to-alls and routing) and the model states this rank holds.
:meth:`Probe.rank_figures` and :meth:`Probe.result_fields` (with :mod:`labkit.train.figures`) turn
them into the run's metrics.
"""
from __future__ import annotations

import time
from contextlib import ExitStack, contextmanager
from dataclasses import asdict
from typing import TYPE_CHECKING, Any, Iterator

import torch
import torch.distributed as dist

from labkit.comm.counter import CommCounter, ring_volume
from labkit.core.devices import synchronize
from labkit.memory.calculator import ModelStates
from labkit.memory.probe import measured_model_states
from labkit.train import instruments
from labkit.train.figures import layout_fields, pipeline_rank_figures, predicted_model_states
from labkit.train.result import RankFigures

if TYPE_CHECKING:
    from labkit.train.setup import Setup


def _routing(module: torch.nn.Module) -> list[dict] | None:
    """Each MoE block's routing in the last forward, as plain numbers (None for a dense model)."""
    stats = module.moe_stats() if hasattr(module, "moe_stats") else []
    return [{"routed": s.routed, "kept": s.kept, "dropped": s.dropped, "tokens": s.tokens, "capacity": s.capacity,
             "aux": s.aux} for s in stats] or None


def counted_steps(count_comm: str, device: torch.device, steps: int) -> list[bool]:
    """Which steps run under the collective counter: ``auto`` counts every step on CPU and only the last
    on CUDA, where a Python dispatch mode over every op would slow each step it wraps."""
    mode = count_comm if count_comm != "auto" else ("last" if device.type == "cuda" else "every")
    return [mode == "every" or (mode == "last" and s == steps - 1) for s in range(steps)]


def counted(per_step: list) -> list:
    """A per-step collective record without the steps the counter skipped: every step is counted on
    CPU, only the last on CUDA (``count_comm="auto"``), and the others hold None."""
    out = [v for v in per_step if v is not None]
    if not out:
        raise ValueError("no step of this run was counted: train with count_comm='every' or 'last'")
    return out


class Probe:
    """Per-step records of one rank's run (see the module docstring)."""

    def __init__(self, setup: Setup, steps: int) -> None:
        self.setup, self.cfg, self.device, self.steps = setup, setup.cfg, setup.device, steps
        mode = self.cfg.count_comm
        self.mode = mode if mode != "auto" else ("last" if self.device.type == "cuda" else "every")
        self._counted = counted_steps(mode, self.device, steps)
        self.dims_of = setup.dims.dim_of_groups()
        self.counter: CommCounter | None = None
        self.fwd_bwd: dict[str, int] | None = None
        self.fwd_bwd_ops: dict[str, int] | None = None
        self.states: ModelStates | None = None
        self.rec: dict[str, list] = {k: [] for k in (
            "times", "timed", "comm", "calls", "by_dim", "fwd_bwd", "held", "allocated", "local", "kv", "a2a",
            "routing", "peaks", "ops")}

    def counted(self, step: int) -> bool:
        """Whether ``step`` runs under the collective counter (:func:`counted_steps`)."""
        return self._counted[step]

    @contextmanager
    def step(self, step: int) -> Iterator[None]:
        """Time (and, when due, count) one step, the device synchronised at both ends."""
        placed, counted = self.setup.placed, self.counted(step)
        pipeline = placed.pipeline
        if pipeline is not None:
            if self.setup.dims.group("pp") is not None:
                dist.barrier(group=self.setup.dims.group("pp"))  # the common start of the step's timeline
            pipeline.timeline.start()
        self.fwd_bwd = self.fwd_bwd_ops = None
        synchronize(self.device)
        t0 = time.perf_counter()
        with ExitStack() as stack:
            self.counter = stack.enter_context(CommCounter()) if counted else None
            a2a, kv = None, {}
            if counted and placed.experts and self.setup.dims.degrees.ep > 1:
                from labkit.parallel.experts.placement import record_all_to_all

                a2a = stack.enter_context(record_all_to_all())
            if self.setup.dims.degrees.cp > 1:
                from labkit.parallel.context.ring import record_ring

                kv = stack.enter_context(record_ring())
            yield
        synchronize(self.device)
        self._record(time.perf_counter() - t0, counted, a2a, kv)

    def mark(self) -> None:
        """Forward and backward are done: what they sent so far is theirs."""
        if self.counter is not None:
            self.fwd_bwd = dict(self.counter.bytes)
            self.fwd_bwd_ops = dict(self.counter.ops)

    def after_backward(self, engine: Any) -> None:
        """DeepSpeed's engine, between backward and its step (its step frees the gradients)."""
        from labkit.memory.deepspeed_states import model_states

        self.mark()
        self.states = model_states(engine)

    def _record(self, seconds: float, counted: bool, a2a: dict | None, kv: dict) -> None:
        placed, rec, c = self.setup.placed, self.rec, self.counter
        rec["times"].append(seconds)
        rec["timed"].append(not counted)
        rec["comm"].append(dict(c.bytes) if c else None)
        rec["calls"].append(dict(c.calls) if c else None)
        rec["by_dim"].append({self.dims_of.get(g, "other"): dict(ops) for g, ops in c.by_group.items()} if c else None)
        rec["fwd_bwd"].append(self.fwd_bwd if c else None)
        rec["ops"].append({"total": dict(c.ops), "fwd_bwd": self.fwd_bwd_ops or dict(c.ops)} if c else None)
        rec["kv"].append(kv.get("forward_bytes", 0) + kv.get("backward_bytes", 0))
        rec["a2a"].append(a2a["bytes"] if a2a is not None else None)
        rec["routing"].append(_routing(placed.module))
        if placed.pipeline is not None:
            placed.pipeline.timeline.finish()
            rec["peaks"].append(placed.pipeline.meter.peak)
        self.counter = None

    def after_update(self, local: float) -> None:
        """The model states this rank holds after the step (before the gradients are freed: at their fullest)."""
        if self.setup.engine is None:
            self.states = measured_model_states(self.setup.placed.model, self.setup.optimizer)
        self.rec["held"].append(self.states.total)
        self.rec["allocated"].append(instruments.allocated(self.device))
        self.rec["local"].append(local)

    def rank_figures(self, rank: int) -> RankFigures:
        rec, world, states = self.rec, self.setup.dims.world, self.states

        def per_step(f):
            return [f(b) if b is not None else None for b in rec["comm"]]

        out: RankFigures = {"rank": rank, "step_time_s": rec["times"], "step_timed_without_counter": rec["timed"],
               "allreduce_bytes_per_step": per_step(lambda b: b.get("allreduce", 0)),
               "allreduce_calls_per_step": [c.get("allreduce", 0) if c is not None else None for c in rec["calls"]],
               "comm_bytes_per_step": rec["comm"], "comm_calls_per_step": rec["calls"],
               "comm_volume_per_step": per_step(lambda b: ring_volume(b, world)),
               "comm_bytes_by_mesh_dim_per_step": rec["by_dim"], "fwd_bwd_comm_bytes_per_step": rec["fwd_bwd"],
               "operators_per_step": rec["ops"],
               "model_state_bytes": asdict(states) | {"total": states.total} if states else None,
               "model_state_bytes_per_step": rec["held"], "local_loss": rec["local"],
               "cuda_allocated_after_step": rec["allocated"],
               "peak_memory_bytes": instruments.peak_memory(self.device), "coords": self.setup.dims.coords,
               "predicted_model_state_bytes": predicted_model_states(self.setup)}
        if self.setup.dims.degrees.cp > 1:
            out["kv_bytes_per_step"] = rec["kv"]
        if any(a is not None for a in rec["a2a"]):
            out["all_to_all_bytes_per_step"] = rec["a2a"]
        if any(rec["routing"]):
            out["routing_per_step"] = rec["routing"]
        pipeline = self.setup.placed.pipeline
        if pipeline is not None:
            out.update(pipeline_rank_figures(pipeline, rec["peaks"]))
        return out

    def result_fields(self, ranks: list[RankFigures]) -> dict[str, Any]:
        return layout_fields(self.setup, ranks)
