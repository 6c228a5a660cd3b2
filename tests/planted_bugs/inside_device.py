"""Planted bug, inside_device: the merge adds the two sums of exponentials directly.

Right on paper and on small scores, but exp overflows in fp32 once scores pass about 88: the
hidden test's large scores must catch it (log-sum-exp exists to avoid exactly this).
"""
# -- grade_id: dev_merge --
import torch


def merge(out, lse, o_b, lse_b):
    new = torch.log(torch.exp(lse) + torch.exp(lse_b))
    return (out * torch.exp(lse - new)[..., None]
            + o_b * torch.exp(lse_b - new)[..., None]), new
