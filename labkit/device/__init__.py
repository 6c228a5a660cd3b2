"""Inside one device: rooflines, fusion, FlashAttention from scratch, FP8 emulated on any device.

What decides how fast one device does its share of a step, whatever the layout around it.
"""
from labkit.device.roofline import Op, Roof, block_ops, matmul

__all__ = ["Op", "Roof", "block_ops", "matmul"]
