"""Plan a run as practitioners do: a global batch fixed first, then every layout that fits, ranked.

A run cannot use an arbitrarily large batch: past the critical batch size more tokens per step stop
buying progress (McCandlish et al. 2018), so the global batch, in tokens, is an input. It bounds data
parallelism: ``dp x micro-batch`` sequences at least, and a pipeline needs ``pp`` micro-batches per
replica or more. Within that, :func:`plans` enumerates what the people who ran the largest jobs
chose among: TP inside a node x CP x PP (1F1B, the interleaved schedule with any number of chunks a
rank that the layers allow, ZB-V; stages even, or one layer fewer on the first and last as Llama 3
and torchtitan split them) x data parallelism (replicated, ZeRO-1 or -2, FSDP, HSDP sharded inside
a node; optimizer offload when nothing else is left) x EP for a mixture of experts x micro-batch
(the rest of the batch accumulated) x recomputation (none, selective, torchtitan's op-level, full).
:func:`search` keeps the layouts whose fullest pipeline rank fits
(:func:`labkit.planning.stage_memory.peak_rank`) and that the training loop accepts
(:func:`labkit.parallel.layout.checks.check_layout`), predicts each one's step
(:func:`labkit.planning.step_model.predict`), and ranks them; :func:`why` names the terms in which
the winner beats the runner-up.
"""
from __future__ import annotations

from dataclasses import dataclass

from labkit.memory.architecture import ModelShape
from labkit.memory.calculator import GB
from labkit.planning.commands import degrees, refused, train_args
from labkit.planning.hardware import Hardware
from labkit.planning.pipeline_model import chunk_layers
from labkit.planning.stage_memory import RankMemory, peak_rank
from labkit.planning.step_model import Plan, predict

TERMS = ("compute", "tensor_parallel", "context_parallel", "expert_parallel", "pipeline_p2p", "fsdp", "bubble",
         "data_parallel", "optimizer")
RECOMPUTE = ("none", "selective", "op", "full")  # in the order of what they cost
SAME = 1e-3  # steps within 0.1% of each other are the same prediction


@dataclass(frozen=True)
class Ranked:
    plan: Plan
    label: str
    prediction: dict  # step_model.predict's
    memory: RankMemory  # the fullest pipeline rank
    train_args: list

    @property
    def memory_bytes(self) -> int:
        return self.memory.total


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def label(plan: Plan) -> str:
    dims = [f"TP {plan.tp}"] if plan.tp > 1 else []
    if plan.pp > 1:
        sched = {"interleaved": f" interleaved x{plan.chunks}", "zbv": " ZB-V", "gpipe": " GPipe"}.get(plan.schedule, "")
        dims.append(f"PP {plan.pp}{sched}" + (", ends -1 layer" if plan.first_less else ""))
    if plan.cp > 1:
        dims.append(f"CP {plan.cp}")
    if plan.ep > 1:
        dims.append(f"EP {plan.ep}")
    if plan.zero == 3 and plan.replicas > 1:
        dims.append(f"HSDP {plan.replicas} x {plan.dp // plan.replicas}")
    elif plan.dp > 1 or not dims:
        dims.append({3: "FSDP ", 2: "ZeRO-2 ", 1: "ZeRO-1 "}.get(plan.zero, "DP ") + str(plan.dp))
    elif plan.zero == 3 and plan.cp > 1:
        dims.append("FSDP over CP")
    extra = [f"micro-batch {plan.micro_batch}"] + ([f"{plan.recompute} recompute"] if plan.recompute != "none" else [])
    return " x ".join(dims) + ("; offload" if plan.offload else "") + "; " + ", ".join(extra)


def _schedules(shape: ModelShape, pp: int, m: int) -> list[tuple[str, int, int]]:
    """(schedule, chunks per rank, layers fewer on the first and last chunk) a pipeline can run."""
    if pp == 1:
        return [("1f1b", 1, 0)]
    out = []
    for edge in (0, 1):
        units = shape.n_layer + 2 * edge
        out.append(("1f1b", 1, edge))
        rounds = max(1, m // pp)
        if m % rounds == 0:  # torch's interleaved schedule runs the micro-batches in whole rounds
            out += [("interleaved", v, edge) for v in sorted({2, 3, 4, 6, 8, 12, 16, units // pp}) if
                    v > 1 and pp * v <= units and _splits(shape, pp * v, edge)]
        if m >= 2 * pp - 1 and _splits(shape, 2 * pp, edge):
            out.append(("zbv", 2, edge))
    return out


def _splits(shape: ModelShape, chunks: int, edge: int) -> bool:
    try:
        chunk_layers(shape.n_layer, chunks, edge, edge)
        return True
    except ValueError:
        return False


def _data_layouts(shape: ModelShape, tp: int, pp: int, cp: int, dp: int, devices_per_node: int) -> list[tuple]:
    """(ZeRO stage, HSDP replicas, EP degree, offload) of ``dp`` data-parallel ranks: DDP; ZeRO-1 and -2
    (DeepSpeed, which labkit runs on plain data parallelism only); FSDP, and ZeRO-3 with its optimizer
    offloaded; HSDP sharded inside a node and replicated across nodes; and for a mixture of experts,
    EP degrees that divide the experts and the shard group."""
    plain = tp * pp * cp == 1
    if dp * cp == 1:  # one copy of the model: nothing to replicate or shard
        return [(0, 1, 1, False)]
    out = [(z, 1, 1, False) for z in ((0, 1, 2, 3) if plain else (0, 3)) if cp == 1 or z == 3]
    if plain and dp > 1:
        out.append((3, 1, 1, True))
    in_node = max(1, devices_per_node // (tp * cp))  # FSDP ranks one node holds
    hsdp = dp // in_node if dp % in_node == 0 and dp > in_node and in_node > 1 else 1
    eps = [e for e in range(2, shape.experts + 1) if shape.experts % e == 0] if shape.experts > 1 else []
    for r in dict.fromkeys((1, hsdp)):
        out += [(3, r, 1, False)] if r > 1 else []
        out += [(3, r, e, False) for e in eps if (dp // r) % e == 0]
    return out


def plans(shape: ModelShape, n_devices: int, global_batch: int, devices_per_node: int = 8) -> list[Plan]:
    """Every layout of ``n_devices`` for ``global_batch`` sequences a step, before memory is checked."""
    out = []
    tps = [t for t in _divisors(devices_per_node) if shape.heads % t == 0 and shape.n_kv_heads % t == 0]
    cps = [c for c in (1, 2, 4, 8, 16) if shape.seq_len % (2 * c) == 0 and shape.seq_len // c >= 2048 or c == 1]
    for tp in tps:
        for cp in (c for c in cps if n_devices % (tp * c) == 0):
            for pp in (p for p in _divisors(n_devices // (tp * cp)) if p <= shape.n_layer):
                dp = n_devices // (tp * cp * pp)
                if global_batch % dp:
                    continue
                for mb in (b for b in (1, 2, 4, 8) if (global_batch // dp) % b == 0):
                    m = global_batch // (dp * mb)
                    if pp > 1 and m < pp:
                        continue
                    for sched, v, edge in _schedules(shape, pp, m):
                        for zero, replicas, ep, offload in _data_layouts(shape, tp, pp, cp, dp, devices_per_node):
                            out += [Plan(tp=tp, pp=pp, cp=cp, dp=dp, micro_batch=mb, global_batch=global_batch,
                                         zero=zero, recompute=rec, schedule=sched, chunks=v, first_less=edge,
                                         last_less=edge, replicas=replicas, ep=ep, offload=offload,
                                         sequence_parallel=tp > 1 and ep == 1) for rec in RECOMPUTE]
    return out


def search(shape: ModelShape, hw: Hardware, n_devices: int, global_batch_tokens: int, memory_gb: float,
           headroom: float = 0.1) -> list[Ranked]:
    """The layouts that fit and run, fastest first (see the module docstring). ``headroom``: the share
    of device memory kept for temporaries, communication buffers and the allocator's fragmentation."""
    if global_batch_tokens % shape.seq_len:
        raise ValueError(f"global_batch_tokens={global_batch_tokens} must be whole sequences of {shape.seq_len}")
    usable = memory_gb * GB * (1 - headroom)
    ranked = []
    for plan in plans(shape, n_devices, global_batch_tokens // shape.seq_len, hw.devices_per_node):
        top = peak_rank(shape, plan)
        if top.total > usable or refused(plan, shape):
            continue
        ranked.append(Ranked(plan, label(plan), predict(shape, plan, hw), top, train_args(plan, shape)))
    if not ranked:
        return ranked
    best = min(r.prediction["total"] for r in ranked)
    # within 0.1% the model cannot tell two steps apart: the simpler layout goes first
    return sorted(ranked, key=lambda r: (round(r.prediction["total"] / best / SAME), _simplicity(r.plan)))


def _simplicity(plan: Plan) -> tuple:
    """What a layout adds: recomputation, dimensions, sharding, micro-batches; less first."""
    dims = sum(d > 1 for d in (plan.tp, plan.pp, plan.cp, plan.ep, plan.replicas))
    return RECOMPUTE.index(plan.recompute), dims, plan.offload, plan.zero, plan.microbatches, plan.v


def why(first: Ranked, second: Ranked) -> str | None:
    """The terms of the step in which ``first`` beats ``second``, largest first; None when their
    predicted steps are the same (within 0.1%)."""
    step = first.prediction["total"]
    if second.prediction["total"] - step <= SAME * step:
        return None
    diffs = sorted(((second.prediction[t] - first.prediction[t], t) for t in TERMS), reverse=True)
    unit, scale = ("ms", 1e3) if step > 0.1 else ("us", 1e6)
    gains = [f"{t.replace('_', ' ')} {d * scale:,.0f} {unit} less" for d, t in diffs if d > SAME * step][:3]
    losses = [f"{t.replace('_', ' ')} {-d * scale:,.0f} {unit} more" for d, t in diffs if d < -SAME * step][:2]
    return "; ".join(gains + losses)


__all__ = ["Ranked", "degrees", "label", "plans", "search", "train_args", "why"]
