"""Accelerators the planning tools know: memory, datasheet peak throughput, and assumed prices.

Peaks are the vendors' datasheet figures for dense math (no structured sparsity). Prices are
assumptions, typical of public cloud list prices per GPU-hour; pass your own.
"""
from __future__ import annotations

from dataclasses import dataclass

from labkit.core.checks import one_of


@dataclass(frozen=True)
class Accelerator:
    name: str
    memory_gb: float
    # Datasheet peak TFLOP/s of dense math (no 2:4 sparsity), by the dtype the matmuls run in.
    peak_tflops: dict
    price_on_demand: float  # USD per device-hour: an assumption, override it
    price_spot: float
    source: str
    hbm_tb_per_s: float | None = None  # datasheet memory bandwidth, TB/s (1e12 bytes)
    sms: int | None = None  # streaming multiprocessors (AMD: compute units) of the whole card

    @property
    def peak_bf16_tflops(self) -> float:
        return self.peak_tflops["bf16"]


def _peaks(bf16: float, tf32: float, fp32: float, fp16: float | None = None) -> dict:
    return {"bf16": bf16, "fp16": bf16 if fp16 is None else fp16, "tf32": tf32, "fp32": fp32}


# Vendors' datasheets, dense figures (the sparse ones are twice these). Prices: assumptions typical of
# public cloud list prices per GPU-hour in 2024-2026; pass your own.
ACCELERATORS = {
    "a100-40gb": Accelerator("NVIDIA A100 40GB SXM", 40, _peaks(312, 156, 19.5), 3.00, 1.20,
                             "NVIDIA A100 datasheet (2021): BF16/FP16 312, TF32 156, FP32 19.5 TFLOP/s dense; "
                             "1,555 GB/s", 1.555, 108),
    "a100-80gb": Accelerator("NVIDIA A100 80GB SXM", 80, _peaks(312, 156, 19.5), 4.10, 1.60,
                             "NVIDIA A100 datasheet (2021): BF16/FP16 312, TF32 156, FP32 19.5 TFLOP/s dense; "
                             "2,039 GB/s", 2.039, 108),
    "h100-80gb": Accelerator("NVIDIA H100 80GB SXM", 80, _peaks(989, 495, 67), 6.90, 2.80,
                             "NVIDIA H100 datasheet: BF16/FP16 989, TF32 495, FP32 67 TFLOP/s dense (SXM5); "
                             "3.35 TB/s", 3.35, 132),
    # The same chip with fewer SMs and lower clocks: read as the SXM, MFU on them came out 16-24% low
    "h100-pcie": Accelerator("NVIDIA H100 80GB PCIe", 80, _peaks(756, 378, 51), 5.50, 2.20,
                             "NVIDIA H100 datasheet: BF16/FP16 756, TF32 378, FP32 51 TFLOP/s dense (PCIe); "
                             "2.0 TB/s", 2.0, 114),
    "h100-nvl": Accelerator("NVIDIA H100 NVL 94GB", 94, _peaks(835, 418, 60), 6.00, 2.40,
                            "NVIDIA H100 datasheet: BF16/FP16 835, TF32 418, FP32 60 TFLOP/s dense (NVL); "
                            "3.9 TB/s", 3.9, 132),
    "h200": Accelerator("NVIDIA H200 141GB SXM", 141, _peaks(989, 495, 67), 8.50, 3.50,
                        "NVIDIA H200 datasheet: BF16/FP16 989, TF32 495, FP32 67 TFLOP/s dense (SXM); 4.8 TB/s",
                        4.8, 132),
    "l4": Accelerator("NVIDIA L4 24GB", 24, _peaks(121, 60, 30.3), 0.80, 0.30,
                      "NVIDIA L4 datasheet: BF16/FP16 121, TF32 60, FP32 30.3 TFLOP/s dense; 300 GB/s", 0.3, 58),
    "l40s": Accelerator("NVIDIA L40S 48GB", 48, _peaks(362, 183, 91.6), 2.00, 0.80,
                        "NVIDIA L40S datasheet: BF16/FP16 362, TF32 183, FP32 91.6 TFLOP/s dense; 864 GB/s", 0.864,
                        142),
    "mi300x": Accelerator("AMD Instinct MI300X 192GB", 192, _peaks(1307, 654, 163), 6.00, 2.50,
                          "AMD MI300X datasheet: BF16/FP16 1307, TF32 654, FP32 163 TFLOP/s dense (matrix); "
                          "5.3 TB/s", 5.3, 304),
}


def from_device_name(name: str) -> str | None:
    """The table's key for a CUDA device name (``torch.cuda.get_device_name()``), or None.

    The H100's variants share the name "H100" and differ in peak by a quarter: "H100 PCIe" and "H100 NVL"
    name theirs, the SXM's is "H100 80GB HBM3". A MIG slice's name is its card's with the profile after it
    ("... MIG 1g.10gb"): the card is found here, the slice's share by :func:`device_share`."""
    n = name.upper()
    if "H100" in n:
        return "h100-pcie" if "PCIE" in n else "h100-nvl" if "NVL" in n else "h100-80gb"
    for key, needle in (("h200", "H200"), ("l40s", "L40S"), ("l4", "L4"), ("mi300x", "MI300X")):
        if needle in n:
            return key
    if "A100" in n:
        return "a100-40gb" if "40GB" in n.replace(" ", "") else "a100-80gb"
    return None


def device_share(key: str, sms: int | None) -> float:
    """The share of the datasheet's card a device holds: its SMs over the card's (1 for a whole GPU). A
    MIG slice's name says its profile but not its SMs (a 1g slice of an H100 has 16 of the 132, not
    1/7 of them), so the count torch reports is the scale (``multi_processor_count``)."""
    full = ACCELERATORS[key].sms
    return min(1.0, sms / full) if sms and full else 1.0


def datasheet(name: str, sms: int | None = None, memory_gb: float | None = None) -> dict | None:
    """What labkit reads for the device called ``name`` with ``sms`` SMs and ``memory_gb`` of memory:
    its table key, the share of the card it is, its dense peaks (TFLOP/s by dtype) and memory bandwidth
    (TB/s) scaled to that share; None for a device the table does not know. A MIG slice's bandwidth
    scales with its memory slices, which is what its memory size counts."""
    key = from_device_name(name)
    if key is None:
        return None
    a, share = ACCELERATORS[key], device_share(key, sms)
    mem_share = min(1.0, memory_gb / a.memory_gb) if memory_gb and share < 1 else share
    return {"key": key, "share": share, "peak_tflops": {k: v * share for k, v in a.peak_tflops.items()},
            "hbm_tb_per_s": a.hbm_tb_per_s * mem_share if a.hbm_tb_per_s else None, "source": a.source}


def accelerator(name: str) -> Accelerator:
    """The entry of ``ACCELERATORS`` called ``name``; a ValueError listing them otherwise."""
    return ACCELERATORS[one_of("device", name, sorted(ACCELERATORS), "devices")]


@dataclass(frozen=True)
class Interconnect:
    name: str
    gb_per_s: float  # per GPU and per direction, GB/s (1e9 bytes)
    source: str


# Datasheet rates, per GPU and per direction. The three the planners use first; then, for the
# communication chapter's table, the generations a reader meets (vendors' and standards' figures).
INTERCONNECTS = {
    "nvlink4": Interconnect("NVLink (in a node)", 450.0, "NVIDIA H100 SXM datasheet: NVLink 900 GB/s, both "
                            "directions together"),
    "ib-ndr": Interconnect("InfiniBand NDR (between nodes)", 50.0, "NVIDIA ConnectX-7 / NDR: 400 Gb/s per port, "
                           "one port per GPU"),
    "pcie4": Interconnect("PCIe 4.0 x16 (to host memory)", 25.0, "PCI-SIG: 16 GT/s x 16 lanes, about 32 GB/s per "
                          "direction; about 25 GB/s achieved (an assumption)"),
    "nvlink2": Interconnect("NVLink 2 (V100)", 150.0, "NVIDIA V100 datasheet: 300 GB/s, both directions together"),
    "nvlink3": Interconnect("NVLink 3 (A100)", 300.0, "NVIDIA A100 datasheet: 600 GB/s, both directions together"),
    "nvlink5": Interconnect("NVLink 5 (B200)", 900.0, "NVIDIA Blackwell datasheet: 1.8 TB/s, both directions "
                            "together"),
    "pcie3-x16": Interconnect("PCIe 3.0 x16", 15.75, "PCI-SIG: 8 GT/s x 16 lanes, 128b/130b encoding"),
    "pcie4-x16": Interconnect("PCIe 4.0 x16", 31.5, "PCI-SIG: 16 GT/s x 16 lanes, 128b/130b encoding"),
    "pcie5-x16": Interconnect("PCIe 5.0 x16", 63.0, "PCI-SIG: 32 GT/s x 16 lanes, 128b/130b encoding"),
    "ib-hdr": Interconnect("InfiniBand HDR", 25.0, "NVIDIA ConnectX-6: 200 Gb/s per port"),
    "ib-xdr": Interconnect("InfiniBand XDR", 100.0, "NVIDIA ConnectX-8 / Quantum-X800: 800 Gb/s per port"),
    "roce-100": Interconnect("RoCE, 100 GbE", 12.5, "IEEE 802.3 100 Gb/s Ethernet, RDMA over Converged Ethernet"),
    "roce-400": Interconnect("RoCE, 400 GbE", 50.0, "IEEE 802.3 400 Gb/s Ethernet, RDMA over Converged Ethernet"),
    "eth-10": Interconnect("Ethernet, 10 GbE (TCP)", 1.25, "IEEE 802.3 10 Gb/s"),
    "eth-25": Interconnect("Ethernet, 25 GbE (TCP)", 3.125, "IEEE 802.3 25 Gb/s"),
}


def interconnect(name: str) -> Interconnect:
    """The entry of ``INTERCONNECTS`` called ``name``; a ValueError listing them otherwise."""
    return INTERCONNECTS[one_of("link", name, sorted(INTERCONNECTS), "links")]
