"""Refuse a run that cannot fit before it starts: an impossible model fails in one line, not in the
allocator (a traceback) or by growing towards the OOM killer.

A lower bound, so that only impossible runs are refused: the model states of mixed-precision (or
fp32) Adam, 16 bytes per parameter, held once across all ranks whatever the sharding (on one
machine the shards add up to the whole), plus each local rank's activations at its micro-batch
(:func:`labkit.memory.calculator.activation_bytes_per_layer`, GPT's count, fused attention). On a
CPU the budget is the machine's available memory (``MemAvailable``); on CUDA one device's memory,
the states divided over the ranks (the most sharding can do).
"""
from __future__ import annotations

from labkit.core.devices import available_bytes
from labkit.core.model import GPT, GPTConfig
from labkit.memory.calculator import GB, activation_bytes_per_layer
from labkit.train.config import TrainConfig


def check_fits(cfg: TrainConfig, model: GPTConfig, world: int, local_ranks: int) -> None:
    """A ValueError naming the sizes when even the lower bound of the module docstring exceeds the
    memory there is."""
    available = available_bytes(cfg.device)
    if available is None:
        return
    states = 16 * GPT.count_params(model)
    rows = max(1, cfg.batch_size // world)
    act = model.n_layer * activation_bytes_per_layer(model.block_size, rows, model.n_embd, model.n_head, dropout=False,
                                                     flash_attention=True, dtype_bytes=4)
    need = states + local_ranks * act if cfg.device == "cpu" else states / world + act
    if need > available:
        where = "this machine has available" if cfg.device == "cpu" else "one GPU has"
        raise ValueError(f"this run needs at least {need / GB:,.1f} GB ({states / GB:,.1f} GB of model states for "
                         f"{GPT.count_params(model):,} parameters, {act / GB:,.1f} GB of activations per rank) and "
                         f"{where} {available / GB:,.1f} GB: make n_layer, n_embd, batch_size or block_size smaller "
                         "(python -m labkit.planning memory estimates a layout)")
