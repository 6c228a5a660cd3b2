"""Pipeline parallelism: the GPT's layers split into stages, one per rank, fed by microbatches.

GPipe (Huang et al. 2019) runs every microbatch's forward through the stages, then every backward:
with ``p`` stages and ``m`` microbatches a stage idles ``(p - 1) / (m + p - 1)`` of the step (the
*bubble*), and holds all ``m`` microbatches' activations before its first backward. 1F1B
(PipeDream-Flush, Narayanan et al. 2021, section 2.2.1) has the same bubble but alternates one
forward with one backward once the pipeline is full, so stage ``s`` holds at most ``p - s``.
Interleaving ``v`` chunks of layers per rank divides the bubble by ``v`` (same paper, section 2.2.2).

* The production path: ``torch.distributed.pipelining`` (PyTorch docs, "Pipeline Parallelism"):
  a :class:`TimedStage` (a ``PipelineStage`` that records when it computes) per stage and
  ``ScheduleGPipe``, ``Schedule1F1B`` or ``ScheduleInterleaved1F1B``.
* For teaching, :func:`scratch_step`: the same two schedules with ``send``/``recv`` of
  activations forward and of their gradients backward, held against the production path.

The first and last stages both hold the tied embedding / head matrix; like Megatron-LM's
"embedding group" the two copies' gradients are summed after every backward so they stay equal.
"""
from __future__ import annotations

import statistics

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from labkit.model import GPT, GPTConfig
from labkit.pp_timeline import ActivationMeter, Event, Timeline, bubble_formula, bubble_fraction

SCHEDULES = ("gpipe", "1f1b", "interleaved")
IMPLS = ("torch", "scratch")
VIRTUAL = {"gpipe": 1, "1f1b": 1, "interleaved": 2}  # layer chunks per rank


def check_pp(pp: int, n_layer: int, microbatches: int, schedule: str, batch_size: int | None = None,
             impl: str = "torch") -> None:
    """Clear errors for a pipeline that cannot be built; call before any communication."""
    if schedule not in SCHEDULES:
        raise ValueError(f"schedule={schedule!r} is unknown; valid schedules: {list(SCHEDULES)}")
    if impl not in IMPLS:
        raise ValueError(f"impl={impl!r} is unknown; valid implementations: {list(IMPLS)}")
    if impl == "scratch" and schedule == "interleaved":
        # impl='scratch' is also what one process (``--strategy pp`` without torchrun) runs
        raise ValueError("schedule='interleaved' needs torch pipelining on several ranks (impl='torch', "
                         "under labkit.launch or torchrun); the hand-written path and one process have "
                         "'gpipe' and '1f1b'")
    for name, v in (("pp", pp), ("microbatches", microbatches)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"{name} must be a positive integer, got {v!r}")
    stages = pp * VIRTUAL[schedule]
    if stages > n_layer:
        raise ValueError(f"pp={pp} with schedule={schedule!r} needs {stages} stages but the model has "
                         f"n_layer={n_layer} layers; use pp <= {n_layer // VIRTUAL[schedule]} or more layers")
    if schedule != "gpipe" and microbatches < pp:
        raise ValueError(f"schedule={schedule!r} needs microbatches >= pp: microbatches={microbatches} < "
                         f"pp={pp} leaves a stage with nothing to alternate; use microbatches >= {pp} or 'gpipe'")
    rounds = max(1, microbatches // pp)
    if schedule == "interleaved" and microbatches % rounds:
        # torch's ScheduleInterleaved1F1B runs the microbatches in rounds of about pp each
        valid = [m for m in range(pp, 4 * pp + 1) if m % max(1, m // pp) == 0]
        raise ValueError(f"schedule='interleaved' needs microbatches divisible by its {rounds} rounds "
                         f"(microbatches // pp); microbatches={microbatches} with pp={pp} is not; valid "
                         f"microbatches up to {4 * pp}: {valid}")
    if batch_size is not None and batch_size % microbatches:
        valid = [d for d in range(1, batch_size + 1) if batch_size % d == 0]
        raise ValueError(f"microbatches={microbatches} must divide batch_size={batch_size}; valid: {valid}")


def stage_bounds(n_layer: int, n_stages: int) -> list[tuple[int, int]]:
    """``[lo, hi)`` layers of each stage: as equal as possible, earlier stages taking the remainder."""
    sizes = [n_layer // n_stages + (i < n_layer % n_stages) for i in range(n_stages)]
    starts = [sum(sizes[:i]) for i in range(n_stages)]
    return [(a, a + n) for a, n in zip(starts, sizes)]


class GPTStage(nn.Module):
    """Layers ``[lo, hi)`` of a GPT; the embeddings on the first stage, final norm and head on the last.

    Computes exactly what :meth:`labkit.model.GPT.forward` computes for those layers; submodule
    names are the GPT's (``blocks.3.attn.qkv.weight``), so state dicts merge back into the model's.
    """

    def __init__(self, model: GPT, index: int, n_stages: int) -> None:
        super().__init__()
        lo, hi = stage_bounds(model.config.n_layer, n_stages)[index]
        self.index, self.first, self.last = index, index == 0, index == n_stages - 1
        if self.first:
            self.wte, self.wpe, self.drop = model.wte, model.wpe, model.drop
        self.blocks = nn.ModuleDict({str(i): model.blocks[i] for i in range(lo, hi)})
        if self.last:  # on its own the head keeps a copy of the tied matrix (synced: see tied_grad_sync)
            self.ln_f, self.head = model.ln_f, model.head

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.first:
            x = self.drop(self.wte(x) + self.wpe(torch.arange(x.shape[1], device=x.device)))
        for block in self.blocks.values():
            x = block(x)
        return self.head(self.ln_f(x)) if self.last else x


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """The GPT's loss: mean cross-entropy over a microbatch's tokens."""
    return F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))


def schedule_order(schedule: str, p: int, s: int, m: int) -> list[tuple[str, int]]:
    """The (kind, microbatch) actions stage ``s`` of ``p`` runs: GPipe all F then all B; 1F1B
    ``p - s - 1`` warm-up forwards, then one forward and one backward alternately, then the rest."""
    if schedule == "gpipe":
        return [("F", i) for i in range(m)] + [("B", i) for i in range(m)]
    if schedule != "1f1b":
        raise ValueError(f"schedule={schedule!r} has no scratch order; valid: ['gpipe', '1f1b']")
    warm = min(p - s - 1, m)
    order = [("F", i) for i in range(warm)]
    for j in range(m - warm):
        order += [("F", warm + j), ("B", j)]
    return order + [("B", j) for j in range(m - warm, m)]


def scratch_step(stage: GPTStage, schedule: str, p: int, xs: list, ys: list, timeline: Timeline,
                 act_shape: tuple, act_dtype: torch.dtype, group=None) -> list[torch.Tensor]:
    """One step of the pipeline on this stage's rank, written with point-to-point messages.

    Activations go to the next stage with ``isend`` (sends complete in the background, so a stage
    runs ahead as far as the schedule lets it); their gradients come back the same way. The loss of
    each microbatch is divided by ``m``: the step's gradient is that of the global-batch mean.
    """
    s, m = stage.index, len(xs)
    peer = (lambda r: dist.get_global_rank(group, r)) if group is not None else (lambda r: r)
    inputs, outputs, losses, pending = {}, {}, [], []
    for kind, i in schedule_order(schedule, p, s, m):
        if kind == "F":
            x = xs[i]
            if not stage.first:
                x = torch.empty(act_shape, dtype=act_dtype, device=xs[i].device)
                dist.recv(x, peer(s - 1), group=group)
                x.requires_grad_()
            with timeline.record("F", i):
                out = stage(x)
                if stage.last:
                    out = lm_loss(out, ys[i])
            if stage.last:
                losses.append(out.detach())
            else:
                send = out.detach()
                pending.append((dist.isend(send, peer(s + 1), group=group), send))
            inputs[i], outputs[i] = x, out
        else:
            grad = None
            if not stage.last:
                grad = torch.empty(act_shape, dtype=act_dtype, device=xs[i].device)
                dist.recv(grad, peer(s + 1), group=group)
            with timeline.record("B", i):
                out = outputs.pop(i)
                (out / m).backward() if stage.last else out.backward(grad)
            x = inputs.pop(i)
            if not stage.first:
                pending.append((dist.isend(x.grad, peer(s - 1), group=group), x.grad))
    for work, _ in pending:
        work.wait()
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

    return TimedStage


def stage_params(cfg: GPTConfig, n_stages: int, index: int) -> int:
    """Parameters stage ``index`` holds: its blocks, plus the embeddings (first) or the final norm
    and a copy of the tied head (last, when it is not also the first)."""
    lo, hi = stage_bounds(cfg.n_layer, n_stages)[index]
    C, V, ln = cfg.n_embd, cfg.vocab_size, cfg.n_embd * (1 + int(cfg.bias))
    per_block = (GPT.count_params(cfg) - V * C - cfg.block_size * C - ln) // cfg.n_layer
    n = (hi - lo) * per_block
    n += (V * C + cfg.block_size * C) if index == 0 else 0
    n += (ln + (V * C if n_stages > 1 else 0)) if index == n_stages - 1 else 0
    return n


def train_pp(cfg, model_cfg: GPTConfig | None = None, corpus: str | None = None, *, pp: int | None = None,
             microbatches: int | None = None, schedule: str | None = None, impl: str = "torch") -> dict:
    """``labkit.train.train`` with the layers split into ``pp`` stages, one per rank; call on every rank.

    ``pp``, ``microbatches`` and ``schedule`` default to the config's fields of those names when it
    has them, else to every rank, 4 and ``"1f1b"``. The global batch is cut into ``microbatches``
    equal microbatches; the loss is their mean, the global-batch mean as in ``train``. The result
    adds the measured ``bubble_fraction`` (median over steps after the first) and the timeline.
    """
    from labkit import model_parallel as mp
    from labkit.data import get_batch, load_corpus, train_val_split
    from labkit.model import build_model

    model_cfg = model_cfg or GPTConfig()
    world, rank = (dist.get_world_size(), dist.get_rank()) if dist.is_initialized() else (1, 0)
    pp = pp or getattr(cfg, "pp", None) or world
    microbatches = microbatches or getattr(cfg, "microbatches", None) or 4
    schedule = schedule or getattr(cfg, "schedule", None) or "1f1b"
    check_pp(pp, model_cfg.n_layer, microbatches, schedule, cfg.batch_size, impl)
    if pp != world:
        raise ValueError(f"pp={pp} must equal world_size={world}: one stage per rank, no data parallelism here")
    if impl == "torch" and world == 1:
        raise ValueError("impl='torch' needs a process group (launch with labkit.launch or torchrun); "
                         "use impl='scratch' for one process")
    if cfg.grad_accum != 1:
        raise ValueError(f"grad_accum={cfg.grad_accum} is not used with pipelining: the microbatches are the "
                         "accumulation; set grad_accum=1 and microbatches instead")
    mp.check_config(cfg, "pp")
    device = mp.device_of(cfg)
    data = train_val_split(load_corpus(corpus)).train
    model = build_model(model_cfg, seed=cfg.seed).to(device)
    grad_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    v = VIRTUAL[schedule]
    n_stages = pp * v
    mods = [GPTStage(model, rank + k * pp, n_stages) for k in range(v)]  # interleaved: r, r + p, ...
    del model
    first = mods[0] if mods[0].first else None
    last = mods[-1] if mods[-1].last else None
    holder = nn.ModuleList(mods)
    params = list(holder.parameters())
    meter = ActivationMeter(holder)
    tl = Timeline(rank, device, meter)
    tied_group = dist.new_group([0, pp - 1]) if pp > 1 else None  # every rank takes part in new_group
    mb, T, C, V = cfg.batch_size // microbatches, model_cfg.block_size, model_cfg.n_embd, model_cfg.vocab_size
    if impl == "torch":
        from torch.distributed import pipelining

        TimedStage = _timed_stage_class()

        # requires_grad on the example activations: without it the stage sends no gradient back and
        # the stages before it silently never learn (measured: stage 0 got no gradient at all).
        def meta(*shape, dtype=torch.float32):
            return torch.empty(shape, dtype=dtype, device="meta", requires_grad=dtype.is_floating_point)

        logits_dtype = torch.bfloat16 if cfg.precision == "bf16" else torch.float32  # autocast's head output

        # Shapes given up front (static mode). Without them the stage infers them on the first step
        # and, measured here, keeps 0.7 of a microbatch's saved activations alive on stage 0 for the
        # rest of the run; with them the activation peaks equal the hand-written pipeline's exactly.
        stages = [TimedStage(m, m.index, n_stages, device, timeline=tl,
                             input_args=meta(mb, T, dtype=torch.long) if m.first else meta(mb, T, C),
                             output_args=meta(mb, T, V, dtype=logits_dtype) if m.last else meta(mb, T, C),
                             output_grads=None if m.last else meta(mb, T, C),
                             input_grads=None if m.first else meta(mb, T, C)) for m in mods]
        cls = {"gpipe": pipelining.ScheduleGPipe, "1f1b": pipelining.Schedule1F1B,
               "interleaved": pipelining.ScheduleInterleaved1F1B}[schedule]
        sched = cls(stages if v > 1 else stages[0], microbatches, loss_fn=lm_loss)
    opt, lr_sched = mp.make_optimizer(params, cfg)
    rec, losses, peaks = mp.StepRecorder(device), [], []
    for step in range(cfg.steps):
        # Every rank builds the global batch (cheap); the first stage feeds x, the last scores y.
        x, y = (t.to(device) for t in get_batch(data, step, cfg.batch_size, T, cfg.seed))
        if world > 1:
            dist.barrier()  # the common start of the step's timeline
        with rec.step():
            tl.start()
            mb_losses: list[torch.Tensor] = []
            with meter, mp.autocast(cfg, device):
                if impl == "torch":
                    kwargs = {"target": y, "losses": mb_losses} if last is not None else {}
                    kwargs["return_outputs"] = False  # else the last stage keeps every microbatch's logits
                    sched.step(*((x,) if first is not None else ()), **kwargs)
                else:
                    mb_losses = scratch_step(mods[0], schedule, pp, list(x.split(mb)), list(y.split(mb)), tl,
                                             (mb, T, C), torch.float32)
            if tied_group is not None and (first is not None or last is not None):
                tied = first.wte.weight if first is not None else last.head.weight
                dist.all_reduce(tied.grad, group=tied_group)
            # stages hold disjoint parameters: clip over the squares summed on all; the head copy is skipped
            rec.optimizer_step(holder, opt, lr_sched, params, cfg, step == cfg.steps - 1,
                               lambda p: (None,) if world > 1 else (),
                               skip=[last.head.weight] if last is not None and pp > 1 else [])
        peaks.append(meter.peak)
        loss = torch.stack(mb_losses).mean() if last is not None else torch.zeros((), device=device)
        if world > 1:
            dist.broadcast(loss, src=pp - 1)
        losses.append(loss.item())
    saved = [e.saved_bytes for st in tl.steps for e in st if e.kind == "F"]
    mine = rec.rank_figures(rank, world, peak_activation_bytes=peaks,
                            activation_bytes_per_microbatch=statistics.median(saved) if saved else 0,
                            events=[[e.__dict__ for e in st] for st in tl.steps])
    ranks = mp.gather_ranks(mine)
    steps_events = [[Event(**e) for r in ranks for e in r["events"][i]] for i in range(cfg.steps)]
    per_step = [bubble_fraction(evs) for evs in steps_events]
    for r in ranks:
        del r["events"]
    result = mp.base_result(cfg, "pp", model_cfg, world, losses, rec.times, ranks, grad_bytes, pp=pp,
                            microbatches=microbatches, schedule=schedule, impl=impl, virtual_stages=v,
                            stage_layers=stage_bounds(model_cfg.n_layer, n_stages),
                            bubble_fraction=statistics.median(per_step[1:] or per_step),
                            bubble_fraction_per_step=per_step, bubble_formula=bubble_formula(pp, microbatches, v),
                            timeline=[e.__dict__ for e in steps_events[-1]])
    # fp32 AdamW: 4 + 4 + 8 bytes per parameter a rank holds; the binding (largest) stage
    per_rank = [sum(stage_params(model_cfg, n_stages, r + k * pp) for k in range(v)) for r in range(pp)]
    result["predicted_params_per_rank"] = per_rank
    result["predicted_model_state_bytes"] = {"params": 4 * max(per_rank), "grads": 4 * max(per_rank),
                                             "optimizer": 8 * max(per_rank), "grad_accum": 0}
    if cfg.return_params:
        mine_sd = {k: t.detach().cpu().clone() for m in mods for k, t in m.state_dict().items()}
        result["params"] = {k: t for r in mp.gather_ranks({"sd": mine_sd}) for k, t in r["sd"].items()}
    return result
