"""How many of the GPT's parameters one rank holds under a layout, before data parallelism shards them.

Tensor parallelism splits every weight matrix of a block and the column-parallel biases by ``tp``
(LayerNorms, row-parallel biases, embeddings and the head stay whole; a mixture-of-experts block's
router and experts are not split by TP); expert parallelism keeps ``E / ep`` experts per block; a
pipeline stage holds its layers, the first the embeddings, the last the final norm and a copy of the
tied head (:func:`labkit.parallel.pipeline.stages.stage_params`). FSDP then divides what is left by
its shard group, padding each tensor's first dimension to a multiple of it.
"""
from __future__ import annotations

from labkit.core.model import GPTConfig
from labkit.parallel.layout.mesh import Degrees
from labkit.parallel.pipeline.split import Split


def layer_params(cfg: GPTConfig, tp: int = 1, ep: int = 1) -> tuple[int, int]:
    """Parameters of one block on one rank: (dense, experts)."""
    C, b = cfg.n_embd, int(cfg.bias)
    norms = 2 * C * (1 + b)
    attention = (4 * C * C + 3 * C * b) // tp + C * b  # Q, K, V and the output projection; its bias whole
    if cfg.moe_experts:  # the router, and this rank's experts
        return norms + attention + C * cfg.moe_experts, cfg.moe_experts // ep * (8 * C * C + 5 * C * b)
    return norms + attention + (8 * C * C + 4 * C * b) // tp + C * b, 0


def params_on_rank(cfg: GPTConfig, d: Degrees, pp_rank: int = 0, schedule: str | Split | None = None) -> tuple[int, int]:
    """Parameters rank ``pp_rank`` of the pipeline holds, (dense, experts) (``schedule``: the pipeline's,
    or its :class:`~labkit.parallel.pipeline.stages.Split`; None without one)."""
    C, V = cfg.n_embd, cfg.vocab_size
    embeddings, final_norm = V * C + cfg.block_size * C, C * (1 + int(cfg.bias))
    dense, experts = layer_params(cfg, d.tp, d.ep)
    if schedule is None:
        return cfg.n_layer * dense + embeddings + final_norm, cfg.n_layer * experts
    split = schedule if isinstance(schedule, Split) else Split(schedule)
    n_stages, bounds = split.n_stages(d.pp), split.bounds(cfg.n_layer, d.pp)
    held = [0, 0]
    for index in split.indices(pp_rank, d.pp):
        lo, hi = bounds[index]
        held[0] += (hi - lo) * dense + (embeddings if index == 0 else 0)
        held[0] += (final_norm + (V * C if n_stages > 1 else 0)) if index == n_stages - 1 else 0
        held[1] += (hi - lo) * experts
    return held[0], held[1]


def comm_payload(cfg: GPTConfig, d: Degrees, rows: int, microbatches: int | None = None, dtype_bytes: int = 4,
                 pp_rank: int = 0) -> dict[str, int]:
    """Payload bytes one rank of pipeline stage ``pp_rank`` hands to collectives per step on each mesh
    dimension (fp32 gradients; no sequence or context parallelism), ``rows`` the rows its data-parallel
    rank reads, ``microbatches`` the pipeline's (None: no pipeline): what
    :class:`labkit.comm.counter.CommCounter` counts.

    * ``tp``: Megatron-LM's four all-reduces of ``rows x s x h`` per block of the stage (Shoeybi et al.
      2019, section 3), whatever the microbatches.
    * ``pp``: a stage boundary's activations forward and their gradients back, each sent by one stage
      and received by the other (a 2-stage pipeline's end stage does one of each); and the tied
      embedding's gradient shard, all-reduced between the first and the last stage.
    * ``shard``: FSDP2 gathers this rank's weights for forward and again for backward, and reduce-scatters
      the gradients once (Zhao et al. 2023). Under a pipeline the stage keeps its weights gathered for the
      whole step (``reshard_after_forward`` is off whenever pp > 1, as in torchtitan;
      :mod:`labkit.parallel.compose` says why): one gather at the first microbatch's forward, and one
      reduce-scatter after the last microbatch.
    Clipping adds a 4-byte all-reduce of a squared norm on each dimension a gradient is split over (one
    per kind of split: a few bytes), which the formula leaves out.
    """
    s, h = cfg.block_size // d.cp, cfg.n_embd
    dense, experts = params_on_rank(cfg, d, pp_rank, "1f1b" if microbatches else None)
    layers = cfg.n_layer // d.pp
    out: dict[str, int] = {}
    if d.tp > 1:
        out["tp"] = 4 * rows * s * h * dtype_bytes * layers
    if d.pp > 1:
        tied = cfg.vocab_size * h * 4 // (d.shard if d.tokens > 1 else 1) if pp_rank in (0, d.pp - 1) else 0
        boundaries = 1 if pp_rank in (0, d.pp - 1) else 2
        out["pp"] = 2 * boundaries * rows * s * h * dtype_bytes + tied
    if d.shard > 1:
        gathers = 1 if microbatches else 2
        out["shard"] = (gathers + 1) * 4 * (dense + experts)
    return out
