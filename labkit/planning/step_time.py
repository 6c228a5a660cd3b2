"""How long one training step of a configuration takes, roughly: compute plus what communication exposes.

The strategy chooser (:mod:`labkit.planning.choose`) ranks the configurations that fit by this
estimate rather than by bytes alone. It is a first-order model, stated so that it can be argued with:

* **Compute**: 6 FLOPs per parameter per token (Kaplan et al. 2020), 8 with full recomputation
  (Korthikanti et al. 2022), over the ``tp x pp`` devices of one model replica, at ``hfu`` of the
  device's dense bf16 peak. That is hardware FLOPs utilisation (every FLOP run, recomputation
  included; Chowdhery et al. 2022, appendix B), the rate a device sustains whatever the FLOPs are
  for; model FLOPs utilisation (MFU, 6ND only) then falls by 6/8 under full recomputation.
* **Data parallelism**: each rank sends 2(N-1)/N of the 16-bit gradients per step under DDP and
  ZeRO-1/2, 3(N-1)/N under ZeRO-3 (Rajbhandari et al. 2020, section 7), over NVLink inside a node
  and InfiniBand across nodes. Buckets overlap it with backward (two thirds of the compute), so only
  what backward cannot hide is exposed.
* **Tensor parallelism**: Megatron-LM's four all-reduces of ``b x s x h`` 16-bit activations per
  layer per micro-batch (Shoeybi et al. 2019), 2(t-1)/t of them sent per rank over NVLink, not hidden;
  sequence parallelism replaces them by all-gathers and reduce-scatters of the same volume
  (Korthikanti et al. 2022). Not counted here: the recomputed forward's collectives under full
  recomputation (:mod:`labkit.planning.step_model` counts them), nor any attention FLOPs.
* **Pipeline parallelism**: the 1F1B bubble (p-1)/(m+p-1) of the step, ``m`` the micro-batches.
* **Optimizer offload**: 16-bit gradients to the host and parameters back, over PCIe, every step
  (Ren et al. 2021), not hidden.
* **Context parallelism**: a replica spans ``tp x pp x cp`` devices; every layer sends the rank's 16-bit
  K and V round the ring, ``cp - 1`` hops each way in forward and backward (plus the dK, dV
  accumulators), over NVLink, counted as not hidden (a bound: ring attention overlaps much of it).
* **Expert parallelism**: compute is 6 FLOPs per *active* parameter per token; every MoE layer makes
  four all-to-alls of ``top_k x tokens x hidden`` 16-bit values, ``(ep-1)/ep`` of them sent, not hidden.
"""
from __future__ import annotations

from labkit.comm.ring import ring_bytes_per_rank
from labkit.memory.calculator import ModelShape
from labkit.parallel.cp_layout import cp_comm_bytes
from labkit.parallel.pipeline_timeline import bubble_formula
from labkit.parallel.tensor_parallel import comm_bytes_per_layer
from labkit.planning.accelerators import accelerator, interconnect


def step_seconds(shape: ModelShape, n_devices: int, sequences: int, micro_batch: int, seq_len: int, stage: int,
                 recompute: str, offload: bool, tp: int, pp: int, device: str, hfu: float = 0.4,
                 devices_per_node: int = 8, cp: int = 1, ep: int = 1) -> dict[str, float]:
    """The parts of one step's time, in seconds, and their ``total``, per the module docstring:
    ``sequences`` of ``seq_len`` tokens per model replica per step (one replica on ``tp x pp`` devices,
    ``n_devices / (tp x pp)`` replicas), in micro-batches of ``micro_batch``."""
    dp = n_devices // (tp * pp)  # ranks holding copies of the parameters (context-parallel ones too)
    microbatches = max(1, sequences // micro_batch)
    peak = accelerator(device).peak_bf16_tflops * 1e12 * hfu
    compute = (8 if recompute == "full" else 6) * shape.active_params * sequences * seq_len / (tp * pp * cp) / peak
    nvlink = interconnect("nvlink4").gb_per_s * 1e9
    layers = shape.n_layer / pp * microbatches
    kv = cp_comm_bytes("ring", micro_batch, shape.n_kv_heads, seq_len, shape.d_head, cp, 2, 2) if cp > 1 else None
    cp_comm = (kv["forward"] + kv["backward"]) * layers / nvlink if kv else 0.0
    tokens = micro_batch * seq_len / cp
    ep_comm = (4 * shape.experts_per_token * tokens * shape.hidden * 2 * (ep - 1) / ep * layers / nvlink
               if ep > 1 else 0.0)
    dp_link = interconnect("nvlink4" if n_devices <= devices_per_node else "ib-ndr").gb_per_s * 1e9
    grads16 = 2 * shape.n_params / (tp * pp)
    dp_comm = (3 if stage == 3 else 2) * grads16 * (dp - 1) / dp / dp_link if dp > 1 else 0.0
    tp_payload = comm_bytes_per_layer(micro_batch, seq_len, shape.hidden, dtype_bytes=2)
    tp_comm = (ring_bytes_per_rank(tp_payload, tp) * shape.n_layer / pp * microbatches
               / (interconnect("nvlink4").gb_per_s * 1e9)) if tp > 1 else 0.0
    offload_comm = 2 * grads16 / (interconnect("pcie4").gb_per_s * 1e9) / dp if offload else 0.0
    busy = compute + max(0.0, dp_comm - 2 / 3 * compute) + tp_comm + offload_comm + cp_comm + ep_comm
    bubble = bubble_formula(pp, microbatches) if pp > 1 else 0.0
    return {"compute": compute, "data_parallel": dp_comm, "tensor_parallel": tp_comm, "offload": offload_comm,
            "context_parallel": cp_comm, "expert_parallel": ep_comm, "bubble": bubble, "total": busy / (1 - bubble)}
