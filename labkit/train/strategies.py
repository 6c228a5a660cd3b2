"""Every parallel strategy, said once: one record each, asked by everything that needs to know.

A :class:`Strategy` says what the strategy splits over the ranks, which ZeRO stage its memory
follows (:mod:`labkit.memory`), how many bytes each rank sends per step in the ZeRO paper's unit,
which options it takes, what it cannot do, and which plan (:mod:`labkit.train.plans`,
:mod:`labkit.train.model_parallel_plans`) places the model and runs its step in the one loop.
A later chapter adds a strategy by adding a record and a plan.
"""
from __future__ import annotations

from dataclasses import dataclass, fields
from typing import TYPE_CHECKING

from labkit.core.checks import one_of
from labkit.train.cp_plan import ContextParallelPlan
from labkit.train.deepspeed_plan import DeepSpeedPlan
from labkit.train.ep_plan import ExpertParallelPlan, MoEPlan
from labkit.train.hsdp_plan import HSDPPlan
from labkit.train.model_parallel_plans import PipelinePlan, TensorParallelPlan
from labkit.train.plans import (
    BucketedPlan,
    DDPPlan,
    FSDPPlan,
    NaivePlan,
    Plan,
    ZeroScratchPlan,
)

if TYPE_CHECKING:
    from labkit.train.config import TrainConfig

ALL_PRECISIONS = ("fp32", "bf16", "fp16")


@dataclass(frozen=True)
class Strategy:
    name: str
    summary: str  # one line: what it is and where it comes from
    shards: str  # what is split over the ranks (the rest is replicated)
    zero_stage: int  # the ZeRO stage its model-state memory follows (labkit.memory.model_state_breakdown)
    # Bytes each rank sends per step in units of Psi (N-1)/N, Psi the gradient bytes, under ring
    # collectives (Rajbhandari et al. 2020, section 7); None where the traffic is activations, not Psi.
    comm_volume: float | None
    plan: type[Plan]  # places the model and runs a step of the loop (labkit.train.plans)
    options: tuple[str, ...] = ()  # the strategy-specific TrainConfig fields it takes
    cannot_checkpoint: str | None = None  # why it cannot save and resume (None: it can)
    precisions: tuple[str, ...] = ALL_PRECISIONS
    grad_accum: bool = True  # takes grad_accum > 1
    deepspeed: bool = False  # DeepSpeed wraps the model and owns backward and step
    teaching: bool = False  # written from scratch to teach; a test holds it against the library's version
    needs_group: bool = False  # collectives even on one rank: runs in a process group (a one-rank one is fine)
    # Its checkpoints load into other strategies and world sizes (False: only as they were saved)
    reshardable: bool = True
    moe: bool = False  # trains a mixture-of-experts model (moe_experts > 0) as one process would


_SYNC = "sync_each_microbatch"
_DS = "the same run on DeepSpeed (deepspeed.initialize with the client AdamW)"
STRATEGIES: dict[str, Strategy] = {s.name: s for s in (
    Strategy("single", "one process, no wrapper: the reference every parallel run is held against",
             "nothing", 0, 0.0, MoEPlan, moe=True),
    Strategy("ddp", "torch DistributedDataParallel: bucketed all-reduce of gradients under backward",
             "nothing (the batch)", 0, 2.0, DDPPlan, options=("bucket_cap_mb", _SYNC, "link_gbps", "link_latency_ms")),
    Strategy("dp_naive", "data parallel by hand: one all-reduce per gradient after backward",
             "nothing (the batch)", 0, 2.0, NaivePlan, options=(_SYNC,), teaching=True),
    Strategy("dp_bucketed", "data parallel by hand: DDP's buckets, launched as soon as they are full",
             "nothing (the batch)", 0, 2.0, BucketedPlan, options=("bucket_cap_mb", _SYNC), teaching=True),
    Strategy("fsdp", "FSDP2 fully_shard per block, then the root: ZeRO-3 in PyTorch",
             "parameters, gradients, optimizer states", 3, 3.0, FSDPPlan,
             options=("reshard_after_forward", "cpu_offload", "fsdp_bf16", _SYNC), needs_group=True),
    # Per step: 3 Psi (S-1)/S inside each shard group of S = world/replicas ranks, plus an all-reduce
    # of each rank's Psi/S gradient shard across the replicas (HSDPPlan.comm_formula): two numbers.
    Strategy("hsdp", "hybrid sharding, FSDP2 on a 2-D mesh: shard within a group (a node), replicate across",
             "parameters, gradients, optimizer states (within a shard group)", 3, None, HSDPPlan,
             options=("replicas", "reshard_after_forward", _SYNC), needs_group=True),
    Strategy("zero1", f"DeepSpeed ZeRO stage 1: {_DS}", "optimizer states", 1, 2.0, DeepSpeedPlan,
             options=("offload_optimizer",), deepspeed=True, needs_group=True,
             reshardable=False),
    Strategy("zero2", f"DeepSpeed ZeRO stage 2: {_DS}", "optimizer states, gradients", 2, 2.0, DeepSpeedPlan,
             options=("offload_optimizer",), deepspeed=True, needs_group=True,
             reshardable=False),
    Strategy("zero3", f"DeepSpeed ZeRO stage 3: {_DS}", "parameters, gradients, optimizer states", 3, 3.0,
             DeepSpeedPlan, options=("offload_optimizer",), deepspeed=True, needs_group=True,
             reshardable=False),
    Strategy("zero1_scratch", "ZeRO-1 by hand: reduce-scatter, Adam on this rank's slice, all-gather",
             "optimizer states", 1, 2.0, ZeroScratchPlan, teaching=True,
             cannot_checkpoint="its sharded optimizer has no state_dict to save; use 'zero1' (DeepSpeed) or 'fsdp'"),
    Strategy("tp", "tensor parallel with DTensor (Megatron-LM's split); world/tp ranks of FSDP2 over it",
             "every weight matrix of a block (and, with dp > 1, all of it over dp)", 0, None, TensorParallelPlan,
             options=("tp", "sequence_parallel"), reshardable=False),
    Strategy("tp_scratch", "tensor parallel by hand: column/row-parallel layers with Megatron's f and g",
             "every weight matrix of a block", 0, None, TensorParallelPlan, options=("tp",), teaching=True,
             cannot_checkpoint="its shards are plain tensors, which DCP would take for replicas; use 'tp'"),
    Strategy("cp", "context parallel: each sequence split over cp ranks (zig-zag), ring attention between them; "
             "the world/cp groups data parallel", "the sequence (activations); parameters replicated", 0, None,
             ContextParallelPlan, options=("cp", "bucket_cap_mb"), precisions=("fp32",), grad_accum=True,
             needs_group=True),
    Strategy("ep", "expert parallel: a mixture-of-experts model's experts split over ep ranks, tokens sent to "
             "them by all-to-all; the world/ep groups data parallel", "the experts of every MoE block", 0, None,
             ExpertParallelPlan, options=("ep",), precisions=("fp32",), needs_group=True, moe=True,
             cannot_checkpoint="its experts live on different ranks as plain tensors, which DCP would take for "
                               "replicas; train with strategy 'single' to checkpoint an MoE model"),
    Strategy("pp", "pipeline parallel with torch.distributed.pipelining: GPipe, 1F1B or interleaved 1F1B",
             "the layers (one stage per rank)", 0, None, PipelinePlan,
             options=("pp", "microbatches", "pp_schedule"), grad_accum=False, needs_group=True, reshardable=False),
    Strategy("pp_scratch", "pipeline parallel by hand: GPipe and 1F1B with paired send/recv",
             "the layers (one stage per rank)", 0, None, PipelinePlan,
             options=("pp", "microbatches", "pp_schedule"), grad_accum=False, teaching=True, reshardable=False),
)}
# Options some strategies take and the others refuse: every strategy-specific TrainConfig field.
OPTIONS = tuple(sorted({o for s in STRATEGIES.values() for o in s.options}))


def strategy(name: str) -> Strategy:
    """The record of strategy ``name``; a ValueError listing them otherwise."""
    return STRATEGIES[one_of("strategy", name, STRATEGIES, "strategies")]


def takes(option: str) -> list[str]:
    """The strategies that take ``option``."""
    return [s.name for s in STRATEGIES.values() if option in s.options]


def check_config(cfg: TrainConfig) -> None:
    """What no run of this strategy can do, refused before anything starts (``TrainConfig`` calls it)."""
    s = strategy(cfg.strategy)
    default = {f.name: f.default for f in fields(cfg)}
    for option in OPTIONS:
        if getattr(cfg, option) != default[option] and option not in s.options:
            raise ValueError(f"{option}={getattr(cfg, option)!r} has no effect with strategy={s.name!r}; it "
                             f"applies to strategy {' / '.join(map(repr, takes(option)))}")
    if cfg.precision not in s.precisions:
        raise ValueError(f"precision={cfg.precision!r} is not supported with strategy={s.name!r}; "
                         f"valid precisions: {list(s.precisions)}")
    if cfg.grad_accum > 1 and not s.grad_accum:
        raise ValueError(f"grad_accum={cfg.grad_accum} is not used with strategy={s.name!r}: its microbatches "
                         "are the accumulation; set grad_accum=1 and microbatches instead")
    if cfg.checkpoint_dir and s.cannot_checkpoint:
        raise ValueError(f"checkpoint_dir is not supported with strategy={s.name!r}: {s.cannot_checkpoint}")
    s.plan.check_config(cfg, s)
