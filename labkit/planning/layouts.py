"""Placing a model on DP x TP x PP devices: every layout, its memory per device, its bubble and step.

Narayanan et al. 2021 ("Efficient Large-Scale Language Model Training on GPU Clusters Using
Megatron-LM", section 3) reason about the three degrees together: tensor parallelism inside a node,
pipeline stages across nodes, data parallelism over what is left. :func:`layouts` lists every such
split of ``n_devices`` with its fullest pipeline rank's bytes (:mod:`labkit.planning.stage_memory`),
the 1F1B bubble and the predicted step (:mod:`labkit.planning.step_model`); :func:`choose_layout`
picks the fastest that fits, as the planner would among these layouts.
"""
from __future__ import annotations

from dataclasses import dataclass

from labkit.comm.ring import ring_bytes_per_rank
from labkit.core.model import GPTConfig
from labkit.memory.calculator import GB, ModelShape, model_shape
from labkit.parallel.pipeline.timeline import bubble_formula
from labkit.parallel.tensor_parallel import comm_bytes_per_layer
from labkit.planning import collectives as C
from labkit.planning.hardware import hardware
from labkit.planning.stage_memory import RankMemory, peak_rank
from labkit.planning.step_model import Plan, layer_compute, predict


@dataclass(frozen=True)
class Layout:
    """One way to place a model on ``tp x pp x dp`` devices: its fullest rank's memory, pipeline
    bubble and predicted step."""

    tp: int
    pp: int
    dp: int
    microbatches: int  # per pipeline per step: global batch / (dp x micro batch)
    bubble: float  # (p - 1) / (m + p - 1) of every step
    estimate: RankMemory  # the fullest pipeline rank
    usable_bytes: int
    step_s: float  # predicted (labkit.planning.step_model)

    @property
    def fits(self) -> bool:
        return self.estimate.total <= self.usable_bytes


def layouts(model: str | float | GPTConfig | ModelShape, n_devices: int, global_batch: int,
            micro_batch: int = 1, devices_per_node: int = 8, device_memory_gb: float = 80.0, stage: int = 1,
            recompute: str = "full", headroom: float = 0.1, device: str = "a100-80gb") -> list[Layout]:
    """Every DP x TP x PP layout of ``n_devices`` (Narayanan et al. 2021, section 3) with its fullest
    rank's bytes and predicted step on ``device``: tensor parallel within a node (sequence parallel
    on), 1F1B pipelines, ZeRO ``stage`` over the data-parallel ranks (Megatron's distributed
    optimizer is 1). The global batch bounds data parallelism: each of the ``dp`` pipelines needs
    whole micro-batches."""
    shape = model_shape(model)
    if global_batch % micro_batch:
        raise ValueError(f"micro_batch={micro_batch} must divide global_batch={global_batch}")
    hw = hardware(device)
    out = []
    for tp in (t for t in range(1, devices_per_node + 1) if devices_per_node % t == 0 and shape.heads % t == 0):
        for pp in (p for p in range(1, shape.n_layer + 1) if n_devices % (tp * p) == 0):
            dp = n_devices // (tp * pp)
            if global_batch % (dp * micro_batch) or global_batch // (dp * micro_batch) < pp:
                continue
            m = global_batch // (dp * micro_batch)
            plan = Plan(tp=tp, pp=pp, dp=dp, micro_batch=micro_batch, global_batch=global_batch, zero=stage,
                        recompute=recompute, sequence_parallel=tp > 1)
            out.append(Layout(tp, pp, dp, m, bubble_formula(pp, m), peak_rank(shape, plan),
                              int(device_memory_gb * GB * (1 - headroom)), predict(shape, plan, hw)["total"]))
    return out


def choose_layout(options: list[Layout]) -> Layout | None:
    """The layout that fits with the shortest predicted step; ties go to less tensor parallelism,
    then fewer stages. None when nothing fits."""
    fitting = [o for o in options if o.fits]
    return min(fitting, key=lambda o: (round(o.step_s, 6), o.tp, o.pp)) if fitting else None


def tensor_parallel_link_times(model: str | float | GPTConfig | ModelShape, tp: int, micro_batch: int,
                               device: str) -> list[dict]:
    """Why tensor parallelism stays inside a node, by the step model: per layer and rank, the time of
    TP's four collectives of ``b x s x h`` bf16 activations (Shoeybi et al. 2019, section 3; not
    overlapped) against the time of the layer's compute (:func:`labkit.planning.step_model.layer_compute`),
    for ``tp`` ranks inside a node (NVLink), ``tp`` ranks one a node (each rank's own NIC), and
    ``2 tp`` ranks over two rail-optimised nodes (a ring at the NICs' combined rate)."""
    shape = model_shape(model)
    hw = hardware(device)
    payload = comm_bytes_per_layer(micro_batch, shape.seq_len, shape.hidden, dtype_bytes=2) / 4  # one collective
    rows = []
    for label, t, stride in ((f"TP {tp} inside a node (NVLink)", tp, 1),
                             (f"TP {tp}, one rank a node (its NIC)", tp, hw.devices_per_node),
                             (f"TP {2 * tp} over two nodes (rail-optimised)", 2 * tp, 1)):
        group = C.group(t, stride, hw.devices_per_node)
        comm = 4 * C.all_reduce(hw, group, payload)
        lay = layer_compute(shape, Plan(tp=t, micro_batch=micro_batch, global_batch=micro_batch), hw)
        compute = lay["forward"] + lay["backward"]
        rows.append(dict(link=label, tp=t, comm_ms=comm * 1e3, compute_ms=compute * 1e3, ratio=comm / compute,
                         bytes_per_rank=4 * ring_bytes_per_rank(payload, t)))
    return rows
