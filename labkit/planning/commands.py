"""A planned layout as the command that runs it: ``labkit.train``'s flags, and the whole launch.

:func:`degrees` says what a :class:`labkit.planning.step_model.Plan` is on labkit's mesh
(:class:`labkit.parallel.layout.mesh.Degrees`), :func:`refused` why the training loop would not run it
(its own :func:`labkit.parallel.layout.checks.check_layout`), :func:`train_args` every flag of
``python -m labkit.train`` that runs it, the model's shape included, and :func:`launch` the torchrun
line for every node, or the ``sbatch`` line of ``cluster/slurm/train.sbatch``. labkit.train trains
labkit's GPT: a model of another family runs as a GPT of the same width, depth, heads and
vocabulary, and :func:`launch` says so in one line.
"""
from __future__ import annotations

from labkit.core.model import GPTConfig
from labkit.memory.architecture import ModelShape
from labkit.parallel.layout.checks import check_layout
from labkit.parallel.layout.mesh import Degrees
from labkit.parallel.pipeline.split import Split

AC_POLICY = {"selective": "selective", "op": "selective:alternate", "full": "full"}  # the loop's names


def degrees(plan) -> Degrees:
    """``plan`` on labkit's mesh: the planner's ``dp`` is replicas x FSDP shards, the EP ranks carved out
    of the shards (torchtitan's meaning, the mesh's too)."""
    if plan.zero == 3:
        data = {"dp_replicate": plan.replicas, "dp_shard": plan.dp // plan.replicas, "ep": plan.ep}
    else:
        data = {"dp_replicate": plan.dp}
    return Degrees(pp=plan.pp, cp=plan.cp, tp=plan.tp, **data)


def model_config(shape: ModelShape, seq_len: int | None = None) -> GPTConfig:
    """labkit's GPT at ``shape``'s dimensions, as far as the loop's layout checks need it."""
    moe = {"moe_experts": shape.experts, "moe_top_k": shape.experts_per_token} if shape.experts > 1 else {}
    return GPTConfig(vocab_size=shape.vocab, block_size=seq_len or shape.seq_len, n_layer=shape.n_layer,
                     n_head=shape.heads, n_embd=shape.hidden, **moe)


def split(plan) -> Split:
    """The pipeline split of ``plan`` as the training loop takes it."""
    return Split(plan.schedule, plan.chunks if plan.schedule == "interleaved" and plan.chunks != 2 else 0,
                 plan.first_less, plan.last_less)


def refused(plan, shape: ModelShape) -> str | None:
    """Why labkit.train would refuse ``plan`` for ``shape`` (None: it runs)."""
    if plan.zero != 3 and plan.cp > 1:
        return "context-parallel ranks shard the weights with FSDP"
    if plan.offload and plan.tp * plan.pp * plan.cp * plan.ep > 1:
        return "optimizer offload is DeepSpeed's ZeRO-3, on data parallelism alone"
    deepspeed = plan.offload or plan.zero in (1, 2)
    if deepspeed and plan.recompute in ("selective", "op"):
        return "DeepSpeed's activation checkpointing has no selective policy (full or every:k)"
    try:
        check_layout(degrees(plan), model_config(shape), plan.global_batch // plan.dp,
                     plan.microbatches if plan.pp > 1 else None, plan.schedule, "torch",
                     plan.tp > 1 and plan.sequence_parallel, AC_POLICY.get(plan.recompute, "none"), split(plan))
    except ValueError as e:
        return str(e)
    return None


def train_args(plan, shape: ModelShape) -> list[str]:
    """Every flag of ``python -m labkit.train`` that runs ``plan`` on ``shape``'s dimensions (bf16)."""
    composed = plan.tp * plan.pp * plan.cp * plan.ep * plan.replicas > 1
    if not composed:
        name = {3: "zero3" if plan.offload else "fsdp", 2: "zero2", 1: "zero1"}.get(plan.zero, "ddp")
        args = ["--strategy", name] + (["--offload-optimizer"] if plan.offload else [])
    else:
        args = ["--strategy", "mesh"] + degrees(plan).flags()  # a degree left out is 1, dp_shard the rest
        if plan.tp > 1 and plan.sequence_parallel:
            args.append("--sequence-parallel")
    args += ["--batch-size", str(plan.global_batch)]
    if plan.pp > 1:
        args += ["--microbatches", str(plan.microbatches), "--pp-schedule", plan.schedule]
        if plan.schedule == "interleaved" and plan.chunks != 2:
            args += ["--pp-stages-per-rank", str(plan.chunks)]
        if plan.first_less or plan.last_less:
            args += ["--pp-first-stage-less-layers", str(plan.first_less),
                     "--pp-last-stage-less-layers", str(plan.last_less)]
    elif plan.microbatches > 1:
        args += ["--grad-accum", str(plan.microbatches)]
    if plan.recompute != "none":
        args += ["--activation-checkpointing", AC_POLICY[plan.recompute]]
    args += ["--precision", "bf16" if plan.value_bytes == 2 else "fp32"]
    args += ["--vocab-size", str(shape.vocab), "--block-size", str(shape.seq_len), "--n-layer", str(shape.n_layer),
             "--n-head", str(shape.heads), "--n-embd", str(shape.hidden)]
    if shape.experts > 1:
        args += ["--moe-experts", str(shape.experts), "--moe-top-k", str(shape.experts_per_token)]
    return args


def launch(args: list[str], shape: ModelShape, n_devices: int, devices_per_node: int = 8, device: str = "cuda",
           steps: int | None = None) -> dict:
    """The launch of ``args`` on ``n_devices``: the torchrun line every node runs (one node: a free
    port picked at start, so parallel jobs never collide; several: the first node's address), the
    ``sbatch`` line for ``cluster/slurm/train.sbatch``, and a warning when labkit's GPT is not the
    model's family."""
    per_node = min(n_devices, devices_per_node)
    nodes = -(-n_devices // per_node)
    base = list(args) + (["--steps", str(steps)] if steps else [])
    flags = " ".join(base + ["--device", device])
    rdzv = ("--rdzv-backend c10d --rdzv-endpoint 127.0.0.1:0" if nodes == 1 else
            f"--nnodes {nodes} --rdzv-backend c10d --rdzv-endpoint $HEAD_NODE:29500")
    gpus = f" --gpus-per-node={per_node}" if device == "cuda" else ""
    warning = None if shape.family == "gpt" else (
        f"labkit.train trains a GPT: this runs the layout on a GPT of {shape.family}'s width, depth, heads "
        "and vocabulary, not on its own blocks")
    return {"train_args": base + ["--device", device], "nodes": nodes, "nproc_per_node": per_node,
            "warning": warning, "command": f"torchrun {rdzv} --nproc-per-node {per_node} -m labkit.train {flags}",
            "sbatch": f"sbatch --nodes={nodes}{gpus} --export=ALL,CKPT_DIR=ckpt/planned,DEVICE={device},"
                      f"NPROC_PER_NODE={per_node} cluster/slurm/train.sbatch {' '.join(base)}"}
