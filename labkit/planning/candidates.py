"""The layouts the strategy chooser weighs, each one a run ``labkit.train`` can start as printed.

A :class:`Candidate` names how memory is split (its ZeRO stage), the degrees of tensor, pipeline,
context and expert parallelism, recomputation, accumulation and offload. :meth:`Candidate.degrees`
gives its :class:`labkit.parallel.mesh.Degrees` on ``n`` devices, :meth:`Candidate.train_args` the exact
flags of ``python -m labkit.train``, and :func:`refusal` says, with the loop's own checks
(:func:`labkit.parallel.checks.check_layout`), why a model cannot be laid out so: the chooser never
recommends a layout the loop would refuse. ZeRO-1 and ZeRO-2 are DeepSpeed's pure data parallelism;
composed with TP or PP the data-parallel ranks either replicate the model (stage 0) or shard it with
FSDP2 (stage 3); CP and EP ranks always join FSDP's shard group (stage 3), as torchtitan's do.
"""
from __future__ import annotations

from dataclasses import dataclass

from labkit.core.model import GPTConfig
from labkit.memory.architecture import ModelShape
from labkit.parallel.checks import check_layout
from labkit.parallel.mesh import Degrees


@dataclass(frozen=True)
class Candidate:
    stage: int  # the ZeRO stage of the data-parallel ranks: 0 (replicas), 1, 2, 3 (FSDP)
    recompute: str = "none"
    offload: bool = False  # optimizer states and step in host memory (ZeRO-Offload)
    tp: int = 1
    pp: int = 1
    cp: int = 1
    ep: int = 1
    accumulate: bool = False  # the same tokens per step in micro-batches of one

    @property
    def composed(self) -> bool:
        return self.tp * self.pp * self.cp * self.ep > 1

    @property
    def label(self) -> str:
        dp = {0: "DDP", 1: "ZeRO-1", 2: "ZeRO-2 (FSDP SHARD_GRAD_OP)", 3: "ZeRO-3 / FSDP"}[self.stage]
        parts = []
        if self.ep > 1:
            parts.append(f"EP={self.ep}")
        if self.tp > 1:
            parts.append(f"TP={self.tp} + SP" if self.ep == 1 else f"TP={self.tp}")
        if self.pp > 1:
            parts.append(f"PP={self.pp} (1F1B)")
        parts.append(dp if not self.composed else ("FSDP" if self.stage == 3 else "DDP"))
        if self.recompute == "full":
            parts.append("full recompute")
        if self.cp > 1:
            parts.append(f"CP={self.cp}" + (" (ring attention)" if self.recompute == "none" else ""))
        if self.offload:
            parts.append("optimizer offload")
        if self.accumulate:
            parts.append("gradient accumulation")
        return " + ".join(parts)

    def degrees(self, n_devices: int) -> Degrees:
        """Its layout on ``n_devices``: the data-parallel ranks replicate (stage 0) or shard (stage 3)."""
        data = n_devices // (self.tp * self.pp * self.cp * self.ep)
        dp = {"dp_shard": data} if self.stage == 3 else {"dp_replicate": data}
        return Degrees(pp=self.pp, ep=self.ep, cp=self.cp, tp=self.tp, **dp)

    def rows(self, micro_batch: int) -> int:
        """Sequences each data-parallel rank reads a step: a replica (tp x pp x cp devices) takes
        ``micro_batch`` per device, so every candidate trains the same global batch."""
        return micro_batch * self.tp * self.pp * self.cp

    def micro(self, micro_batch: int) -> int:
        """Sequences in one micro-batch (what the calculator's activations assume)."""
        return 1 if self.accumulate else micro_batch

    def train_args(self, n_devices: int, micro_batch: int) -> list[str]:
        """The flags of ``python -m labkit.train`` that run it with ``micro_batch`` sequences per device."""
        rows, micro = self.rows(micro_batch), self.micro(micro_batch)
        if not self.composed:
            strategy = {0: "ddp", 1: "zero1", 2: "zero2", 3: "zero3" if self.offload else "fsdp"}[self.stage]
            args = ["--strategy", strategy] + (["--offload-optimizer"] if self.offload else [])
        else:
            d = self.degrees(n_devices)
            args = ["--strategy", "mesh"] + [x for dim in ("pp", "dp_replicate", "dp_shard", "ep", "cp", "tp")
                                              if getattr(d, dim) > 1 or dim == "dp_shard"
                                              for x in ("--" + dim.replace("_", "-"), str(getattr(d, dim)))]
            if self.tp > 1 and self.ep == 1:
                args.append("--sequence-parallel")
        args += ["--batch-size", str(micro_batch * n_devices)]
        if self.pp > 1:
            args += ["--microbatches", str(rows // micro), "--pp-schedule", "1f1b"]
        elif rows // micro > 1:
            args += ["--grad-accum", str(rows // micro)]
        if self.recompute != "none":
            args += ["--activation-checkpointing", self.recompute]
        return args


def model_config(shape: ModelShape, seq_len: int) -> GPTConfig:
    """labkit's GPT at ``shape``'s dimensions, as far as the loop's layout checks need it."""
    moe = {"moe_experts": shape.experts, "moe_top_k": shape.experts_per_token} if shape.experts > 1 else {}
    return GPTConfig(vocab_size=shape.vocab, block_size=seq_len, n_layer=shape.n_layer, n_head=shape.heads,
                     n_embd=shape.hidden, **moe)


def refusal(c: Candidate, shape: ModelShape, n_devices: int, micro_batch: int, seq_len: int) -> str | None:
    """Why the training loop would refuse this layout for this model and batch (None: it runs)."""
    if n_devices % (c.tp * c.pp * c.cp * c.ep):
        return f"{c.tp * c.pp * c.cp * c.ep} does not divide {n_devices} devices"
    if c.accumulate and c.pp > 1:
        return "a pipeline's microbatches are its accumulation"
    if c.stage != 3 and c.cp * c.ep > 1:
        return "context- and expert-parallel ranks shard the weights with FSDP (stage 3)"
    rows, micro = c.rows(micro_batch), c.micro(micro_batch)
    try:
        check_layout(c.degrees(n_devices), model_config(shape, seq_len), rows, rows // micro if c.pp > 1 else None,
                     "1f1b", "torch", c.tp > 1 and c.ep == 1, c.recompute)
    except ValueError as e:
        return str(e)
    return None


def _candidates() -> list[Candidate]:
    """In order of what they give up (the order breaks ties; :mod:`labkit.planning.choose`)."""
    out = [Candidate(s) for s in range(4)]
    out += [Candidate(3, ep=8)]
    out += [Candidate(s, accumulate=True) for s in (0, 1, 3)]
    out += [Candidate(3, "full"), Candidate(3, "full", accumulate=True), Candidate(3, "full", ep=8)]
    out += [Candidate(3, cp=c) for c in (2, 4, 8)] + [Candidate(3, "full", cp=c) for c in (2, 4, 8)]
    out += [Candidate(s, tp=t) for s in (0, 3) for t in (2, 4, 8)]
    out += [Candidate(3, "full", tp=t) for t in (2, 4, 8)]
    out += [Candidate(s, "full", tp=8, pp=p) for s in (0, 3) for p in (2, 4, 8)]
    return out + [Candidate(3, "full", offload=True)]


CANDIDATES = _candidates()


def run_command(rec_args: list[str], shape: ModelShape, n_devices: int, seq_len: int, precision: str,
                device: str = "cuda", devices_per_node: int = 8, tokens: float | None = None) -> dict:
    """The recommendation as a run: its ``labkit.train`` flags (with labkit's GPT at the model's shape
    when the model is GPT-shaped, the precision and device; ``--steps`` for ``tokens``) and the torchrun
    command that starts it on every node."""
    args = list(rec_args) + ["--precision", "fp32" if precision == "fp32" else "bf16", "--device", device]
    if shape.family == "gpt":  # labkit's GPT is this family: the same model, not only the same layout
        args += ["--vocab-size", str(shape.vocab), "--block-size", str(seq_len), "--n-layer", str(shape.n_layer),
                 "--n-head", str(shape.heads), "--n-embd", str(shape.hidden)]
        if shape.experts > 1:
            args += ["--moe-experts", str(shape.experts), "--moe-top-k", str(shape.experts_per_token)]
    if tokens:
        batch = int(rec_args[rec_args.index("--batch-size") + 1])
        args += ["--steps", str(max(1, -(-int(tokens) // (batch * seq_len))))]
    per_node = min(n_devices, devices_per_node)
    # one node: a free port picked at start (parallel jobs never collide); several: the first node's
    nodes = "--rdzv-backend c10d --rdzv-endpoint 127.0.0.1:0 " if n_devices <= devices_per_node else (
        f"--nnodes {n_devices // per_node} --rdzv-backend c10d --rdzv-endpoint $HEAD_NODE:29500 ")
    return {"train_args": args, "command": f"torchrun {nodes}--nproc-per-node {per_node} -m labkit.train "
                                           + " ".join(args),
            "model": "labkit's GPT at this shape" if shape.family == "gpt" else
                     "layout flags only: labkit.train trains its GPT, not this family"}
