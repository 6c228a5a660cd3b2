"""Planted bug, activation_checkpointing: the matmuls are saved but not the attention kernel.

Looks right in a list of "expensive ops" and keeps even less memory, but backward re-runs the
fused attention: the FLOP check must catch it.
"""
# -- grade_id: ac_selective_policy --
import torch
from torch.utils.checkpoint import CheckpointPolicy


def selective_policy(ctx, op, *args, **kwargs):
    aten = torch.ops.aten
    expensive = {aten.mm.default, aten.addmm.default, aten.bmm.default}
    return CheckpointPolicy.MUST_SAVE if op in expensive else CheckpointPolicy.PREFER_RECOMPUTE
