"""One step of a pipeline on this rank: the schedule's forward and backward, and the microbatches' loss.

:class:`Pipeline` is what the training loop calls instead of its own forward and backward when the
layers are split into stages (:mod:`labkit.parallel.pipeline.stages` defines the stages and the
schedules). The first stage feeds the rows, the last scores them; what the others return is zero.
Every stage's forwards and backwards are recorded on ``timeline`` (the bubble is measured there) and
the bytes kept for backward on ``meter``.
"""
from __future__ import annotations

import torch
import torch.nn as nn

from labkit.parallel.pipeline import stages as pipe
from labkit.parallel.pipeline.timeline import ActivationMeter, Timeline

AUTOCAST = {"bf16": torch.bfloat16, "fp16": torch.float16}


class Pipeline:
    """This rank's stages under a schedule: ``forward_backward(x, y)`` runs one step's microbatches.

    ``micro_shape``: (rows, tokens, tokens between stages, hidden, vocab) of one microbatch.
    ``impl``: ``"torch"`` (``torch.distributed.pipelining``) or ``"scratch"`` (the hand-written
    schedules, one stage per rank). ``precision`` sets the logits' dtype the last stage sends back.
    ``param_dtype``: the dtype FSDP2's mixed precision computes in (bf16 under ``fsdp_bf16``): the stages
    then hand on that dtype, activations and logits alike; None: fp32 activations, autocast's logits.
    """

    def __init__(self, stages: list[pipe.GPTStage], module: nn.Module, n_stages: int, pp_rank: int, pp: int,
                 group, device: torch.device, schedule: str, microbatches: int, micro_shape: tuple,
                 precision: str, impl: str = "torch", param_dtype: torch.dtype | None = None) -> None:
        self.stages, self.module, self.pp, self.impl = stages, module, pp, impl
        self.schedule_name, self.microbatches, self.micro_shape, self.group = schedule, microbatches, micro_shape, group
        self.meter = ActivationMeter(module)
        self.timeline = Timeline(pp_rank, device, self.meter)
        self.device, self.loss_scale, self.scaled = device, 1.0, False
        # autocast keeps the residual stream in fp32 (its adds take the fp32 input) and returns the head's
        # logits in its own dtype; FSDP2's bf16 parameters compute every layer, the adds too, in bf16
        self.act_dtype = param_dtype or torch.float32
        logits = param_dtype or AUTOCAST.get(precision, torch.float32)
        if impl == "torch":
            self.schedule = pipe.build_schedule(stages, n_stages, device, self.timeline, microbatches, schedule,
                                                micro_shape, logits, self._loss, group, self.act_dtype)

    @property
    def first(self) -> pipe.GPTStage | None:
        return self.stages[0] if self.stages[0].first else None

    @property
    def last(self) -> pipe.GPTStage | None:
        return self.stages[-1] if self.stages[-1].last else None

    def _loss(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        loss = pipe.lm_loss(logits, targets)
        return loss * self.loss_scale if self.scaled else loss

    def forward_backward(self, x: torch.Tensor, y: torch.Tensor, loss_scale: float | None = None,
                         weight: float = 1.0) -> torch.Tensor:
        """Every microbatch's forward and backward; on the last stage the mean loss of this rank's rows
        times ``weight`` (their share of the global batch's tokens, which each microbatch's loss is
        multiplied by), zero elsewhere. ``loss_scale``: fp16's, multiplied in too."""
        fp16 = loss_scale or 1.0
        self.scaled, self.loss_scale = loss_scale is not None or weight != 1.0, fp16 * weight
        losses: list[torch.Tensor] = []
        with self.meter:
            if self.impl == "scratch":
                mb = self.micro_shape[0]
                losses = pipe.scratch_step(self.stages[0], self.schedule_name, self.pp, list(x.split(mb)),
                                           list(y.split(mb)), self.timeline, self.micro_shape[0:1] + self.micro_shape[2:4],
                                           self.act_dtype, group=self.group, loss_scale=self.loss_scale)
                if self.last is None:
                    return torch.zeros((), device=self.device)
                mean = torch.stack(losses).mean()
                return mean * weight if weight != 1.0 else mean
            kwargs = {"target": y, "losses": losses} if self.last is not None else {}
            kwargs["return_outputs"] = False  # else the last stage keeps every microbatch's logits
            self.schedule.step(*((x,) if self.first is not None else ()), **kwargs)
        if self.last is None:
            return torch.zeros((), device=self.device)
        return torch.stack(losses).mean() / fp16  # the losses carry the weight


def sum_tied_copies(tied: nn.Parameter, pipeline: Pipeline, ends_group) -> None:
    """The tied embedding / head matrix's two gradients summed into both copies, so they stay equal
    (Megatron-LM's embedding group): the first and last stage each hold the matrix, on two ranks
    (all-reduced over ``ends_group``) or, in a V, both on this one."""
    import torch.distributed as dist

    g = tied.grad
    if g is None:
        return
    last = pipeline.last
    if pipeline.first is not None and last is not None:  # both copies here (a V): add them
        g.add_(last.head.weight.grad)
        last.head.weight.grad.copy_(g)
    else:
        dist.all_reduce(g.to_local() if hasattr(g, "to_local") else g, group=ends_group)
