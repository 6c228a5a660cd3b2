"""Placing the GPT on a device mesh: every parallelism in one function, composed in one order.

:func:`place` takes the plain GPT (the same weights on every rank) and the run's
:class:`~labkit.parallel.layout.mesh.ParallelDims`, and returns what this rank trains, a :class:`Placed`;
:func:`parallelize` places one part of it (the GPT, or one pipeline stage) and returns the part.
The order is torchtitan's (its ``parallelize`` functions), each step one call into ``labkit.parallel``:

1. **Pipeline stages** (``pp``): the layers cut into stages, this rank keeping its own
   (:mod:`~labkit.parallel.pipeline.stages`); every later step acts on each stage alone, as if it
   were a model of its own.
2. **Tensor parallelism** (``tp``, with sequence parallelism) inside each stage
   (:mod:`~labkit.parallel.tensor_parallel`): it rewrites the weight matrices into DTensor shards
   before anything else holds them.
3. **Experts** (``ep``): this rank keeps its share of every MoE block's experts and routes tokens
   to the others by all-to-all (:mod:`~labkit.parallel.experts.placement`).
4. **Context parallelism** (``cp``): ring attention over the cp group at zig-zag positions
   (:mod:`~labkit.parallel.context.ring`). It swaps each block's attention function and holds
   no parameter, so the code applies it after step 6: DDP's bucket-priming forward, a one-token
   batch the ring could not split, runs on plain attention first.
5. **Activation checkpointing** per block (:mod:`~labkit.parallel.activation_checkpointing`): around
   the block as TP left it, so recomputation replays TP's and the ring's collectives too, and inside
   FSDP's hooks, which must gather the weights before the block runs at all.
6. **Data parallelism** over the token ranks, last: FSDP2 or HSDP (:mod:`~labkit.parallel.fsdp`),
   which shards whatever the earlier steps left (TP's shards become 2-D placements); or DDP and the
   hand-written versions (:mod:`~labkit.parallel.data_parallel`) for a model only replicated.
"""
from __future__ import annotations

from functools import partial

import torch
import torch.nn as nn

from labkit.core.model import GPT, blocks_of
from labkit.parallel.pipeline import stages as pipe
from labkit.parallel.activation_checkpointing import apply as apply_checkpointing
from labkit.parallel.clipping import reduce_partial_grads
from labkit.parallel.layout.mesh import ParallelDims
from labkit.parallel.layout.parallelism import Parallelism
from labkit.parallel.placed import Placed


def parallelize(part: nn.Module, dims: ParallelDims, par: Parallelism, activation_checkpointing: str = "none"
                ) -> nn.Module:
    """One model part (the GPT, or one pipeline stage) placed along the dimensions inside it, steps 2,
    3 and 5 of the module docstring: tensor parallelism, the experts, activation checkpointing.
    Returns the part (changed in place), as torchtitan's ``parallelize`` functions do."""
    d = dims.degrees
    if d.tp > 1:
        from labkit.parallel import tensor_parallel as tpar

        if par.tp_impl == "scratch":
            tpar.parallelize_scratch(part, dims.group("tp"))
        else:
            tpar.parallelize_dtensor(part, dims.submesh("tp"), par.sequence_parallel)
    from labkit.parallel.experts.placement import place_experts

    place_experts(part, dims)  # every MoE block routes over the global batch, even with ep = 1
    apply_checkpointing(part, activation_checkpointing)
    return part


def place(model: GPT, dims: ParallelDims, par: Parallelism, device: torch.device, *, rows: int,
          precision: str = "fp32", activation_checkpointing: str = "none", ddp_hook: object = None) -> Placed:
    """This rank's share of ``model`` under the parallelism ``par`` on the mesh ``dims``, in the module
    docstring's order: its pipeline stages (:func:`split_stages`), each :func:`parallelize`-d, then data
    parallelism over them all, context parallelism, and the pipeline's schedule (:func:`build_pipeline`).
    ``rows``: the rows of the global batch this rank reads per step (its pipeline's microbatches);
    ``ddp_hook``: a DDP comm hook (the emulated slow link)."""
    d = dims.degrees
    parts, pipeline_args = split_stages(model, dims, par) if par.pipelined else ([model], None)
    for part in parts:
        parallelize(part, dims, par, activation_checkpointing)
    placed = Placed(model=model, module=model, dims=dims, parts=parts, scratch_tp=par.tp_impl == "scratch" and d.tp > 1)
    if d.tp > 1 and par.tp_impl != "scratch":  # sequence parallelism leaves LayerNorm gradients Partial
        placed.finishers.append(lambda: reduce_partial_grads(placed.params))
    if pipeline_args is not None:
        placed.module = placed.model = pipe.RankStages(parts)
    _data_parallel(placed, par, device, ddp_hook)
    # by name, once FSDP has replaced the parameters with its DTensor shards
    placed.experts = {id(p) for name, p in placed.module.named_parameters() if ".experts." in name}
    if d.cp > 1:  # after DDP's bucket-priming forward, a one-token batch the ring could not split
        _context_parallel(placed, device)
    if pipeline_args is not None:
        build_pipeline(placed, model, pipeline_args, par, device, rows, precision)
    return placed


def build_pipeline(placed: Placed, model: GPT, pipeline_args: tuple, par: Parallelism, device: torch.device,
                   rows: int, precision: str) -> None:
    """The schedule that runs ``placed``'s stages (torchtitan's ``pipelining_fn``, after the stages
    are placed), and this rank's copy of the tied embedding / head."""
    from labkit.parallel.pipeline.runner import Pipeline, sum_tied_copies

    placed.pipeline = Pipeline(placed.parts, placed.module, *pipeline_args, device=device, schedule=par.pp_schedule,
                               microbatches=par.microbatches, micro_shape=_micro_shape(model, placed.dims, par, rows),
                               precision=precision, impl=par.pp_impl or "torch",
                               param_dtype=torch.bfloat16 if par.fsdp_bf16 and placed.fsdp_roots else None)
    tied = _tied_copy(placed)
    if tied is not None:
        placed.finishers.append(partial(sum_tied_copies, tied, placed.pipeline, placed.dims.pp_ends_group))


def split_stages(model: GPT, dims: ParallelDims, par: Parallelism) -> tuple[list[pipe.GPTStage], tuple]:
    """This rank's stages (two chunks per rank when interleaved, r and r + pp; in a V, r and 2 pp - 1 - r)."""
    pp, rank = dims.degrees.pp, dims.coords["pp"]
    split = par.pp_split or pipe.Split(par.pp_schedule)
    n_stages = split.n_stages(pp)
    stages = [pipe.GPTStage(model, i, n_stages, split.first_less, split.last_less) for i in split.indices(rank, pp)]
    if stages[0].first and stages[-1].last and n_stages > 1:
        # A V puts both uses of the tied matrix on this rank. The zero-bubble schedules defer the
        # weight gradients of each stage apart and miss what the two stages share (seen: a loss off by
        # 1e-2 after six steps): the head gets its own copy, summed with the embedding's as across ranks.
        stages[-1].head.weight = nn.Parameter(stages[0].wte.weight.detach().clone())
    return stages, (n_stages, rank, pp, dims.group("pp"))


def _micro_shape(model: GPT, dims: ParallelDims, par: Parallelism, rows: int) -> tuple[int, int, int, int, int]:
    """(rows, tokens, tokens between stages, hidden, vocab) of one microbatch on this rank."""
    c, d = model.config, dims.degrees
    tokens = c.block_size // d.cp
    between = tokens // d.tp if par.sequence_parallel and d.tp > 1 else tokens
    return rows // par.microbatches, tokens, between, c.n_embd, c.vocab_size


def _data_parallel(placed: Placed, par: Parallelism, device: torch.device, ddp_hook: object) -> None:
    """Data parallelism over the token ranks. FSDP2 sums the gradients: each rank's loss is divided by
    the global token count (:attr:`Placed.loss_weight`, torchtitan's normalisation), so the sum is the
    global batch's gradient, experts' included (their FSDP mesh is smaller than the ranks whose tokens
    reached them), with no division left to do where a gradient arises. DDP and the hand-written
    versions average each rank's mean loss: a gradient already reduced by an earlier micro-batch's
    synchronisation is the same on every rank, which a mean leaves as it is and a sum would multiply."""
    dims = placed.dims
    if dims.degrees.tokens == 1 or par.dp_impl == "none":  # alone, or the optimizer averages (ZeRO-1, DeepSpeed)
        return
    if par.dp_impl == "fsdp":
        # Every token rank holds as many tokens (whole rows of block_size, none padded or ignored), so
        # its share of the global count is 1/tokens, known without counting them.
        placed.loss_weight = 1 / dims.degrees.tokens
        from labkit.parallel.fsdp import apply_fsdp, sum_gradients

        expert_mesh = dims.expert_mesh()
        # Under a pipeline FSDP2 keeps each stage's weights gathered from its first forward to the step's
        # last backward (torchtitan's default with PP); the schedule gathers and frees whole stages itself.
        # Needed, not only cheaper: a zero-bubble schedule (zb, zbv, dualpipev) splits a backward into B
        # and W and, at B, takes the stage's parameters as registered then. Resharded after forward they
        # were the shards, which the graph never used, and W differentiated nothing: under zbv the last
        # stage's gradients (tied head included) were None and the middle stages' about half; zb hung
        # in the tied sum, dualpipev trained wrong.
        placed.fsdp_roots = apply_fsdp(placed.parts, dims.dp_mesh(), par.reshard_after_forward and not par.pipelined,
                                       par.cpu_offload, par.fsdp_bf16, expert_mesh, device)
        sum_gradients(placed.parts)
        return
    from labkit.parallel import data_parallel as dp

    if par.dp_impl == "ddp":
        placed.model = dp.wrap_ddp(placed.module, device, par.bucket_cap_mb, group=dims.tokens_group)
        if ddp_hook is not None:
            placed.model.register_comm_hook(None, ddp_hook)
    else:
        placed.model = (dp.NaiveDataParallel(placed.module) if par.dp_impl == "naive" else
                        dp.BucketedDataParallel(placed.module, bucket_cap_mb=par.bucket_cap_mb))
        placed.finishers.append(placed.model.finish_gradient_sync)


def _context_parallel(placed: Placed, device: torch.device) -> None:
    """Ring attention over the cp group in every block; the positions of this rank's zig-zag chunks."""
    from labkit.parallel.context.ring import ring_attention
    from labkit.parallel.context.layout import cp_positions

    dims = placed.dims
    positions = cp_positions(placed.module.config.block_size, dims.degrees.cp, dims.coords["cp"]).to(device)
    for part in placed.parts:
        for block in blocks_of(part):
            block.attn.attend = partial(ring_attention, group=dims.group("cp"), causal=True, layout="zigzag")
        part.positions = positions


def _tied_copy(placed: Placed) -> nn.Parameter | None:
    """The tied embedding / head matrix this rank holds when stages split its two uses."""
    pipeline = placed.pipeline
    if placed.dims.degrees.pp == 1:
        return None
    if pipeline.first is not None:
        return pipeline.first.wte.weight
    return pipeline.last.head.weight if pipeline.last is not None else None
