"""The one training loop every strategy runs, from a notebook, under torchrun, or on a cluster.

From a notebook: ``labkit.launch.launch(train, TrainConfig(strategy="ddp"), world_size=2)``.
From a shell, the same loop (:mod:`labkit.train.cli`)::

    python -m labkit.train --strategy single --steps 20 --metrics out.json
    torchrun --nproc-per-node 2 -m labkit.train --strategy fsdp --steps 20 --metrics out.json

The loop builds the plain GPT, seeds every rank, reads each step's batch (a pure function of seed
and step), times and counts every step, keeps the loss of the global batch, saves and resumes; what
differs between strategies (wrapping, sharding or splitting the model, one step's forward, backward
and update) is asked of the strategy's plan (:mod:`labkit.train.plans`). With ``checkpoint_dir``
the run saves there and a restarted run resumes from the newest good checkpoint bit for bit; on
SIGTERM or SIGUSR1 it finishes the step, saves and reports ``preempted``.
"""
from __future__ import annotations

import time
from contextlib import nullcontext
from dataclasses import asdict
from typing import Any

import torch

from labkit.comm.counter import CommCounter, ring_volume
from labkit.core.data import get_batch, load_corpus, train_val_split
from labkit.core.devices import (
    current_device,
    gather_objects,
    rank_and_world,
    synchronize,
)
from labkit.core.model import GPT, GPTConfig, build_model
from labkit.core import progress
from labkit.fault_tolerance.rng import seed_rngs
from labkit.train import instruments
from labkit.train.config import TrainConfig
from labkit.train.lr_schedule import lr_scheduler
from labkit.train.plans import Plan
from labkit.train.resumable import Resumable
from labkit.train.strategies import STRATEGIES, strategy


def make_plan(cfg: TrainConfig, model_cfg: GPTConfig) -> Plan:
    """The strategy's plan for this rank, its world-dependent checks passed (before any collective)."""
    import torch.distributed as dist

    spec = strategy(cfg.strategy)
    rank, world = rank_and_world()
    if spec.needs_group and not dist.is_initialized():
        raise ValueError(f"strategy={spec.name!r} needs a process group: run it under labkit.launch.launch or "
                         "torchrun (python -m labkit.train starts a one-rank group by itself)")
    if model_cfg.moe_experts and not spec.moe:
        raise ValueError(f"moe_experts={model_cfg.moe_experts} (a mixture-of-experts model) is not supported with "
                         f"strategy={spec.name!r}: its routing would be decided per rank, not over the global batch; "
                         f"use strategy {' / '.join(repr(s.name) for s in STRATEGIES.values() if s.moe)}")
    plan = spec.plan(cfg, spec, model_cfg, current_device(cfg.device), rank, world)
    plan.check_run()
    return plan


class _Record:
    """What the loop keeps of every step it runs on this rank."""

    def __init__(self, count_comm: str, device: torch.device, steps: int) -> None:
        self.mode = count_comm if count_comm != "auto" else ("last" if device.type == "cuda" else "every")
        self.steps = steps
        self.times, self.timed, self.comm, self.calls, self.held, self.local = [], [], [], [], [], []
        self.allocated: list[int | None] = []  # the CUDA allocator's bytes in use where ``held`` is counted

    def counted(self, step: int) -> bool:
        """Whether ``step`` runs under the collective counter (its Python dispatch costs time)."""
        return self.mode == "every" or (self.mode == "last" and step == self.steps - 1)

    def rank_figures(self, rank: int, world: int, states: Any, plan: Plan) -> dict:
        def per_step(f):
            return [f(b) if b is not None else None for b in self.comm]

        return {"rank": rank, "step_time_s": self.times, "step_timed_without_counter": self.timed,
                "allreduce_bytes_per_step": per_step(lambda b: b.get("allreduce", 0)),
                "allreduce_calls_per_step": [c.get("allreduce", 0) if c is not None else None for c in self.calls],
                "comm_bytes_per_step": self.comm, "comm_calls_per_step": self.calls,
                "comm_volume_per_step": per_step(lambda b: ring_volume(b, world)),
                "model_state_bytes": asdict(states) | {"total": states.total} if states else None,
                "model_state_bytes_per_step": self.held, "local_loss": self.local,
                "cuda_allocated_after_step": self.allocated,
                "peak_memory_bytes": instruments.peak_memory(plan.device), **plan.rank_figures()}


def _step(plan: Plan, rec: _Record, step: int, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """One timed (and, when due, counted) step; this rank's mean loss."""
    counted = rec.counted(step)
    plan.counting = counted
    plan.before_step()
    synchronize(plan.device)
    t0 = time.perf_counter()
    if plan.cfg.input_delay_ms:  # a loader that cannot keep up: the step waits for its batch
        time.sleep(plan.cfg.input_delay_ms / 1e3)
    with CommCounter() if counted else nullcontext() as counter:
        local = plan.step(x, y)
    synchronize(plan.device)
    rec.times.append(time.perf_counter() - t0)
    rec.timed.append(not counted)
    rec.comm.append(dict(counter.bytes) if counted else None)
    rec.calls.append(dict(counter.calls) if counted else None)
    plan.after_step()
    return local


def train(cfg: TrainConfig, model_cfg: GPTConfig | None = None, corpus: str | None = None) -> dict:
    """Train on this process's rank (or alone); return losses, timings and per-rank figures."""
    model_cfg = model_cfg or GPTConfig()
    plan = make_plan(cfg, model_cfg)
    rank, world, device = plan.rank, plan.world, plan.device
    data = train_val_split(load_corpus(corpus)).train
    instruments.set_up(cfg, device)
    # Dropout's masks; a resume restores the states the checkpoint holds. Seeded by the rank's share of
    # the data, not by its rank: the ranks of a tensor-parallel group hold replicated activations and
    # must draw the same masks (Megatron-LM keeps one seed per data-parallel rank for the same reason),
    # or their copies of the replicated weights drift apart.
    seed_rngs(cfg.seed, plan.data_rank)
    model = build_model(model_cfg, seed=cfg.seed).to(device)
    # Psi, before any strategy shards the parameters in place
    grad_bytes = sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)
    plan.prepare(model)
    optimizer = plan.make_optimizer()
    plan.attach(optimizer, lr_scheduler(optimizer, cfg.lr_schedule, cfg.warmup_steps, cfg.steps),
                plan.make_scaler())
    meta = {"strategy": cfg.strategy, "world_size": world, "seed": cfg.seed, "batch_size": cfg.batch_size,
            "model": model_cfg.to_dict(), "reshardable": plan.spec.reshardable, "layout": plan.layout}
    engine = getattr(plan, "engine", None)
    ft = Resumable(cfg, meta, None if engine else plan.module, None if engine else plan.optimizer,
                   None if engine else plan.scheduler, engine, plan.scaler)
    start, losses = ft.start()
    show = cfg.progress if cfg.progress is not None else progress.wanted(cfg.steps)
    bar = progress.bar(cfg.steps, f"{cfg.strategy} x{world}", show and rank == 0, initial=start)
    rec, states = _Record(cfg.count_comm, device, cfg.steps), None
    try:
        with instruments.StepProfiler(cfg, device, rank) as profiler:
            for step in range(start, cfg.steps):
                x, y = (t.to(device) for t in get_batch(data, step, cfg.batch_size, model_cfg.block_size, cfg.seed,
                                                          plan.data_rank, plan.data_world))
                with profiler.step(step):
                    local = _step(plan, rec, step, x, y)
                profiler.after(step)
                states = plan.model_states()  # counted outside the timed step, before the gradients are freed
                rec.held.append(states.total)
                rec.allocated.append(instruments.allocated(device))
                plan.zero_grad()
                mine_loss, global_loss = torch.stack([local, plan.global_loss(local)]).tolist()  # one sync
                rec.local.append(mine_loss)
                losses.append(global_loss)
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
    ranks = gather_objects(rec.rank_figures(rank, world, states, plan))
    n_params = GPT.count_params(model_cfg)
    result = {
        "strategy": cfg.strategy, "world_size": world, "device": cfg.device, "steps": cfg.steps,
        "precision": cfg.precision, "activation_checkpointing": cfg.activation_checkpointing,
        "seed": cfg.seed, "batch_size": cfg.batch_size, "model": model_cfg.to_dict(), "n_params": n_params,
        "grad_bytes": grad_bytes, "loss": losses, "step_time_s": rec.times, "ranks": ranks, "start_step": start,
        "comm_counted": rec.mode, **faults, **instruments.speed(cfg, model_cfg, device, world, rec.times, rec.timed),
        "predicted_model_state_bytes": plan.predicted_model_states(n_params), **plan.result_fields(ranks),
    }
    if cfg.return_params:  # sharded parameters are gathered (a collective: every rank calls it)
        result["params"] = plan.full_state_dict()
    return result


def train_many(configs: list[TrainConfig], model_cfg: GPTConfig | None = None) -> list[dict]:
    """Several runs in one process group (one launch, one DeepSpeed op build), in order."""
    return [train(c, model_cfg) for c in configs]
