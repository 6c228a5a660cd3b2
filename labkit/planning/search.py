"""Plan a run as practitioners do: a global batch fixed first, then every layout that fits, ranked.

A run cannot use an arbitrarily large batch: past the critical batch size more tokens per step stop
buying progress (McCandlish et al. 2018), so the global batch, in tokens, is an input. It bounds data
parallelism: ``dp x micro-batch`` sequences at least, and a pipeline needs ``pp`` micro-batches per
replica or more (fewer micro-batches per rank than the batch needs are gradient accumulation).
Within that, :func:`search` enumerates DP (replicated, ZeRO-1/2, sharded with FSDP, or HSDP: sharded
in a node, replicated across) x EP (for a mixture of experts) x TP (inside a node) x PP x CP x
micro-batch x recomputation, keeps the layouts whose memory per device
fits (:func:`labkit.memory.calculator.estimate_memory`) and that the training loop accepts
(:func:`labkit.parallel.checks.check_layout`), predicts each one's step
(:func:`labkit.planning.step_model.predict`), and ranks them by predicted time. :func:`why` names
the terms in which the winner beats the runner-up.
"""
from __future__ import annotations

from dataclasses import dataclass

from labkit.memory.architecture import ModelShape
from labkit.memory.calculator import GB, estimate_memory
from labkit.parallel.checks import check_layout
from labkit.parallel.mesh import Degrees
from labkit.planning.candidates import model_config
from labkit.planning.hardware import Hardware
from labkit.planning.step_model import Plan, predict

TERMS = ("compute", "tensor_parallel", "context_parallel", "expert_parallel", "pipeline_p2p", "fsdp", "bubble", "data_parallel",
         "optimizer")


@dataclass(frozen=True)
class Ranked:
    plan: Plan
    label: str
    prediction: dict  # step_model.predict's
    memory_bytes: int
    train_args: list


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def label(plan: Plan) -> str:
    dims = [f"TP {plan.tp}"] if plan.tp > 1 else []
    if plan.pp > 1:
        dims.append(f"PP {plan.pp}" + (" interleaved" if plan.schedule == "interleaved" else ""))
    if plan.cp > 1:
        dims.append(f"CP {plan.cp}")
    if plan.ep > 1:
        dims.append(f"EP {plan.ep}")
    if plan.zero == 3 and plan.replicas > 1:
        dims.append(f"HSDP {plan.replicas} x {plan.dp // plan.replicas}")
    else:
        dims.append({3: "FSDP ", 2: "ZeRO-2 ", 1: "ZeRO-1 "}.get(plan.zero, "DP ") + str(plan.dp))
    extra = [f"micro-batch {plan.micro_batch}"] + ([f"{plan.recompute} recompute"] if plan.recompute != "none" else [])
    return " x ".join(dims) + "; " + ", ".join(extra)


def train_args(plan: Plan, seq_len: int) -> list[str]:
    """The ``python -m labkit.train`` flags that run ``plan`` (labkit's mesh strategy, or plain DP)."""
    composed = plan.tp * plan.pp * plan.cp * plan.ep * plan.replicas > 1
    if not composed:
        args = ["--strategy", {3: "fsdp", 2: "zero2", 1: "zero1"}.get(plan.zero, "ddp")]
    else:
        d = degrees(plan)
        args = ["--strategy", "mesh"] + [x for dim in ("pp", "dp_replicate", "dp_shard", "ep", "cp", "tp")
                                          if getattr(d, dim) > 1 or dim == "dp_shard"
                                          for x in ("--" + dim.replace("_", "-"), str(getattr(d, dim)))]
        if plan.tp > 1:
            args.append("--sequence-parallel")
    args += ["--batch-size", str(plan.global_batch), "--block-size", str(seq_len)]
    if plan.pp > 1:
        args += ["--microbatches", str(plan.microbatches), "--pp-schedule", plan.schedule]
    elif plan.microbatches > 1:
        args += ["--grad-accum", str(plan.microbatches)]
    if plan.recompute != "none":
        args += ["--activation-checkpointing", plan.recompute]
    return args


def degrees(plan: Plan) -> Degrees:
    if plan.zero == 3:  # labkit's EP ranks are data ranks: dp = replicas x dp_shard x ep
        data = {"dp_replicate": plan.replicas, "dp_shard": plan.dp // (plan.replicas * plan.ep), "ep": plan.ep}
    else:
        data = {"dp_replicate": plan.dp}
    return Degrees(pp=plan.pp, cp=plan.cp, tp=plan.tp, **data)


def _refused(plan: Plan, shape: ModelShape) -> str | None:
    if plan.zero != 3 and plan.cp > 1:
        return "context-parallel ranks shard the weights with FSDP"
    try:
        check_layout(degrees(plan), model_config(shape, shape.seq_len), plan.global_batch // plan.dp,
                     plan.microbatches if plan.pp > 1 else None, plan.schedule, "torch", plan.tp > 1,
                     plan.recompute)
    except ValueError as e:
        return str(e)
    return None


def plans(shape: ModelShape, n_devices: int, global_batch: int, devices_per_node: int = 8) -> list[Plan]:
    """Every layout of ``n_devices`` for ``global_batch`` sequences a step, before memory is checked."""
    out = []
    tps = [t for t in _divisors(devices_per_node) if shape.heads % t == 0 and shape.n_kv_heads % t == 0]
    cps = [c for c in (1, 2, 4, 8, 16) if shape.seq_len % (2 * c) == 0 and (c == 1 or shape.seq_len >= 16384)]
    for tp in tps:
        for cp in cps:
            if n_devices % (tp * cp):
                continue
            for pp in (p for p in _divisors(n_devices // (tp * cp)) if p <= shape.n_layer):
                dp = n_devices // (tp * cp * pp)
                if global_batch % dp:
                    continue
                for mb in (b for b in (1, 2, 4, 8) if (global_batch // dp) % b == 0):
                    m = global_batch // (dp * mb)
                    if pp > 1 and m < pp:
                        continue
                    schedules = [("1f1b", 1)] + ([("interleaved", 2)] if pp > 1 and shape.n_layer % (2 * pp) == 0
                                                 else [])
                    for sched, v in schedules:
                        for zero, replicas, ep in _data_layouts(shape, tp, pp, cp, dp, devices_per_node):
                            for rec in ("none", "full"):  # selective: nothing under FlashAttention
                                out.append(Plan(tp=tp, pp=pp, cp=cp, dp=dp, micro_batch=mb,
                                                global_batch=global_batch, zero=zero, recompute=rec,
                                                schedule=sched, chunks=v, replicas=replicas, ep=ep))
    return out


def _data_layouts(shape: ModelShape, tp: int, pp: int, cp: int, dp: int, devices_per_node: int) -> list[tuple]:
    """(ZeRO stage, HSDP replicas, EP degree) of ``dp`` data-parallel ranks: DDP; ZeRO-1 and -2 (DeepSpeed,
    which labkit runs on plain data parallelism only); FSDP; HSDP sharded inside a node and replicated
    across nodes; and for a mixture of experts, EP degrees that divide the experts and the shard group."""
    plain = tp * pp * cp == 1
    out = [(z, 1, 1) for z in ((0, 1, 2, 3) if plain else (0, 3)) if cp == 1 or z == 3]
    in_node = max(1, devices_per_node // (tp * cp))  # FSDP ranks one node holds
    replicas = [1] + ([dp // in_node] if dp % in_node == 0 and dp > in_node else [])
    eps = [e for e in range(2, shape.experts + 1) if shape.experts % e == 0] if shape.experts > 1 else []
    for r in replicas:
        out += [(3, r, 1)] if r > 1 else []
        out += [(3, r, e) for e in eps if (dp // r) % e == 0]
    return out


def search(shape: ModelShape, hw: Hardware, n_devices: int, global_batch_tokens: int, memory_gb: float,
           headroom: float = 0.1) -> list[Ranked]:
    """The layouts that fit and run, fastest first (see the module docstring)."""
    if global_batch_tokens % shape.seq_len:
        raise ValueError(f"global_batch_tokens={global_batch_tokens} must be whole sequences of {shape.seq_len}")
    usable = memory_gb * GB * (1 - headroom)
    ranked = []
    for plan in plans(shape, n_devices, global_batch_tokens // shape.seq_len, hw.devices_per_node):
        # HSDP's states are sharded over one replica's ranks
        est = estimate_memory(shape, plan.micro_batch, n_devices // plan.replicas, plan.zero, "mixed", plan.recompute,
                              plan.tp, sequence_parallel=plan.tp > 1, device_memory_gb=memory_gb, pp=plan.pp,
                              cp=plan.cp, ep=plan.ep)
        if est.total > usable or _refused(plan, shape):
            continue
        ranked.append(Ranked(plan, label(plan), predict(shape, plan, hw), est.total, train_args(plan, shape.seq_len)))
    return sorted(ranked, key=lambda r: r.prediction["total"])


def why(first: Ranked, second: Ranked) -> str:
    """The terms of the step in which ``first`` beats ``second``, largest first."""
    diffs = sorted(((second.prediction[t] - first.prediction[t], t) for t in TERMS), reverse=True)
    gains = [f"{t.replace('_', ' ')} {d * 1e3:,.0f} ms less" for d, t in diffs if d > 1e-4][:3]
    losses = [f"{t.replace('_', ' ')} {-d * 1e3:,.0f} ms more" for d, t in diffs if d < -1e-4][:2]
    return "; ".join(gains + losses) or "the same predicted step"
