"""The one training loop every strategy runs, from a notebook, under torchrun, or on a cluster.

From a notebook: ``labkit.launch.launch(train, TrainConfig(strategy="ddp"), world_size=2)``.
From a shell, the same loop (:mod:`labkit.train.cli`)::

    python -m labkit.train --strategy single --steps 20 --metrics out.json
    torchrun --nproc-per-node 2 -m labkit.train --strategy fsdp --steps 20 --metrics out.json
    torchrun --nproc-per-node 8 -m labkit.train --tp 2 --pp 2 --dp-shard 2 --steps 20

The loop lays the run out on one device mesh (:class:`labkit.parallel.layout.mesh.ParallelDims`), builds
the plain GPT, seeds every rank, asks the strategy's setup to place the model
(:mod:`labkit.train.setup`), reads each step's batch (a pure function of seed and step), and runs
:func:`train_step`: forward, backward and accumulation, the gradients finished, clipping, the
update, read top to bottom below. It keeps the loss of the global batch (:func:`global_loss`),
saves and resumes; a :class:`labkit.train.probe.Probe` times and counts every step from outside.
With ``checkpoint_dir`` the run saves there and a restarted run resumes from the newest good
checkpoint bit for bit; on SIGTERM or SIGUSR1 it finishes the step, saves and reports ``preempted``.
"""
from __future__ import annotations

import time
from contextlib import nullcontext
from functools import partial

import torch
import torch.distributed as dist

from labkit.core import progress
from labkit.core.data import get_batch, load_corpus, train_val_split
from labkit.core.devices import current_device, gather_objects, rank_and_world
from labkit.core.model import GPT, GPTConfig, build_model
from labkit.core.moe_routing import update_router_biases
from labkit.fault_tolerance.rng import seed_rngs
from labkit.parallel.clipping import clip_grad_norm_
from labkit.parallel.pipeline.stages import V_SHAPED
from labkit.train import instruments
from labkit.train.config import TrainConfig
from labkit.train.deepspeed_setup import DeepSpeedSetup
from labkit.train.lr_schedule import lr_scheduler
from labkit.train.setup import Setup
from labkit.train.probe import Probe
from labkit.train.result import TrainResult
from labkit.train.resumable import Resumable
from labkit.train.strategies import strategy
from labkit.train.validate import validate

AUTOCAST = {"bf16": torch.bfloat16, "fp16": torch.float16}


def make_setup(cfg: TrainConfig, model_cfg: GPTConfig) -> Setup:
    """The strategy's setup for this rank on its mesh, every check passed before any collective but the
    mesh's own."""
    spec = strategy(cfg.strategy)
    _, world = rank_and_world()
    if spec.needs_group and not dist.is_initialized():
        raise ValueError(f"strategy={spec.name!r} needs a process group: run it under labkit.launch.launch or "
                         "torchrun (python -m labkit.train starts a one-rank group by itself)")
    par = validate(cfg, model_cfg, world)
    return (DeepSpeedSetup if spec.deepspeed else Setup)(cfg, spec, par, model_cfg, current_device(cfg.device))


def train_step(setup: Setup, x: torch.Tensor, y: torch.Tensor, probe: Probe) -> torch.Tensor:
    """One optimizer step on this rank's rows of the global batch; returns this rank's share of the
    global batch's loss, the loss it differentiated: under FSDP2 its tokens' loss over the global token
    count (torchtitan's normalisation), whose gradients FSDP2 then sums; where data parallelism
    averages, its own mean loss (:attr:`labkit.parallel.placed.Placed.loss_weight`, :func:`global_loss`)."""
    cfg, placed, scaler, device = setup.cfg, setup.placed, setup.scaler, setup.device
    dtype = AUTOCAST.get(cfg.precision)
    autocast = torch.autocast(device.type, dtype=dtype) if dtype is not None else nullcontext()
    x, y = placed.shard_batch(x, y)  # under context parallelism: this rank's chunks of each row
    if placed.pipeline is not None:  # the schedule runs every microbatch's forward and backward
        with autocast:
            loss = placed.pipeline.forward_backward(
                x, y, float(scaler.scale(torch.ones((), device=device))) if scaler else None, placed.loss_weight)
    else:
        loss = torch.zeros((), device=device)
        micros = list(zip(x.chunk(cfg.grad_accum), y.chunk(cfg.grad_accum)))
        # the micro-batch's mean loss over the global token count: this rank's micro-batches, times the
        # token ranks (one division, as exact as the mean over micro-batches it replaces)
        over = len(micros) / placed.loss_weight
        for i, (xm, ym) in enumerate(micros):
            with placed.sync(i == len(micros) - 1 or setup.par.sync_each_microbatch):
                with autocast:
                    micro = placed.model(xm, ym)[1] / over
                (scaler.scale(micro) if scaler else micro).backward()
            loss += micro.detach()
    probe.mark()
    placed.finish_gradients()  # synchronised by hand, Partial DTensors reduced, tied copies summed
    if scaler:
        scaler.unscale_(setup.optimizer)  # clip the true gradients, not the scaled ones
    if cfg.grad_clip and not setup.optimizer_clips:
        clip_grad_norm_(placed.params, cfg.grad_clip, placed.norm_groups, skip=placed.norm_skip)
    if scaler:
        scaler.step(setup.optimizer)
        scaler.update()
    else:
        setup.optimizer.step()
    if setup.scheduler is not None:  # a constant learning rate has none
        setup.scheduler.step()
    if setup.model_cfg.moe_bias_rate:  # DeepSeek-V3's balancing: the routing biases move after the step
        update_router_biases(placed.module)
    return loss


def global_loss(setup: Setup, share: torch.Tensor) -> tuple[float, float]:
    """(this rank's mean loss, the global batch's) from the rank's share of the global loss
    (:func:`train_step`): the shares' sum over the token ranks, or, where gradients are averaged
    (weight 1: DDP and the hand-written data parallels, ZeRO-1 by hand, DeepSpeed), the mean of their
    losses; a pipeline's last stage has it, and sends it to the others."""
    dims, weight, loss = setup.dims, setup.placed.loss_weight, share.clone()
    if dims.tokens_group is not None:
        dist.all_reduce(loss, group=dims.tokens_group)
        if weight == 1.0:
            loss /= dims.degrees.tokens
    if dims.degrees.pp > 1:  # the last stage's rank: the last, or in a V-shaped schedule the first
        last = 0 if setup.par.pp_schedule in V_SHAPED else dims.degrees.pp - 1
        dist.broadcast(loss, src=dims.pp_peer(last), group=dims.group("pp"))
    mine, global_ = torch.stack([share / weight if weight != 1.0 else share, loss]).tolist()  # one sync
    return mine, global_


def train(cfg: TrainConfig, model_cfg: GPTConfig | None = None, corpus: str | None = None) -> TrainResult:
    """Train on this process's rank (or alone); return losses, timings and per-rank figures."""
    model_cfg = model_cfg or GPTConfig()
    setup = make_setup(cfg, model_cfg)
    dims, device = setup.dims, setup.device
    rank, world = dims.rank, dims.world
    raw = load_corpus(corpus)
    data = train_val_split(raw).train
    if int(data.max()) >= model_cfg.vocab_size:  # the corpus is bytes: every one must be a token
        raise ValueError(f"vocab_size={model_cfg.vocab_size} is too small for this corpus, whose bytes go up to "
                         f"{int(data.max())}: valid: vocab_size >= {int(data.max()) + 1} (256 holds any bytes)")
    instruments.set_up(cfg, device)
    # Dropout's masks; a resume restores the states the checkpoint holds. Seeded by the rank's share of
    # the data, not by its rank: the ranks of a tensor-parallel group hold replicated activations and
    # must draw the same masks (Megatron-LM keeps one seed per data-parallel rank for the same reason).
    seed_rngs(cfg.seed, dims.data_rank)
    model = build_model(model_cfg, seed=cfg.seed).to(device)
    # Psi, before any strategy shards the parameters in place
    grad_bytes = sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)
    setup.place(model)
    optimizer = setup.make_optimizer()
    setup.attach(optimizer, lr_scheduler(optimizer, cfg.lr_schedule, cfg.warmup_steps, cfg.steps), setup.make_scaler())
    meta = {"strategy": cfg.strategy, "world_size": world, "seed": cfg.seed, "batch_size": cfg.batch_size,
            "model": model_cfg.to_dict(), "reshardable": setup.spec.reshardable, "layout": dims.degrees.label(),
            "precision": cfg.precision, "lr_schedule": cfg.lr_schedule, "lr": cfg.lr,
            # the rest of what shapes the trajectory: a resume refuses or applies (and notes) each change
            "weight_decay": cfg.weight_decay, "grad_clip": cfg.grad_clip, "warmup_steps": cfg.warmup_steps,
            "steps": cfg.steps}
    if cfg.checkpoint_dir:  # the data source, by its bytes (hashed only by runs that checkpoint)
        from labkit.fault_tolerance.changes import corpus_record

        meta["corpus"] = corpus_record(corpus, raw)
    show = cfg.progress if cfg.progress is not None else progress.wanted(cfg.steps)  # before the lock is taken
    ft = Resumable(cfg, meta, setup.training_state())
    # DeepSpeed's engine owns backward, clipping and the update: its step is its own
    step_fn = setup.engine_step if isinstance(setup, DeepSpeedSetup) else partial(train_step, setup)
    start, losses = ft.start()
    bar = progress.bar(cfg.steps, f"{cfg.strategy} x{world}", show and rank == 0, initial=start)
    probe = Probe(setup, cfg.steps)
    try:
        with instruments.StepProfiler(cfg, device, rank) as profiler:
            for step in range(start, cfg.steps):
                x, y = (t.to(device) for t in get_batch(data, step, cfg.batch_size, model_cfg.block_size, cfg.seed,
                                                          dims.data_rank, dims.data_world))
                with profiler.step(step), probe.step(step):
                    if cfg.input_delay_ms:  # a loader that cannot keep up: the step waits for its batch
                        time.sleep(cfg.input_delay_ms / 1e3)
                    local = step_fn(x, y, probe)
                profiler.after(step)
                mine, global_ = global_loss(setup, local)
                probe.after_update(mine)  # model states before the gradients are freed
                setup.zero_grad()
                losses.append(global_)
                bar.update()
                bar.set_postfix(loss=f"{losses[-1]:.4f}", refresh=False)
                if ft.end_of_step(step + 1, losses):  # preempted: saved (if there was time); stop here
                    break
    except BaseException:
        ft.abort()  # SIGTERM must stop a failed rank again, or torchrun waits out its grace period
        raise
    bar.close()
    faults = ft.finish()
    instruments.finish(cfg, device, rank)
    ranks = gather_objects(probe.rank_figures(rank))
    result = {
        "strategy": cfg.strategy, "world_size": world, "device": cfg.device, "steps": cfg.steps,
        "precision": cfg.precision, "activation_checkpointing": cfg.activation_checkpointing,
        "seed": cfg.seed, "batch_size": cfg.batch_size, "model": model_cfg.to_dict(),
        "n_params": GPT.count_params(model_cfg), "grad_bytes": grad_bytes, "loss": losses,
        "step_time_s": probe.rec["times"], "ranks": ranks, "start_step": start, "comm_counted": probe.mode, **faults,
        **instruments.speed(cfg, model_cfg, device, world, probe.rec["times"], probe.rec["timed"]),
        **probe.result_fields(ranks),
    }
    if cfg.return_params:  # sharded parameters are gathered (a collective: every rank calls it)
        result["params"] = setup.full_state_dict()
    return result


def train_many(configs: list[TrainConfig], model_cfg: GPTConfig | None = None) -> list[TrainResult]:
    """Several runs in one process group (one launch, one DeepSpeed op build), in order."""
    return [train(c, model_cfg) for c in configs]
