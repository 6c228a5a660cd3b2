"""How each data-parallel strategy runs the one loop: placing the model, and one step of training.

A :class:`Plan` is what :func:`labkit.train.loop.train` asks about the parts that differ between
strategies. The loop builds the plain GPT, seeds every rank, reads batches, times and counts each
step, keeps the loss, saves and resumes; the plan wraps or shards the model (torchtitan's
"parallelize" step: the model never imports a strategy), says which rows of the global batch this
rank reads, and runs one step's forward, backward, clipping and update. Tensor and pipeline
parallelism are plans too (:mod:`labkit.train.model_parallel_plans`), so schedules, clipping, loss
scaling, activation checkpointing, checkpoints and metrics reach every strategy.
"""
from __future__ import annotations

from contextlib import nullcontext
from dataclasses import asdict
from typing import TYPE_CHECKING, Any, ContextManager

import torch
import torch.distributed as dist
import torch.nn as nn

from labkit.comm.counter import CommCounter
from labkit.core.data import check_shard
from labkit.memory.calculator import ModelStates, model_state_breakdown
from labkit.memory.probe import measured_model_states
from labkit.parallel.activation_checkpointing import apply as apply_checkpointing

if TYPE_CHECKING:
    from labkit.core.model import GPT, GPTConfig
    from labkit.train.config import TrainConfig
    from labkit.train.strategies import Strategy

AUTOCAST = {"bf16": torch.bfloat16, "fp16": torch.float16}


class Plan:
    """The default: one process or plain data parallelism; subclasses change what differs.

    Life of a plan, as the loop uses it: ``prepare(model)``, ``make_optimizer()``,
    ``attach(optimizer, scheduler, scaler)``, then per step ``step(x, y)`` (forward, backward,
    clipping, optimizer and schedule step; the gradients are left for measuring),
    ``model_states()``, ``zero_grad()`` and ``global_loss(local)``.
    """

    def __init__(self, cfg: TrainConfig, spec: Strategy, model_cfg: GPTConfig, device: torch.device,
                 rank: int, world: int) -> None:
        self.cfg, self.spec, self.model_cfg, self.device, self.rank, self.world = (
            cfg, spec, model_cfg, device, rank, world)
        self.model: nn.Module | None = None
        self.optimizer: torch.optim.Optimizer | None = None
        self.scheduler: torch.optim.lr_scheduler.LRScheduler | None = None
        self.scaler: torch.amp.GradScaler | None = None
        self.fwd_bwd_comm: list[dict[str, int] | None] = []  # collectives of forward + backward only, per step
        self.counting = True  # whether this step's collectives are counted (the loop says, per step)

    # -- what can run, checked before anything starts --
    @classmethod
    def check_config(cls, cfg: TrainConfig, spec: Strategy) -> None:
        """What this kind of plan cannot do whatever the world size (``TrainConfig`` calls it)."""

    def check_run(self) -> None:
        """What this run cannot do on this world size; called on every rank before any collective."""
        if self.spec.name == "single" and self.world != 1:
            raise ValueError(f"strategy='single' runs on one process but world_size={self.world}; "
                             "use 'ddp' (or another strategy) for several ranks")
        rows = check_shard(self.cfg.batch_size, self.data_world)
        if rows % self.cfg.grad_accum:
            raise ValueError(f"grad_accum={self.cfg.grad_accum} must divide the {rows} rows each rank gets per "
                             f"step (batch_size={self.cfg.batch_size} over {self.data_world} ranks)")

    # -- placement --
    @property
    def data_rank(self) -> int:  # which share of every global batch this rank reads
        return self.rank

    @property
    def data_world(self) -> int:  # into how many shares the global batch is cut
        return self.world

    def prepare(self, model: GPT) -> nn.Module:
        """Checkpoint the blocks as asked (before any wrapper, as DDP and FSDP expect), then wrap."""
        apply_checkpointing(model, self.cfg.activation_checkpointing)
        self.model = self.wrap(model)
        return self.model

    def wrap(self, model: GPT) -> nn.Module:
        return model

    @property
    def layout(self) -> str:
        """How this run places the model, beyond the world size (checkpoints record it)."""
        return ""

    @property
    def module(self) -> nn.Module:
        """The model without its data-parallel wrapper: what state dicts and checkpoints read."""
        return getattr(self.model, "module", self.model)

    @property
    def params(self) -> list[torch.Tensor]:
        return [p for p in self.model.parameters() if p.requires_grad]

    def make_optimizer(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.params, lr=self.cfg.lr, betas=(0.9, 0.95), weight_decay=self.cfg.weight_decay)

    def make_scaler(self) -> torch.amp.GradScaler | None:
        """fp16's dynamic loss scaling; ranks must agree on skipping a step with inf/NaN gradients, so
        several ranks use :class:`labkit.parallel.loss_scaling.GradScaler`, which all-reduces that verdict."""
        if self.cfg.precision != "fp16":
            return None
        if self.world > 1:
            from labkit.parallel.loss_scaling import GradScaler

            return GradScaler(self.device.type)
        return torch.amp.GradScaler(self.device.type)

    def attach(self, optimizer: torch.optim.Optimizer, scheduler: Any, scaler: Any) -> None:
        self.optimizer, self.scheduler, self.scaler = optimizer, scheduler, scaler

    # -- one step --
    def before_step(self) -> None:
        """Before the timed step (a pipeline's ranks meet at a barrier: the timeline's common start)."""

    def after_step(self) -> None:
        """After the timed step, before the model states are measured."""

    def autocast(self) -> torch.autocast:
        dtype = AUTOCAST.get(self.cfg.precision)
        return torch.autocast(self.device.type, dtype=dtype, enabled=dtype is not None)

    def no_sync(self, last: bool) -> ContextManager:
        """Skip the gradient synchronisation on all but the last micro-batch of a step."""
        return nullcontext()

    def split(self, x: torch.Tensor, y: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """This rank's rows cut into ``grad_accum`` micro-batches."""
        micro = x.shape[0] // self.cfg.grad_accum
        return list(zip(x.split(micro), y.split(micro)))

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """One micro-batch's mean loss (the logits dropped: only autograd needs what it saved)."""
        return self.model(x, y)[1]

    def forward_backward(self, micros: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
        """Forward and backward of every micro-batch; the mean loss of this rank's rows."""
        loss = torch.zeros((), device=self.device)
        for i, (x, y) in enumerate(micros):
            with self.no_sync(i == len(micros) - 1 or self.cfg.sync_each_microbatch):
                with self.autocast():
                    micro_loss = self.forward(x, y)
                micro_loss = micro_loss / len(micros)  # the step's loss is the mean over micro-batches
                (self.scaler.scale(micro_loss) if self.scaler else micro_loss).backward()
            loss += micro_loss.detach()
        return loss

    def finish_backward(self) -> None:
        """Whatever must happen between the last backward and clipping (hand-written gradient sync)."""

    def clip(self, max_norm: float) -> None:
        torch.nn.utils.clip_grad_norm_(self.params, max_norm)

    def step(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """One optimizer step on this rank's rows; returns this rank's mean loss."""
        with CommCounter() if self.counting else nullcontext() as fb:
            loss = self.forward_backward(self.split(x, y))
        self.fwd_bwd_comm.append(dict(fb.bytes) if self.counting else None)
        self.finish_backward()
        if self.scaler:
            self.scaler.unscale_(self.optimizer)  # clip the true gradients, not the scaled ones
        if self.cfg.grad_clip and not getattr(self.optimizer, "clips_gradients", False):
            self.clip(self.cfg.grad_clip)
        if self.scaler:
            self.scaler.step(self.optimizer)
            self.scaler.update()
        else:
            self.optimizer.step()
        if self.scheduler is not None:
            self.scheduler.step()
        return loss

    def model_states(self) -> ModelStates:
        """Bytes of parameters, gradients and optimizer states this rank holds (after the step, before
        the gradients are freed: at its fullest)."""
        return measured_model_states(self.model, self.optimizer)

    def zero_grad(self) -> None:
        self.optimizer.zero_grad(set_to_none=True)

    def global_loss(self, local: torch.Tensor) -> torch.Tensor:
        """Every rank computed the mean loss of its own rows; their mean is the global-batch loss."""
        loss = local.clone()
        if self.world > 1:
            dist.all_reduce(loss)
            loss /= self.world
        return loss

    # -- results --
    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """Every parameter and buffer whole, on the CPU (a collective under sharding)."""
        m = self.module
        return {k: (v.full_tensor() if hasattr(v, "full_tensor") else v).detach().cpu().clone()
                for k, v in m.state_dict().items()}

    def predicted_model_states(self, n_params: int) -> dict[str, int]:
        """What the ZeRO paper's model says this rank holds in fp32 training."""
        return asdict(model_state_breakdown(n_params, self.world, self.spec.zero_stage, "fp32"))

    def rank_figures(self) -> dict[str, Any]:
        """Figures of this rank beyond the loop's own."""
        return {"fwd_bwd_comm_bytes_per_step": self.fwd_bwd_comm}

    def result_fields(self, ranks: list[dict]) -> dict[str, Any]:
        """Fields of the run's result beyond the loop's own (``ranks``: every rank's figures)."""
        return {}


class DDPPlan(Plan):
    def wrap(self, model: GPT) -> nn.Module:
        from labkit.parallel.data_parallel import wrap_ddp

        if self.world == 1:
            return model
        ddp = wrap_ddp(model, self.device, self.cfg.bucket_cap_mb)
        if self.cfg.link_gbps:
            from labkit.comm.slow_link import slow_link_hook

            ddp.register_comm_hook(None, slow_link_hook(self.cfg.link_gbps, self.cfg.link_latency_ms))
        return ddp

    def no_sync(self, last: bool) -> ContextManager:
        return self.model.no_sync() if not last and hasattr(self.model, "no_sync") else nullcontext()


class NaivePlan(Plan):
    def wrap(self, model: GPT) -> nn.Module:
        from labkit.parallel.data_parallel import NaiveDataParallel

        return NaiveDataParallel(model) if self.world > 1 else model

    def no_sync(self, last: bool) -> ContextManager:
        return self.model.no_sync() if not last and hasattr(self.model, "no_sync") else nullcontext()

    def finish_backward(self) -> None:
        if self.world > 1:
            self.model.finish_gradient_sync()


class BucketedPlan(NaivePlan):
    def wrap(self, model: GPT) -> nn.Module:
        from labkit.parallel.data_parallel import BucketedDataParallel

        return BucketedDataParallel(model, bucket_cap_mb=self.cfg.bucket_cap_mb) if self.world > 1 else model


class FSDPPlan(Plan):
    def wrap(self, model: GPT) -> nn.Module:
        from labkit.parallel.fsdp import fully_shard_gpt

        return fully_shard_gpt(model, self.device, self.cfg.reshard_after_forward, self.cfg.cpu_offload,
                               self.cfg.fsdp_bf16)

    def no_sync(self, last: bool) -> ContextManager:
        self.model.set_requires_gradient_sync(last)  # reduce-scatter only after the last micro-batch
        return nullcontext()


class ZeroScratchPlan(Plan):
    def make_optimizer(self) -> torch.optim.Optimizer:
        if self.world == 1:
            return super().make_optimizer()
        from labkit.parallel.zero_scratch import ZeroOneAdamW

        return ZeroOneAdamW(self.model, lr=self.cfg.lr, betas=(0.9, 0.95), weight_decay=self.cfg.weight_decay,
                            grad_clip=self.cfg.grad_clip)
