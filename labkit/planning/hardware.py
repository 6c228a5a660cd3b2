"""What an accelerator and its links achieve, as the step-time model needs them, each with its source.

Datasheets give peaks; a training step runs at what kernels and collectives achieve. Every constant
the model of :mod:`labkit.planning.step_model` uses is here, named, per accelerator, with where it
comes from, and none is fitted to the published runs the model is held against
(:mod:`labkit.planning.published`):

* ``matmul_efficiency``: the share of the dense bf16 peak a large GEMM reaches: the "maximum
  achievable matmul FLOPS" of Bekman's ML Engineering book (``compute/accelerator/README.md``, a
  search over GEMM shapes with ``mamf-finder.py``): H100 SXM 792.1 of 989 (80.1%; the course's field
  notes saw 790 on an H200, the same GH100 die, from one 8192-square ``torch.matmul``), A100 SXM
  267.9 of 312 (85.9%), MI300X 781.9 of 1300 (60.1%). None was measured by this project's code: no GPU
  has run it yet, and ``make gpu-check`` measures the card it runs on. The L4 and L40S are assumed at
  the H100's share. The best shape's rate, not a step's: a training run sustains less (the published
  runs say how much, :mod:`labkit.planning.published`).
* ``attention_efficiency``: what FlashAttention-2 reaches in forward plus backward, head dim 128,
  counted as its paper counts (Dao 2023, Fig. 4: about 190 of 312 TFLOP/s on an A100; on an H100
  its forward plateaus at 350-370 of 989 and its backward is slower: Shah et al. 2024,
  FlashAttention-3, Fig. 5, the FlashAttention-2 bars), 0.61 and 0.34 of peak.
* ``hbm_efficiency``: the share of the datasheet memory bandwidth a streaming kernel reaches, for
  the memory-bound ops (norms, activations, residual adds, the loss, the optimizer step): an
  assumption of 0.85, stated so that it can be replaced by a measurement.
* Links: NCCL's own latency model (``src/graph/tuning.cc``, the Simple protocol: 8.4 us to start a
  collective and 3.4 us per ring step over NVLink, 14 us per step across the network) and a bus
  bandwidth (nccl-tests' ``busbw``, what a ring moves per rank per second): nccl-tests' reference
  figure where one is published (8 A100s: 230-250 GB/s), otherwise an assumed share of the line
  rate (80% of NVLink 4 without NVLink SHARP, 90% of a NIC), said in each link's ``source``.
"""
from __future__ import annotations

from dataclasses import dataclass

from labkit.core.checks import one_of
from labkit.device.roofline import Roof

NCCL_BASE_LATENCY_S = 8.4e-6  # src/graph/tuning.cc: baseLat, Ring and Tree, Simple protocol
# Optimizer offload (Ren et al. 2021): PCIe 4.0 x16 moves about 32 GB/s a direction (PCI-SIG), 25 achieved
# (an assumption); a two-socket host's 8 DDR channels a socket give ~300 GB/s, shared by 8 GPUs.
PCIE4_GB_PER_S = 25.0
HOST_GB_PER_S = 300.0 / 8


@dataclass(frozen=True)
class Link:
    """One class of link: latency per ring step and achieved bus bandwidth per GPU."""

    name: str
    step_latency_s: float
    busbw_gb_per_s: float  # nccl-tests' busbw: bytes a ring rank sends per second, 1e9 bytes
    source: str


@dataclass(frozen=True)
class Hardware:
    name: str
    peak_tflops: float  # dense bf16, datasheet
    hbm_gb_per_s: float  # datasheet
    matmul_efficiency: float
    attention_efficiency: float
    hbm_efficiency: float
    node: Link  # between the GPUs of one node
    network: Link  # between nodes, per GPU (one NIC per GPU, rail-optimised)
    devices_per_node: int
    source: str
    base_latency_s: float = NCCL_BASE_LATENCY_S  # to start any collective
    pcie_gb_per_s: float = PCIE4_GB_PER_S  # to host memory, per GPU (optimizer offload)
    host_gb_per_s: float = HOST_GB_PER_S  # host memory bandwidth per GPU (offloaded Adam)
    op_overhead_s: float = 0.0  # per operator launched (not modelled on GPUs: kernels are queued ahead)
    dtensor_op_overhead_s: float = 0.0  # per operator on a DTensor (its sharding propagation, on the host)

    @property
    def matmul_flops(self) -> float:
        return self.peak_tflops * 1e12 * self.matmul_efficiency

    @property
    def attention_flops(self) -> float:
        return self.peak_tflops * 1e12 * self.attention_efficiency

    @property
    def bytes_per_s(self) -> float:
        return self.hbm_gb_per_s * 1e9 * self.hbm_efficiency

    def roof(self, achieved: bool = True) -> Roof:
        """The roofline the step model prices ops with: achieved GEMM rate and streaming bandwidth, or
        (``achieved=False``) the datasheet's peaks."""
        if achieved:
            return Roof(f"{self.name}, achieved", self.matmul_flops, self.bytes_per_s,
                        f"{self.matmul_efficiency:.0%} of peak FLOP/s, {self.hbm_efficiency:.0%} of peak bandwidth")
        return Roof(self.name, self.peak_tflops * 1e12, self.hbm_gb_per_s * 1e9, self.source)


_NVLINK3 = Link("NVLink 3 (A100 node)", 3.4e-6, 230.0, "nccl-tests all_reduce on 8 A100 SXM4: busbw 230-250 GB/s; "
                "NCCL tuning.cc: 3.4 us per ring step over NVLink")
_NVLINK4 = Link("NVLink 4 (H100 node)", 3.4e-6, 360.0, "assumed 80% of NVLink 4's 450 GB/s per direction for a ring "
                "(nccl-tests reach 460-480 GB/s with NVLink SHARP); tuning.cc: 3.4 us per step")
_HDR = Link("InfiniBand HDR, 200 Gb/s per GPU", 14e-6, 22.5, "8 x 200 Gb/s HDR per node (Selene, Narayanan "
            "et al. 2021 section 5): 25 GB/s per GPU line rate, 90% of it assumed; tuning.cc: 14 us per step")
_NDR = Link("InfiniBand NDR / RoCE, 400 Gb/s per GPU", 14e-6, 45.0, "one 400 Gb/s NIC per GPU (DGX H100; "
            "Llama 3's RoCE fabric, Dubey et al. 2024 section 3.3): 50 GB/s line rate, 90% of it assumed")

_PCIE4 = Link("PCIe 4.0 x16 between GPUs (no NVLink)", 10e-6, 22.0, "PCI-SIG: 32 GB/s a direction; a ring through "
              "the host's root complexes assumed at 70% (an assumption); latency as NCCL's network step")
_ETH100 = Link("Ethernet, 100 Gb/s per node", 14e-6, 1.4, "a cloud VM's 100 Gb/s shared by 8 GPUs: 12.5 GB/s a node, "
               "90% of it assumed, per GPU")
_XGMI = Link("AMD Infinity Fabric (MI300X node)", 3.4e-6, 300.0, "MI300X datasheet: 7 links of 64 GB/s a direction "
             "to the 7 peers; a ring uses 2 of them, RCCL's all-to-all all 7: 300 GB/s assumed, NVLink 4's latency")

HARDWARE = {
    "a100-80gb": Hardware("NVIDIA A100 80GB SXM", 312.0, 2039.0, 0.80, 0.61, 0.85, _NVLINK3, _HDR, 8,
                          "A100 datasheet: 312 TFLOP/s bf16 dense, 2,039 GB/s HBM2e"),
    "a100-40gb": Hardware("NVIDIA A100 40GB SXM", 312.0, 1555.0, 0.80, 0.61, 0.85, _NVLINK3, _HDR, 8,
                          "A100 datasheet: 312 TFLOP/s bf16 dense, 1,555 GB/s HBM2"),
    "h100-80gb": Hardware("NVIDIA H100 80GB SXM", 989.0, 3350.0, 0.80, 0.34, 0.85, _NVLINK4, _NDR, 8,
                          "H100 datasheet: 989 TFLOP/s bf16 dense, 3.35 TB/s HBM3 (SXM5)"),
    "h200": Hardware("NVIDIA H200 141GB SXM", 989.0, 4800.0, 0.80, 0.34, 0.85, _NVLINK4, _NDR, 8,
                     "H200 datasheet: 989 TFLOP/s bf16 dense, 4.8 TB/s HBM3e"),
    "l4": Hardware("NVIDIA L4 24GB", 121.0, 300.0, 0.80, 0.34, 0.85, _PCIE4, _ETH100, 8,
                   "L4 datasheet: 121 TFLOP/s bf16 dense, 300 GB/s GDDR6, PCIe 4.0 (no NVLink)"),
    "l40s": Hardware("NVIDIA L40S 48GB", 362.0, 864.0, 0.80, 0.34, 0.85, _PCIE4, _NDR, 8,
                     "L40S datasheet: 362 TFLOP/s bf16 dense, 864 GB/s GDDR6, PCIe 4.0 (no NVLink)"),
    "mi300x": Hardware("AMD Instinct MI300X 192GB", 1307.0, 5300.0, 0.60, 0.34, 0.85, _XGMI, _NDR, 8,
                       "MI300X datasheet: 1307 TFLOP/s bf16 dense, 5.3 TB/s HBM3, 7 Infinity Fabric links"),
}


def hardware(name: str) -> Hardware:
    """The entry of ``HARDWARE`` called ``name``; a ValueError listing them otherwise."""
    return HARDWARE[one_of("device", name, sorted(HARDWARE), "devices")]
