"""Planted bug, long_context_experts: the second chunk is 2C - r instead of 2C - 1 - r."""
# -- grade_id: lce_zigzag --
import math


def zigzag_tokens(seq_len, C, r):
    if seq_len % (2 * C):
        raise ValueError(f"seq_len={seq_len} must be divisible by 2 x C = {2 * C}")
    n = seq_len // (2 * C)
    return [*range(r * n, (r + 1) * n), *range(((2 * C - r) % (2 * C)) * n, ((2 * C - r) % (2 * C) + 1) * n)]


def expert_capacity(tokens, experts, top_k, factor):
    return math.ceil(factor * top_k * tokens / experts)


def bias_update(bias, load, gamma):
    mean = sum(load) / len(load)
    return [b - gamma if n > mean else b + gamma if n < mean else b for b, n in zip(bias, load)]
