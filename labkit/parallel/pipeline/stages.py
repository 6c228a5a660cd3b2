"""Pipeline parallelism: the GPT's layers split into stages, one per rank, fed by microbatches.

GPipe (Huang et al. 2019) runs every microbatch's forward through the stages, then every backward:
with ``p`` stages and ``m`` microbatches a stage idles ``(p - 1) / (m + p - 1)`` of the step (the
*bubble*), and holds all ``m`` microbatches' activations before its first backward. 1F1B
(PipeDream-Flush, Narayanan et al. 2021, section 2.2.1) has the same bubble but alternates one
forward with one backward once the pipeline is full, so stage ``s`` holds at most ``p - s``.
Interleaving ``v`` chunks of layers per rank divides the bubble by ``v`` (same paper, section 2.2.2).

* The production path: ``torch.distributed.pipelining`` (PyTorch docs, "Pipeline Parallelism"):
  a :class:`TimedStage` (a ``PipelineStage`` that records when it computes) per stage and
  ``ScheduleGPipe``, ``Schedule1F1B``, ``ScheduleInterleaved1F1B`` or a zero-bubble schedule
  (``ScheduleInterleavedZeroBubble``, ``ScheduleZBVZeroBubble``, ``ScheduleDualPipeV``).
* For teaching, :func:`scratch_step`: the same two schedules with paired sends and receives of
  activations forward and of their gradients backward, held against the production path.

The first and last stages both hold the tied embedding / head matrix; like Megatron-LM's
"embedding group" the two copies' gradients are summed after every backward so they stay equal.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from labkit.comm.p2p import exchange
from labkit.core.model import GPT, GPTConfig
from labkit.parallel.pipeline.timeline import Timeline

from labkit.parallel.pipeline.split import (  # noqa: F401 (the names this module has always given)
    IMPLS, MULTI, PP_SCHEDULES, V_SHAPED, VIRTUAL, ZERO_BUBBLE, Split, check_pp, stage_bounds, stage_indices)


class GPTStage(nn.Module):
    """Layers ``[lo, hi)`` of a GPT; the embeddings on the first stage, final norm and head on the last.

    Computes exactly what :meth:`labkit.core.model.GPT.forward` computes for those layers; submodule
    names are the GPT's (``blocks.3.attn.qkv.weight``), so state dicts merge back into the model's.
    """

    def __init__(self, model: GPT, index: int, n_stages: int, first_less: int = 0, last_less: int = 0) -> None:
        super().__init__()
        lo, hi = stage_bounds(model.config.n_layer, n_stages, first_less, last_less)[index]
        self.index, self.first, self.last = index, index == 0, index == n_stages - 1
        if self.first:
            self.wte, self.wpe, self.drop = model.wte, model.wpe, model.drop
        self.blocks = nn.ModuleDict({str(i): model.blocks[i] for i in range(lo, hi)})
        if self.last:  # on its own the head keeps a copy of the tied matrix (synced: see tied_grad_sync)
            self.ln_f, self.head = model.ln_f, model.head
        self.config = model.config
        self.positions: torch.Tensor | None = None  # as GPT.positions: context parallelism's zig-zag
        # The dtype the stage hands on (activations, or the last stage's logits): what the pipeline's
        # receive buffers were declared with (build_schedule). None: whatever the layers computed.
        self.out_dtype: torch.dtype | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.first:
            pos = self.positions if self.positions is not None else torch.arange(x.shape[1], device=x.device)
            x = self.drop(self.wte(x) + self.wpe(pos))
        for block in self.blocks.values():
            x = block(x)
        out = self.head(self.ln_f(x)) if self.last else x
        return out if self.out_dtype in (None, out.dtype) else out.to(self.out_dtype)


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """The GPT's loss: mean cross-entropy over a microbatch's tokens, in fp32 (as autocast computes it)
    whatever the logits' dtype: bf16 logits (FSDP2's bf16 parameters) would round the loss itself to
    bf16, 0.03 apart near 5, and hand the other stages a bf16 loss where they hold fp32."""
    return F.cross_entropy(logits.float().view(-1, logits.size(-1)), targets.view(-1))


def schedule_order(schedule: str, p: int, s: int, m: int) -> list[tuple[str, int]]:
    """The (kind, microbatch) actions stage ``s`` of ``p`` runs: GPipe all F then all B; 1F1B
    ``p - s - 1`` warm-up forwards, then one forward and one backward alternately, then the rest."""
    if schedule == "gpipe":
        return [("F", i) for i in range(m)] + [("B", i) for i in range(m)]
    if schedule != "1f1b":
        raise ValueError(f"pp_schedule={schedule!r} has no hand-written order; valid: ['gpipe', '1f1b']")
    warm = min(p - s - 1, m)
    order = [("F", i) for i in range(warm)]
    for j in range(m - warm):
        order += [("F", warm + j), ("B", j)]
    return order + [("B", j) for j in range(m - warm, m)]


def scratch_step(stage: GPTStage, schedule: str, p: int, xs: list, ys: list, timeline: Timeline,
                 act_shape: tuple, act_dtype: torch.dtype, group=None, loss_scale: float = 1.0) -> list[torch.Tensor]:
    """One step of the pipeline on this stage's rank, written with point-to-point messages.

    Between two actions a stage sends what the last one produced (an activation to the next stage,
    or a gradient to the previous) and receives what the next one needs, as one group
    (:func:`labkit.comm.p2p.exchange`; Megatron-LM's ``send_forward_recv_backward`` and its
    siblings). In 1F1B's steady state stage s sends activation k+1 while stage s+1 sends gradient k:
    posted one after the other, both sends would wait for receives never posted under NCCL. The
    loss of each microbatch is divided by ``m``: the step's gradient is that of the global-batch
    mean (times ``loss_scale`` under fp16 loss scaling). Returns the last stage's microbatch losses.
    """
    s, m = stage.index, len(xs)
    peer = (lambda r: dist.get_global_rank(group, r)) if group is not None else (lambda r: r)
    inputs, outputs, losses, sends = {}, {}, [], []
    for kind, i in schedule_order(schedule, p, s, m):
        needs = None  # the activation (F) or the gradient (B) a neighbour must send first
        if (kind == "F" and not stage.first) or (kind == "B" and not stage.last):
            needs = torch.empty(act_shape, dtype=act_dtype, device=xs[i].device)
        exchange(sends, [] if needs is None else [(needs, peer(s - 1 if kind == "F" else s + 1))], group)
        sends = []
        if kind == "F":
            x = xs[i] if stage.first else needs.requires_grad_()
            with timeline.record("F", i):
                out = stage(x)
                if stage.last:
                    out = lm_loss(out, ys[i])
            if stage.last:
                losses.append(out.detach())
            else:
                sends.append((out.detach(), peer(s + 1)))
            inputs[i], outputs[i] = x, out
        else:
            with timeline.record("B", i):
                out = outputs.pop(i)
                if stage.last:
                    (out / m if loss_scale == 1.0 else out * (loss_scale / m)).backward()
                else:
                    out.backward(needs)
            x = inputs.pop(i)
            if not stage.first:
                sends.append((x.grad, peer(s - 1)))
    exchange(sends, [], group)
    return losses


def _timed_stage_class():
    from torch.distributed.pipelining import PipelineStage

    class TimedStage(PipelineStage):
        """A ``PipelineStage`` that records each microbatch's forward and backward on a :class:`Timeline`
        (the schedules call exactly these two methods; communication waits happen outside them)."""

        def __init__(self, *args, timeline: Timeline, **kwargs) -> None:
            super().__init__(*args, **kwargs)
            self.timeline = timeline

        def forward_one_chunk(self, fwd_chunk_id, *args, **kwargs):
            with self.timeline.record("F", fwd_chunk_id):
                return super().forward_one_chunk(fwd_chunk_id, *args, **kwargs)

        def backward_one_chunk(self, bwd_chunk_id, *args, **kwargs):
            with self.timeline.record("B", bwd_chunk_id):
                return super().backward_one_chunk(bwd_chunk_id, *args, **kwargs)

        def backward_weight_one_chunk(self, bwd_chunk_id, *args, **kwargs):  # zero-bubble schedules' W
            with self.timeline.record("W", bwd_chunk_id):
                return super().backward_weight_one_chunk(bwd_chunk_id, *args, **kwargs)

    return TimedStage


def stage_params(cfg: GPTConfig, n_stages: int, index: int, first_less: int = 0, last_less: int = 0) -> int:
    """Parameters stage ``index`` holds: its blocks, plus the embeddings (first) or the final norm
    and a copy of the tied head (last, when it is not also the first)."""
    lo, hi = stage_bounds(cfg.n_layer, n_stages, first_less, last_less)[index]
    C, V, ln = cfg.n_embd, cfg.vocab_size, cfg.n_embd * (1 + int(cfg.bias))
    per_block = (GPT.count_params(cfg) - V * C - cfg.block_size * C - ln) // cfg.n_layer
    n = (hi - lo) * per_block
    n += (V * C + cfg.block_size * C) if index == 0 else 0
    n += (ln + (V * C if n_stages > 1 else 0)) if index == n_stages - 1 else 0
    return n


class RankStages(nn.Module):
    """The stages one rank holds, registered under the GPT's own names (``wte``, ``blocks.3``,
    ``head``...): its state dict is a part of the GPT's, so a checkpoint of every rank's part loads
    into another pipeline layout or into one process, and the parameters keep the GPT's order."""

    def __init__(self, stages: list[GPTStage]) -> None:
        super().__init__()
        self.parts = list(stages)  # not registered: their submodules are, below, under the GPT's names
        self.config = stages[0].config
        first, last = self.first, self.last
        if first is not None:
            self.wte, self.wpe, self.drop = first.wte, first.wpe, first.drop
        self.blocks = nn.ModuleDict({k: b for s in stages for k, b in s.blocks.items()})
        if last is not None:
            self.ln_f, self.head = last.ln_f, last.head

    @property
    def first(self) -> GPTStage | None:
        """The first stage of the pipeline, when this rank holds it."""
        return self.parts[0] if self.parts[0].first else None

    @property
    def last(self) -> GPTStage | None:
        """The last stage of the pipeline, when this rank holds it."""
        return self.parts[-1] if self.parts[-1].last else None


def build_schedule(stages: list[GPTStage], n_stages: int, device: torch.device, timeline: Timeline,
                   microbatches: int, schedule: str, micro_shape: tuple[int, int, int, int, int],
                   logits_dtype: torch.dtype, loss_fn, group: dist.ProcessGroup | None = None,
                   act_dtype: torch.dtype = torch.float32):
    """``torch.distributed.pipelining``'s schedule over this rank's stages, each a :class:`TimedStage`.

    ``micro_shape`` is (rows, tokens, tokens between stages, hidden, vocab) of one microbatch (the
    tokens between stages are fewer under sequence parallelism): the shapes are given up front
    (static mode). Without them a stage infers them on the first step and, measured here, keeps 0.7
    of a microbatch's saved activations alive on stage 0 for the rest of the run; with them the
    activation peaks equal the hand-written pipeline's exactly. ``group``: the pipeline's ranks.

    ``act_dtype`` and ``logits_dtype``: what the stages hand on, the activations (and their gradients)
    and the last stage's logits. Each stage casts its output to them (:attr:`GPTStage.out_dtype`): a
    receive buffer is filled with the bytes the other stage sent, unchecked, so bf16 sent into an fp32
    buffer trains on garbage (FSDP2's bf16 parameters did: loss 4.6e-41 at step 0, NaN weights after).
    """
    import inspect

    from torch.distributed import pipelining

    TimedStage = _timed_stage_class()
    mb, T, S, C, V = micro_shape

    # requires_grad on the example activations: without it the stage sends no gradient back and
    # the stages before it silently never learn (measured: stage 0 got no gradient at all).
    def meta(*shape, dtype=torch.float32):
        return torch.empty(shape, dtype=dtype, device="meta", requires_grad=dtype.is_floating_point)

    # torch 2.11's PipelineStage has no output_grads / input_grads (it infers them): asked by feature
    grads = "output_grads" in inspect.signature(pipelining.PipelineStage.__init__).parameters

    def kwargs(m: GPTStage) -> dict:
        def act():
            return meta(mb, S, C, dtype=act_dtype)

        out = {"input_args": meta(mb, T, dtype=torch.long) if m.first else act(),
               "output_args": meta(mb, T, V, dtype=logits_dtype) if m.last else act()}
        if grads:
            out.update(output_grads=None if m.last else act(), input_grads=None if m.first else act())
        return out

    for m in stages:
        m.out_dtype = logits_dtype if m.last else act_dtype
    timed = [TimedStage(m, m.index, n_stages, device, group=group, timeline=timeline, **kwargs(m)) for m in stages]
    cls = {"gpipe": pipelining.ScheduleGPipe, "1f1b": pipelining.Schedule1F1B,
           "interleaved": pipelining.ScheduleInterleaved1F1B, "zb": pipelining.ScheduleInterleavedZeroBubble,
           "zbv": pipelining.ScheduleZBVZeroBubble, "dualpipev": pipelining.ScheduleDualPipeV}[schedule]
    return cls(timed if len(timed) > 1 else timed[0], microbatches, loss_fn=loss_fn)
