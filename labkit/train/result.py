"""What :func:`labkit.train.loop.train` returns, key by key: :class:`TrainResult`, and :class:`RankFigures`
for each entry of its ``ranks``. The labs (``labs/*.md``) and :mod:`labkit.labs` read these keys by name
(``r["loss"]``, ``r["ranks"][0]["step_time_s"]``): each has its type, unit and the runs that return it
(``Required``: every run; the others: the runs their comment names). tests/test_train_result.py holds
real runs to these declarations.
"""
from typing import Any, Required, TypedDict

import torch


class CheckpointSave(TypedDict):
    """One save (:class:`labkit.fault_tolerance.step_log.SaveStats`, as a dict)."""
    step: int
    path: str
    blocking_s: float  # s the save held the training loop
    total_s: float | None  # s from snapshot to published (None while an async save is in flight)
    bytes: int  # this rank's bytes written
    hash_s: float  # s checksumming this rank's share of the files
    done: bool


class Restored(TypedDict):  # the checkpoint a run resumed from
    step: int  # the step the run resumed from
    seconds: float  # s the restore took
    saved_world_size: int  # ranks of the run that saved it


class Preempted(TypedDict):
    signal: str | None  # "SIGTERM" or "SIGUSR1"
    step: int  # steps done when the run stopped
    saved: bool  # whether a checkpoint of that step was saved
    time_left_s: float  # s left before the expected SIGKILL


class PeakMemory(TypedDict):
    allocated: int | None  # bytes, the CUDA allocator's peak (None on CPU)
    reserved: int | None  # bytes, reserved by the CUDA allocator (None on CPU)
    process_max_rss: int  # bytes, the process's resident maximum


class Operators(TypedDict):
    total: dict[str, int]  # operators dispatched in the step, "dtensor" or "plain"
    fwd_bwd: dict[str, int]  # ... of them in forward and backward


class Routing(TypedDict):
    """One MoE block's routing in one step (:class:`labkit.core.moe.RoutingStats`)."""
    routed: list[int]  # token-choices per expert, before capacity
    kept: list[int]  # ... that the expert processed
    dropped: int  # token-choices beyond capacity
    tokens: int  # tokens in the global batch
    capacity: int | None  # token-choices per expert (None: no limit)
    aux: float  # the unweighted auxiliary loss


class PipelineEvent(TypedDict):
    """One stage's forward/backward of one microbatch (:class:`labkit.parallel.pipeline.timeline.Event`)."""
    stage: int
    kind: str  # "F", "B" or "W"
    mb: int  # microbatch
    start: float  # s since the step began
    end: float  # s
    saved_bytes: int  # bytes F left for backward


class RankFigures(TypedDict, total=False):
    """One rank's figures (:meth:`labkit.train.probe.Probe.rank_figures`): per step run, the collective
    counts None on the steps the counter skipped (``count_comm="auto"`` on CUDA counts the last only)."""
    rank: Required[int]
    step_time_s: Required[list[float]]  # s per step, device synchronised
    step_timed_without_counter: Required[list[bool]]  # per step: ran without the collective counter
    allreduce_bytes_per_step: Required[list[int | None]]  # bytes all-reduced (payload)
    allreduce_calls_per_step: Required[list[int | None]]
    comm_bytes_per_step: Required[list[dict[str, int] | None]]  # payload bytes by collective
    comm_calls_per_step: Required[list[dict[str, int] | None]]  # calls by collective
    comm_volume_per_step: Required[list[float | None]]  # bytes this rank sends under ring algorithms
    comm_bytes_by_mesh_dim_per_step: Required[list[dict[str, dict[str, int]] | None]]  # dim -> op -> bytes
    fwd_bwd_comm_bytes_per_step: Required[list[dict[str, int] | None]]  # bytes by collective, fwd+bwd only
    operators_per_step: Required[list[Operators | None]]
    model_state_bytes: Required[dict[str, int] | None]  # params/grads/optimizer/grad_accum/total bytes held
    model_state_bytes_per_step: Required[list[int]]  # bytes held after each step
    local_loss: Required[list[float]]  # this rank's mean loss per step
    cuda_allocated_after_step: Required[list[int | None]]  # bytes (None on CPU)
    peak_memory_bytes: Required[PeakMemory]
    coords: Required[dict[str, int]]  # the rank's place along each degree
    predicted_model_state_bytes: Required[dict[str, int]]  # bytes the formula says this rank holds
    kv_bytes_per_step: list[int]  # context parallelism (cp > 1): ring attention's K/V bytes sent
    all_to_all_bytes_per_step: list[int | None]  # expert parallelism: token all-to-all bytes sent
    routing_per_step: list[list[Routing] | None]  # MoE models: per step, per MoE block
    peak_activation_bytes: list[int]  # pipelines: per step, bytes saved for backward at their peak
    activation_bytes_per_microbatch: int | float  # pipelines: median bytes one forward saves
    events: list[list[PipelineEvent]]  # pipelines: per step; train() deletes it once gathered


class TrainResult(TypedDict, total=False):
    """What :func:`labkit.train.loop.train` returns on each rank (see the module docstring)."""
    # the run (from the TrainConfig and GPTConfig)
    strategy: Required[str]
    world_size: Required[int]  # ranks
    device: Required[str]  # "cpu" or "cuda"
    steps: Required[int]  # the configured steps (a preempted run stops earlier)
    precision: Required[str]
    activation_checkpointing: Required[str]  # policy
    seed: Required[int]
    batch_size: Required[int]  # global batch, rows
    model: Required[dict[str, Any]]  # GPTConfig.to_dict()
    n_params: Required[int]
    grad_bytes: Required[int]  # bytes of all trainable parameters (Psi), before any sharding
    # what it measured
    loss: Required[list[float]]  # global-batch loss per step, resumed history included
    step_time_s: Required[list[float]]  # s per step run by this process (rank 0's in ranks[0])
    ranks: Required[list[RankFigures]]  # every rank's figures, by rank
    start_step: Required[int]  # 0, or the step a resume started from
    comm_counted: Required[str]  # steps under the collective counter: "every", "last" or "none"
    # fault tolerance (labkit.train.resumable.Resumable.finish): empty/None without checkpoint_dir
    checkpoints: Required[list[CheckpointSave]]  # this rank's saves, in order
    restored: Required[Restored | None]  # None unless it resumed from a step > 0
    preempted: Required[Preempted | None]  # None unless SIGTERM/SIGUSR1 stopped it
    resume_notes: Required[list[str]]  # what a resume noticed changed, or why it started over
    # speed (labkit.train.instruments.speed): median of the timed steps after the first; None if no step ran
    tokens_per_s: Required[float | None]  # global-batch tokens per s
    model_tflops_per_s: Required[float | None]  # the whole job's model TFLOP/s (causal attention)
    peak_tflops: Required[float | None]  # per device: datasheet or cfg.peak_tflops (None on CPU without)
    mfu: Required[float | None]  # model FLOPs utilisation, 0-1 (None without peak_tflops)
    mfu_palm: Required[float | None]  # ... counting all attention scores (PaLM's convention)
    hfu: Required[float | None]  # hardware FLOPs utilisation: recomputation counted
    median_step_s: float  # s; when a step ran
    model_tflops_per_s_per_device: float  # when a step ran
    # layout (labkit.train.figures.layout_fields)
    degrees: Required[dict[str, int]]  # pp, dp_replicate, dp_shard, ep, cp, tp
    layout: Required[str]  # "tp=2 dp_shard=2" (degrees above 1) or "single"
    predicted_model_state_bytes: Required[dict[str, int]]  # rank 0's bytes by the formula
    tp: int  # strategies with tensor parallelism
    dp: int  # with tp, cp or ep > 1: data-parallel ranks
    impl: str  # tp: "dtensor"/"scratch"; pipelines: "torch"/"scratch"
    sequence_parallel: bool  # tp
    comm_formula_bytes_per_step: int  # tp: bytes all-reduced per step (Shoeybi et al. 2019)
    cp: int  # strategies with context parallelism
    kv_formula_bytes_per_step: int  # cp: K/V bytes each rank sends per step
    ep: int  # expert parallelism, ep > 1
    replicas: int  # HSDP (fsdp over dp_replicate)
    shard_group: int  # HSDP: ranks per shard group
    comm_formula: dict[str, dict[str, float]]  # HSDP: {"shard"/"replicate"/"fsdp": {"payload"/"sent": bytes}}
    pp: int  # pipelines (from here on)
    microbatches: int
    pp_schedule: str
    virtual_stages: int  # stages per rank
    stage_layers: list[tuple[int, int]]  # (first, end) layers of each stage
    bubble_fraction: float | None  # idle share of a step, median after the first step
    bubble_fraction_per_step: list[float]
    bubble_formula: float | None  # (p-1)/(vm+p-1); None for zero-bubble schedules
    timeline: list[PipelineEvent]  # the last step's events, every stage
    predicted_params_per_rank: list[int]  # parameters each pipeline rank holds
    # cfg.return_params
    params: dict[str, torch.Tensor]  # full parameters on the CPU (every rank)
