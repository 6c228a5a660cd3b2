"""Planted bug, tensor_parallel: every rank adds the output bias, so the sum counts it t times."""
# -- grade_id: tp_mlp_split --
import torch
from torch.nn.functional import gelu, linear


def shard_mlp(w1, b1, w2, b2, t):
    hidden = w1.shape[0]
    if t < 1 or hidden % t:
        raise ValueError(f"t={t} must be a positive divisor of the hidden width {hidden}")
    k = hidden // t
    return [dict(w1=w1[r * k:(r + 1) * k], b1=b1[r * k:(r + 1) * k], w2=w2[:, r * k:(r + 1) * k], b2=b2)
            for r in range(t)]


def rank_forward(x, shard):
    return linear(gelu(linear(x, shard["w1"], shard["b1"])), shard["w2"], shard["b2"])
