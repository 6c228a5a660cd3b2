"""The ZeRO paper's model states against DeepSpeed's own estimators, term by term.

DeepSpeed ships ``estimate_zero2_model_states_mem_needs_all_cold`` (in
``deepspeed.runtime.zero.stage_1_and_2``) and ``estimate_zero3_model_states_mem_needs_all_cold``
(``deepspeed.runtime.zero.stage3``). Without offload they say, per GPU:

* stage 2: 2 Psi + 18 Psi / N,
* stage 3: 4 L + 18 Psi / N (L: the largest layer's parameters),

where the paper (Rajbhandari et al. 2020; :func:`labkit.memory.calculator.zero_model_state_bytes`)
says 2 Psi + (2 + K) Psi / N and (2 + 2 + K) Psi / N with K = 12. The differences:

1. **18 bytes, not 14**: DeepSpeed's multiplier is 2 (16-bit gradients) + 4 (fp32 gradients) +
   4 (fp32 parameters) + 8 (fp32 momentum and variance). The fp32 copy of the gradients, which the
   optimizer step reads, is the 4 Psi / N the paper does not count (its K = 12 is the fp32 master and
   the two moments; 16 = 2 + 2 + 12 in all).
2. **GiB printed as "GB"**: DeepSpeed divides by 2**30 and labels the result GB; the paper's GB are
   10**9 bytes. 29.69 "GB" is 31.9 GB.
3. **Stage 3 reuses stage 2's 18**: DeepSpeed's stage-3 estimate has no term for the 16-bit
   parameter shard, 2 Psi / N that the paper counts; it comes out 2 Psi / N lower on that account.
4. **The largest layer** (stage 3 only): 4 bytes per parameter of the largest layer, which ZeRO-3
   gathers whole while it runs (``largest_layer_memory``; DeepSpeed does not itemise the 4 bytes,
   16-bit weights and their 16-bit gradients would account for them). The paper leaves this
   temporary out.
5. **Buffers**: ``additional_buffer_factor`` (1.5) multiplies only DeepSpeed's host (CPU) memory
   estimate, not the GPU's: without offload the host needs Psi x 4 x GPUs per node x 1.5 bytes
   (each process loads the fp32 model), nothing the paper discusses.

For 7.5B parameters on 8 GPUs at stage 2: the paper 15 GB + 13.1 GB = 28.1 GB = 26.2 GiB; DeepSpeed
15 GB + 16.9 GB = 31.9 GB = 29.7 GiB, which it prints as "29.69GB": the whole 3.5 GiB gap is the
fp32 gradients. At stage 3 (a 219M-parameter largest layer): paper 13.97 GiB, DeepSpeed 16.53 GiB =
13.97 + 3.49 (fp32 gradients) - 1.75 (no parameter shard) + 0.81 (largest layer). The tests hold
these formulas to DeepSpeed's functions themselves.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from labkit.core.checks import non_negative_int, one_of, positive_int
from labkit.memory.calculator import GB, zero_model_state_bytes

GIB = 2**30
DEEPSPEED_BYTES_PER_PARAM = {"16-bit gradients": 2, "fp32 gradients": 4, "fp32 parameters": 4,
                             "fp32 momentum and variance": 8}  # the 18 of DeepSpeed's estimators
PAPER_BYTES_PER_PARAM = {"16-bit gradients": 2, "fp32 parameters": 4, "fp32 momentum and variance": 8}  # 2 + K


def deepspeed_gpu_bytes(n_params: int, n_gpus: int, stage: int, largest_layer_params: int = 0) -> int:
    """DeepSpeed 0.19's estimate of GPU bytes per device without offload, as its code computes it."""
    psi, n = positive_int("n_params", n_params, accept_float=True), positive_int("n_gpus", n_gpus)
    one_of("stage", stage, (2, 3), "stages with a DeepSpeed estimator")
    sharded = int(18 * psi / n)  # DeepSpeed truncates with int(); so does this
    if stage == 2:
        return 2 * psi + sharded
    return 4 * non_negative_int("largest_layer_params", largest_layer_params, accept_float=True) + sharded


def deepspeed_host_bytes(n_params: int, gpus_per_node: int, stage: int, largest_layer_params: int = 0,
                         buffer_factor: float = 1.5) -> int:
    """DeepSpeed's host-memory estimate without offload (stage 3: with ``zero_init``)."""
    per = largest_layer_params if stage == 3 else n_params
    return int(per * 4 * gpus_per_node * buffer_factor)


@dataclass(frozen=True)
class ZeroCrossCheck:
    """Both estimates of the per-GPU model states, in bytes, and the terms between them."""

    n_params: int
    n_gpus: int
    stage: int
    largest_layer_params: int
    paper_bytes: int
    deepspeed_bytes: int
    terms: dict = field(default_factory=dict)  # bytes per GPU: what DeepSpeed adds to the paper's figure
    host_bytes: int = 0

    @property
    def paper_gib(self) -> float:
        return self.paper_bytes / GIB

    @property
    def deepspeed_gib(self) -> float:  # what DeepSpeed prints, labelled "GB"
        return self.deepspeed_bytes / GIB

    @property
    def paper_gb(self) -> float:
        return self.paper_bytes / GB

    @property
    def deepspeed_gb(self) -> float:
        return self.deepspeed_bytes / GB

    def explanation(self) -> list[str]:
        lines = [f"paper (K=12): {self.paper_gb:.1f} GB = {self.paper_gib:.1f} GiB; DeepSpeed: {self.deepspeed_gb:.1f} "
                 f"GB = {self.deepspeed_gib:.2f} GiB, printed as \"{self.deepspeed_gib:.2f}GB\""]
        lines += [f"{'+' if b >= 0 else '-'} {name}: {abs(b) / GIB:.2f} GiB" for name, b in self.terms.items()]
        lines.append(f"DeepSpeed's host memory (with its x1.5 buffer factor; nothing on the GPU): "
                     f"{self.host_bytes / GIB:.2f} GiB")
        return lines


def cross_check_zero(n_params: float = 7.5e9, n_gpus: int = 8, stage: int = 2,
                     largest_layer_params: int = 0, gpus_per_node: int | None = None) -> ZeroCrossCheck:
    """The paper's ZeRO model states and DeepSpeed's estimate for the same model and GPUs, and the
    terms that make up the difference (their sum is the difference, to rounding of whole bytes)."""
    psi = positive_int("n_params", n_params, accept_float=True)
    n = positive_int("n_gpus", n_gpus)
    one_of("stage", stage, (2, 3), "stages with a DeepSpeed estimator")
    layer = non_negative_int("largest_layer_params", largest_layer_params, accept_float=True)
    paper = zero_model_state_bytes(psi, n, stage)
    ds = deepspeed_gpu_bytes(psi, n, stage, layer)
    terms = {"fp32 gradients (4 bytes x Psi / N)": 4 * psi / n}
    if stage == 3:  # DeepSpeed's 18 is stage 2's multiplier: no 16-bit parameter shard at stage 3
        terms["16-bit parameter shard, not in DeepSpeed's 18 (2 bytes x Psi / N)"] = -2 * psi / n
        terms["largest layer gathered whole (4 bytes x its parameters)"] = 4 * layer
    per_node = positive_int("gpus_per_node", gpus_per_node or n)
    return ZeroCrossCheck(psi, n, stage, layer, paper, ds, {k: round(v) for k, v in terms.items()},
                          deepspeed_host_bytes(psi, per_node, stage, layer))
