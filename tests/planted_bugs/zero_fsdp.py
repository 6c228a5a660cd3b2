"""Planted bug, zero_fsdp: shards of numel // N elements, so the tail is never updated.

Correct when N divides the parameter count (the visible test), wrong otherwise (hidden tests).
"""
# -- grade_id: zf_sharded_step --
import torch


def zero_adam_step(flat_param, grads, states, lr, betas=(0.9, 0.999), eps=1e-8):
    n, numel = len(grads), flat_param.numel()
    shard = numel // n
    reduced = torch.stack(grads).mean(0)
    b1, b2 = betas
    with torch.no_grad():
        for r in range(n):
            g = reduced[r * shard:(r + 1) * shard]
            st = states[r]
            if not st:
                st.update(step=0, exp_avg=torch.zeros(shard), exp_avg_sq=torch.zeros(shard))
            st["step"] += 1
            st["exp_avg"].mul_(b1).add_(g, alpha=1 - b1)
            st["exp_avg_sq"].mul_(b2).addcmul_(g, g, value=1 - b2)
            m_hat = st["exp_avg"] / (1 - b1 ** st["step"])
            v_hat = st["exp_avg_sq"] / (1 - b2 ** st["step"])
            flat_param[r * shard:(r + 1) * shard] -= lr * m_hat / (v_hat.sqrt() + eps)
