"""Planted bug, data_parallel: the buckets are summed over ranks but never divided by the world size.

DDP averages gradients; a sum trains with a learning rate world_size times too large.
"""
# -- grade_id: dp_sync_gradients --
import torch
import torch.distributed as dist


def sync_gradients(params, bucket_cap_bytes):
    grads = [p.grad for p in reversed(list(params)) if p.grad is not None]
    buckets, size = [], 0
    for g in grads:
        nbytes = g.numel() * g.element_size()
        if not buckets or size + nbytes > bucket_cap_bytes:
            buckets.append([])
            size = 0
        buckets[-1].append(g)
        size += nbytes
    for bucket in buckets:
        flat = torch.cat([g.reshape(-1) for g in bucket])
        dist.all_reduce(flat)
        offset = 0
        for g in bucket:
            g.copy_(flat[offset:offset + g.numel()].view_as(g))
            offset += g.numel()
    return len(buckets)
