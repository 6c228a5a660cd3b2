"""Planted bug, finetuning: the merge scales B A by alpha, not alpha / r (right only at r = 1)."""
# -- grade_id: ft_lora_count --
def lora_trainable(shapes, r):
    if isinstance(r, bool) or not isinstance(r, int) or r < 1:
        raise ValueError(f"r must be a positive integer, got {r!r}")
    return sum(r * (fan_in + fan_out) for fan_in, fan_out in shapes)


def merged_weight(W, A, B, alpha, r):
    return W + alpha * (B @ A)
