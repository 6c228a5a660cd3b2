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
    peak_bf16_tflops: float  # dense, no sparsity
    price_on_demand: float  # USD per device-hour: an assumption, override it
    price_spot: float
    source: str


# Peak figures are the vendors' datasheet numbers (dense BF16 tensor core). Prices are
# assumptions typical of public cloud list prices per GPU-hour in 2024-2025; pass your own.
ACCELERATORS = {
    "a100-80gb": Accelerator("NVIDIA A100 80GB SXM", 80, 312, 4.10, 1.60,
                        "NVIDIA A100 datasheet: 312 TFLOP/s dense BF16"),
    "h100-80gb": Accelerator("NVIDIA H100 80GB SXM", 80, 989, 6.90, 2.80,
                        "NVIDIA H100 datasheet: 989 TFLOP/s dense BF16"),
}


def accelerator(name: str) -> Accelerator:
    """The entry of ``ACCELERATORS`` called ``name``; a ValueError listing them otherwise."""
    return ACCELERATORS[one_of("device", name, sorted(ACCELERATORS), "devices")]


@dataclass(frozen=True)
class Interconnect:
    name: str
    gb_per_s: float  # per GPU and per direction, GB/s (1e9 bytes)
    source: str


# Datasheet rates, per GPU and per direction.
INTERCONNECTS = {
    "nvlink4": Interconnect("NVLink (in a node)", 450.0, "NVIDIA H100 SXM datasheet: NVLink 900 GB/s, both "
                            "directions together"),
    "ib-ndr": Interconnect("InfiniBand NDR (between nodes)", 50.0, "NVIDIA ConnectX-7 / NDR: 400 Gb/s per port, "
                           "one port per GPU"),
}


def interconnect(name: str) -> Interconnect:
    """The entry of ``INTERCONNECTS`` called ``name``; a ValueError listing them otherwise."""
    return INTERCONNECTS[one_of("link", name, sorted(INTERCONNECTS), "links")]
