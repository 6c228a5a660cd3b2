"""Every parallel strategy, said once: one record each, asked by everything that needs to know.

A :class:`Strategy` says what the strategy splits over the ranks, which ZeRO stage its memory
follows (:mod:`labkit.memory`), how many bytes each rank sends per step in the ZeRO paper's unit,
which options it takes, what it cannot do, and, as data, how it lays the model on the device mesh:
its degrees and which implementation each step of the placement uses. :func:`expand` turns the name
and a config's flags into the run's one :class:`~labkit.parallel.layout.parallelism.Parallelism`,
which is all that placement (:mod:`labkit.parallel.compose`) reads. The named strategies are
presets of degrees; ``mesh`` takes any degrees. Records are data: they import
nothing of the config or the plans (:mod:`labkit.train.config` checks a config against them).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from labkit.core.checks import one_of
from labkit.parallel.layout.mesh import DIMS
from labkit.parallel.layout.parallelism import Parallelism

ALL_PRECISIONS = ("fp32", "bf16", "fp16")
# FP8 emulated (labkit.device.fp8): where the linears are plain modules or FSDP2 gathers them whole
WITH_FP8 = (*ALL_PRECISIONS, "fp8", "fp8-block")


@dataclass(frozen=True)
class Strategy:
    name: str
    summary: str  # one line: what it is and where it comes from
    shards: str  # what is split over the ranks (the rest is replicated)
    zero_stage: int  # the ZeRO stage its model-state memory follows (labkit.memory.model_state_breakdown)
    # Bytes each rank sends per step in units of Psi (N-1)/N, Psi the gradient bytes, under ring
    # collectives (Rajbhandari et al. 2020, section 7); None where the traffic is activations, not Psi.
    comm_volume: float | None
    # The layout: (mesh dimension, TrainConfig field giving its degree) pairs, and the dimension that
    # takes the ranks the others leave. A degree the run leaves unset is ``unset``: -1 (the ranks left)
    # for a preset named after its dimension, so ``--strategy tp`` is ``--tp -1``; 1 for ``mesh``.
    degrees: tuple[tuple[str, str], ...] = ()
    rest: str = "dp_replicate"
    unset: int = -1
    dp_impl: str = "fsdp"  # how the token ranks share gradients: fsdp (FSDP2/HSDP), ddp, naive, bucketed, none
    tp_impl: str = "dtensor"  # or "scratch": the hand-written column- and row-parallel layers
    pp_impl: str | None = None  # "torch" or "scratch": runs the pipeline schedule (even on one stage)
    optimizer: str = "adamw"  # or "zero1_scratch": the hand-written ZeRO-1 AdamW
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
    one_process: bool = False  # the reference: exactly one rank
    least: tuple[tuple[str, int], ...] = ()  # (field, smallest value): what the name means takes at least that


_SYNC = "sync_each_microbatch"
_FSDP = ("reshard_after_forward", "cpu_offload", "fsdp_bf16", _SYNC)
_SPLIT = ("pp_stages_per_rank", "pp_first_stage_less_layers", "pp_last_stage_less_layers")
_PP = ("pp", "microbatches", "pp_schedule")
_DS = "the same run on DeepSpeed (deepspeed.initialize with the client AdamW)"
_MESH_DEGREES = tuple((d, d) for d in DIMS)
STRATEGIES: dict[str, Strategy] = {s.name: s for s in (
    Strategy("single", "one process, no wrapper: the reference every parallel run is held against",
             "nothing", 0, 0.0, moe=True, one_process=True, precisions=WITH_FP8),
    Strategy("ddp", "torch DistributedDataParallel: bucketed all-reduce of gradients under backward",
             "nothing (the batch)", 0, 2.0, dp_impl="ddp", precisions=WITH_FP8,
             options=("bucket_cap_mb", _SYNC, "link_gbps", "link_latency_ms")),
    Strategy("dp_naive", "data parallel by hand: one all-reduce per gradient after backward",
             "nothing (the batch)", 0, 2.0, dp_impl="naive", options=(_SYNC,), teaching=True),
    Strategy("dp_bucketed", "data parallel by hand: DDP's buckets, launched as soon as they are full",
             "nothing (the batch)", 0, 2.0, dp_impl="bucketed", options=("bucket_cap_mb", _SYNC), teaching=True),
    Strategy("fsdp", "FSDP2 fully_shard per block, then the root: ZeRO-3 in PyTorch",
             "parameters, gradients, optimizer states", 3, 3.0, rest="dp_shard", options=_FSDP, needs_group=True,
             precisions=WITH_FP8),
    # Per step: 3 Psi (S-1)/S inside each shard group of S = world/replicas ranks, plus an all-reduce
    # of each rank's Psi/S gradient shard across the replicas (labkit.parallel.fsdp.hsdp_formula).
    Strategy("hsdp", "hybrid sharding, FSDP2 on a 2-D mesh: shard within a group (a node), replicate across",
             "parameters, gradients, optimizer states (within a shard group)", 3, None,
             degrees=(("dp_replicate", "dp_replicate"),), rest="dp_shard", unset=1,
             options=("dp_replicate", "reshard_after_forward", _SYNC), needs_group=True,
             least=(("dp_replicate", 2),)),  # one replica is plain FSDP
    Strategy("zero1", f"DeepSpeed ZeRO stage 1: {_DS}", "optimizer states", 1, 2.0, dp_impl="none",
             options=("offload_optimizer",), deepspeed=True, needs_group=True, reshardable=False),
    Strategy("zero2", f"DeepSpeed ZeRO stage 2: {_DS}", "optimizer states, gradients", 2, 2.0, dp_impl="none",
             options=("offload_optimizer",), deepspeed=True, needs_group=True, reshardable=False),
    Strategy("zero3", f"DeepSpeed ZeRO stage 3: {_DS}", "parameters, gradients, optimizer states", 3, 3.0,
             rest="dp_shard", dp_impl="none", options=("offload_optimizer",), deepspeed=True, needs_group=True,
             reshardable=False),
    Strategy("zero1_scratch", "ZeRO-1 by hand: reduce-scatter, Adam on this rank's slice, all-gather",
             "optimizer states", 1, 2.0, dp_impl="none", optimizer="zero1_scratch", teaching=True,
             cannot_checkpoint="its sharded optimizer has no state_dict to save; use 'zero1' (DeepSpeed) or 'fsdp'"),
    Strategy("tp", "tensor parallel with DTensor (Megatron-LM's split); world/tp ranks of FSDP2 over it",
             "every weight matrix of a block (and, with dp > 1, all of it over dp)", 0, None,
             degrees=(("tp", "tp"),), rest="dp_shard", options=("tp", "sequence_parallel")),
    Strategy("tp_scratch", "tensor parallel by hand: column/row-parallel layers with Megatron's f and g",
             "every weight matrix of a block", 0, None, degrees=(("tp", "tp"),), rest="dp_shard",
             tp_impl="scratch", options=("tp",), teaching=True,
             cannot_checkpoint="its shards are plain tensors, which DCP would take for replicas; use 'tp'"),
    Strategy("cp", "context parallel: each sequence split over cp ranks (zig-zag), ring attention between them; "
             "the world/cp groups data parallel", "the sequence (activations); parameters replicated", 0, None,
             degrees=(("cp", "cp"),), dp_impl="ddp", options=("cp", "bucket_cap_mb"), needs_group=True),
    Strategy("ep", "expert parallel: a mixture-of-experts model's experts split over ep ranks, tokens sent to "
             "them by all-to-all; the world/ep groups data parallel (--dp-shard ep --ep ep, the rest replicas)", "the experts of every MoE block", 0, None,
             degrees=(("ep", "ep"),), options=("ep",), needs_group=True, moe=True),
    Strategy("pp", "pipeline parallel with torch.distributed.pipelining: GPipe, 1F1B or interleaved 1F1B",
             "the layers (one stage per rank)", 0, None, degrees=(("pp", "pp"),), rest="dp_shard", pp_impl="torch",
             options=_PP + _SPLIT, grad_accum=False, needs_group=True),
    Strategy("pp_scratch", "pipeline parallel by hand: GPipe and 1F1B with paired send/recv",
             "the layers (one stage per rank)", 0, None, degrees=(("pp", "pp"),), rest="dp_shard",
             pp_impl="scratch", options=_PP, grad_accum=False, teaching=True),
    Strategy("mesh", "any layout on one device mesh: --dp-replicate, --dp-shard (FSDP2; unset or -1: the ranks left), --tp, "
             "--pp, --cp, --ep, composed in torchtitan's order", "whatever the degrees split", 3, None,
             degrees=_MESH_DEGREES, rest="dp_shard", unset=1,
             options=(*DIMS, "sequence_parallel", "microbatches", "pp_schedule", *_SPLIT, "reshard_after_forward",
                      "fsdp_bf16", _SYNC), needs_group=True, moe=True),
)}
# Options some strategies take and the others refuse: every strategy-specific TrainConfig field.
OPTIONS = tuple(sorted({o for s in STRATEGIES.values() for o in s.options}))


def strategy(name: str) -> Strategy:
    """The record of strategy ``name``; a ValueError listing them otherwise."""
    return STRATEGIES[one_of("strategy", name, STRATEGIES, "strategies")]


def takes(option: str) -> list[str]:
    """The strategies that take ``option``."""
    return [s.name for s in STRATEGIES.values() if option in s.options]


def layout(spec: Strategy) -> str:
    """What the name means as degree flags: ``--tp -1`` for ``tp`` (and, when the run gives ``--tp N``,
    the dimension the ranks left go to). -1 is torchtitan's "the ranks the others leave"."""
    flag = lambda dim: "--" + dim.replace("_", "-")  # noqa: E731
    if spec.one_process:
        return "one rank"
    own = [dim for dim, _ in spec.degrees if dim != spec.rest]
    if spec.unset == -1 and len(own) == 1:
        return f"{flag(own[0])} -1 (given {flag(own[0])} N: {flag(spec.rest)} takes the ranks left)"
    if len(own) > 1:
        return f"{', '.join(map(flag, own))} as given (unset: 1), {flag(spec.rest)} -1"
    return " ".join([*(f"{flag(dim)} N" for dim in own), flag(spec.rest), "-1"])


def expand(spec: Strategy, cfg: Any) -> Parallelism:
    """The one :class:`~labkit.parallel.layout.parallelism.Parallelism` that preset ``spec`` names with
    the degrees and options ``cfg`` (a :class:`~labkit.train.config.TrainConfig`; not imported: the
    config imports these records) gives: its own degree -1 unless given, the dimension it leaves the
    ranks to (``rest``) -1 unless another is; a one-line ValueError for two -1s."""
    given: dict[str, int] = {}
    for dim, name in spec.degrees:
        value = getattr(cfg, name) or (spec.unset if dim != spec.rest else 0)  # 0: not given
        if value:
            given[dim] = value
    rest = [d for d, v in given.items() if v == -1]
    if len(rest) > 1:
        raise ValueError(f"{' and '.join(f'{d}=-1' for d in rest)}: only one degree can take the ranks the others "
                         "leave; give the others as numbers")
    if rest == ["ep"]:  # ep is carved out of dp_shard: the ranks left shard the weights and split the experts
        if "dp_shard" in given:
            raise ValueError(f"ep=-1 with dp_shard={given['dp_shard']}: ep is carved out of dp_shard, so -1 "
                             "cannot take the ranks left; give ep as a number")
        given["dp_shard"] = -1
    elif given.get("ep", 1) > 1 and spec.rest != "dp_shard" and "dp_shard" not in given:
        given["dp_shard"] = given["ep"]  # ep is carved out of dp_shard (torchtitan): the least that holds it
    if not rest and spec.rest not in given:
        given[spec.rest] = -1
    return Parallelism(**{d: given.get(d, 1) for d in DIMS}, dp_impl=spec.dp_impl, tp_impl=spec.tp_impl,
                       pp_impl=spec.pp_impl, pp_schedule=cfg.pp_schedule, pp_split=cfg.pp_split,
                       microbatches=cfg.microbatches, sequence_parallel=cfg.sequence_parallel,
                       reshard_after_forward=cfg.reshard_after_forward, cpu_offload=cfg.cpu_offload,
                       fsdp_bf16=cfg.fsdp_bf16, bucket_cap_mb=cfg.bucket_cap_mb,
                       sync_each_microbatch=cfg.sync_each_microbatch)
