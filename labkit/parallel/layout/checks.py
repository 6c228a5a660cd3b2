"""What a layout cannot do with a model, said in one line before anything starts (no collective yet).

:func:`check_layout` holds every degree of a :class:`~labkit.parallel.layout.mesh.Degrees` against the
GPT's shape and the batch: tensor parallelism must split whole heads, pipeline stages need layers
and microbatches, the zig-zag split needs ``2 x cp`` chunks, experts must split evenly, and the
combinations labkit does not implement are refused with the reason.
"""
from __future__ import annotations

from labkit.core.model import GPTConfig
from labkit.parallel.layout.mesh import Degrees
from labkit.parallel.pipeline.split import Split, check_pp
from labkit.parallel.tensor_parallel import check_tp


def check_layout(d: Degrees, model: GPTConfig, rows: int | None = None, microbatches: int | None = None,
                 schedule: str = "1f1b", pp_impl: str = "torch", sequence_parallel: bool = False,
                 activation_checkpointing: str = "none", split: Split | None = None) -> None:
    """A ValueError naming the degree or field, unless ``d`` can place ``model``.

    ``rows``: the rows of the global batch each data-parallel rank reads per step (None: not known
    yet); ``microbatches``: the pipeline's, when the layers run as a pipeline (None: they do not);
    ``split``: its stages per rank and first and last stage's layers (None: the schedule's own)."""
    check_tp(d.tp, model)
    if sequence_parallel and model.block_size // d.cp % d.tp:
        raise ValueError(f"sequence_parallel needs tp={d.tp} to divide the {model.block_size // d.cp} tokens of a "
                         f"sequence each rank holds (block_size={model.block_size}, cp={d.cp})")
    if microbatches is not None:
        check_pp(d.pp, model.n_layer, microbatches, schedule, rows, pp_impl, split)
    if d.cp > 1:
        if model.block_size % (2 * d.cp):
            raise ValueError(f"block_size={model.block_size} must be divisible by 2 x cp = {2 * d.cp}: the zig-zag "
                             "split cuts each sequence into 2 x cp chunks")
        if model.dropout:
            raise ValueError(f"dropout={model.dropout} is not supported with cp={d.cp}: ring attention has no "
                             "attention dropout; use dropout=0")
    _check_experts(d, model, sequence_parallel, activation_checkpointing)


def _check_experts(d: Degrees, model: GPTConfig, sequence_parallel: bool, recompute: str = "none") -> None:
    if d.ep > 1 and not model.moe_experts:
        raise ValueError(f"ep={d.ep} needs a mixture-of-experts model: set moe_experts (--moe-experts E, a "
                         "multiple of ep)")
    if not model.moe_experts:
        return
    if model.moe_experts % d.ep:
        raise ValueError(f"moe_experts={model.moe_experts} must be a multiple of ep={d.ep}: each rank of a group "
                         "holds moe_experts/ep experts")
    refused = (("cp", d.cp, "under context parallelism a rank holds zig-zag chunks of each sequence, so capacity "
                            "would drop other tokens than one process drops"),
               ("pp", d.pp, "the load-balancing loss of each stage's blocks would need a backward of its own"),
               ("sequence_parallel with tp", d.tp if sequence_parallel else 1,
                "sequence parallelism would route each rank's slice of the tokens apart"))
    if recompute.startswith("selective") and d.dp_replicate * d.dp_shard_mod_ep > 1:
        # Seen (issue 45's combinations): torch raises "profiler._record_function_enter_new ... encountered
        # during backward but not found in storage" at the first backward
        raise ValueError(f"activation_checkpointing={recompute!r} is not supported with moe_experts="
                         f"{model.moe_experts} and {d.label()}: FSDP2 shards the experts inside each checkpointed block, and its hooks' "
                         "profiler ranges change the ops the selective cache replays; use 'full' or 'every:k'")
    for name, degree, why in refused:
        if degree > 1:
            raise ValueError(f"moe_experts={model.moe_experts} (a mixture of experts) is not supported with "
                             f"{name}={degree}: {why}")
