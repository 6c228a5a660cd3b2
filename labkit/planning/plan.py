"""One layout and how it runs, as the planner prices it (:mod:`labkit.planning.step_model`) and counts
its memory (:mod:`labkit.planning.stage_memory`); :func:`labkit.planning.commands.degrees` says what
it is on labkit's mesh. And the operators a rank launches, for a step whose cost is its overheads.
"""
from __future__ import annotations

from dataclasses import dataclass

from labkit.planning import pipeline_model as pm
from labkit.planning.hardware import Hardware


@dataclass(frozen=True)
class Plan:
    """One layout and how it runs. ``dp`` counts model replicas (FSDP shards included); CP ranks are
    not among them. ``zero``: 0 DDP, 1 and 2 optimizer states (and gradients) sharded, 3 FSDP. ``ep``
    is carved out of the data-parallel ranks, as torchtitan carves it out of the ranks that shard."""

    tp: int = 1
    pp: int = 1
    cp: int = 1
    dp: int = 1
    ep: int = 1  # expert-parallel ranks, carved out of dp (each holds experts / ep)
    replicas: int = 1  # HSDP (zero 3): dp = replicas x a shard group; 1 is FSDP over all dp ranks
    micro_batch: int = 1
    global_batch: int = 1  # sequences per step
    zero: int = 1
    recompute: str = "none"  # none | selective | full | op (torchtitan's: every second matmul)
    schedule: str = "1f1b"
    chunks: int = 1  # model chunks per rank (interleaved: v; ZB-V: 2)
    first_less: int = 0  # layers fewer on the first chunk, for the embedding (torchtitan's, Llama 3's)
    last_less: int = 0  # and on the last, for the output layer and the loss
    flash: bool = True
    value_bytes: int = 2  # of weights and activations: 2 in bf16 training, 4 in fp32
    fused: bool = True  # element-wise ops fused (Megatron-LM, torch.compile) or eager
    dp_overlap: bool = True  # DDP's buckets and FSDP's prefetch hidden behind compute
    sequence_parallel: bool = True  # with TP: norms and dropout on a slice of the sequence
    free_stage_outputs: bool = True  # a stage's output freed once sent (stage_memory)
    offload: bool = False  # optimizer states and step in host memory (ZeRO-Offload)
    cp_impl: str = "ring"  # ring attention (labkit's), or "allgather" of K and V (Llama 3's)

    @property
    def devices(self) -> int:
        return self.tp * self.pp * self.cp * self.dp

    @property
    def microbatches(self) -> int:
        return max(1, self.global_batch // (self.dp * self.micro_batch))

    @property
    def v(self) -> int:
        return pm.chunks_per_rank(self.schedule, self.chunks)


@dataclass(frozen=True)
class Operators:
    """Operators one rank launches, counted (:class:`labkit.comm.counter.CommCounter` counts them in
    a run): per micro-batch's forward and backward, and per optimizer step; those on DTensors apart,
    as each pays DTensor's sharding propagation on the host. What an overhead-bound step (a small
    model, a CPU) is made of; on a GPU, kernels queue ahead of the host and these cost nothing."""

    micro_batch: float = 0.0
    micro_batch_dtensor: float = 0.0
    step: float = 0.0
    step_dtensor: float = 0.0

    def seconds(self, hw: Hardware, which: str) -> float:
        plain, dtensor = (self.micro_batch, self.micro_batch_dtensor) if which == "micro_batch" else (
            self.step, self.step_dtensor)
        return plain * hw.op_overhead_s + dtensor * hw.dtensor_op_overhead_s


NO_OPERATORS = Operators()


