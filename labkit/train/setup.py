"""How a strategy places the model for the one loop, and what it builds to train it.

A :class:`Setup` is what differs between strategies and nothing else: it lays the plain GPT on the
device mesh (:func:`labkit.parallel.compose.place`, given the run's one
:class:`~labkit.parallel.layout.parallelism.Parallelism`) and makes the optimizer and fp16's loss scaler, once :mod:`labkit.train.validate` has
refused what the layout cannot do on this model. The step itself (forward, backward, accumulation,
clipping, the update, the loss) is the loop's (:func:`labkit.train.loop.train_step`); a pipeline brings its own forward
and backward, DeepSpeed's engine its own step (:meth:`labkit.train.deepspeed_setup.DeepSpeedSetup.engine_step`),
which the loop runs in its place.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
import torch.nn as nn

from labkit.parallel.layout.mesh import ParallelDims

if TYPE_CHECKING:
    from labkit.core.model import GPT, GPTConfig
    from labkit.fault_tolerance.resume import TrainState
    from labkit.parallel.layout.parallelism import Parallelism
    from labkit.parallel.placed import Placed
    from labkit.train.config import TrainConfig
    from labkit.train.strategies import Strategy


class Setup:
    """Life of a setup, as the loop uses it, its layout validated (:mod:`labkit.train.validate`):
    ``place(model)``, ``make_optimizer()``, ``attach(optimizer, scheduler, scaler)``."""

    engine = None  # DeepSpeed's engine, when it owns the step

    def __init__(self, cfg: TrainConfig, spec: Strategy, par: Parallelism, model_cfg: GPTConfig,
                 device: torch.device) -> None:
        self.cfg, self.spec, self.par, self.model_cfg, self.device = cfg, spec, par, model_cfg, device
        self.dims = ParallelDims(par.degrees, device.type)
        self.placed: Placed | None = None
        self.optimizer: torch.optim.Optimizer | None = None
        self.scheduler: Any = None
        self.scaler: torch.amp.GradScaler | None = None

    def place(self, model: GPT) -> None:
        from labkit.parallel.compose import place

        cfg = self.cfg
        hook = None
        if cfg.link_gbps:
            from labkit.comm.slow_link import slow_link_hook

            hook = slow_link_hook(cfg.link_gbps, cfg.link_latency_ms)
        if cfg.precision.startswith("fp8"):  # before any wrapper: DDP and FSDP2 see the FP8 linears
            from labkit.device.fp8 import to_fp8

            to_fp8(model, "block" if cfg.precision == "fp8-block" else "tensor")
        self.placed = place(model, self.dims, self.par, self.device, rows=cfg.batch_size // self.dims.data_world,
                            precision=cfg.precision, activation_checkpointing=cfg.activation_checkpointing,
                            ddp_hook=hook)

    @property
    def module(self) -> nn.Module:
        """The model without a wrapper: what state dicts and checkpoints read (GPT names)."""
        return self.placed.module

    @property
    def optimizer_clips(self) -> bool:
        """Whether the optimizer clips the gradients itself: the hand-written ZeRO-1 clips its reduced
        shards, and the loop must not clip the un-reduced local gradients."""
        return self.spec.optimizer == "zero1_scratch" and self.dims.world > 1

    def make_optimizer(self) -> torch.optim.Optimizer:
        cfg = self.cfg
        if self.optimizer_clips:
            from labkit.parallel.zero_scratch import ZeroOneAdamW

            return ZeroOneAdamW(self.placed.model, lr=cfg.lr, betas=(0.9, 0.95), weight_decay=cfg.weight_decay,
                                grad_clip=cfg.grad_clip)
        return torch.optim.AdamW(self.placed.params, lr=cfg.lr, betas=(0.9, 0.95), weight_decay=cfg.weight_decay)

    def make_scaler(self) -> torch.amp.GradScaler | None:
        """fp16's dynamic loss scaling; ranks must agree on skipping a step with inf/NaN gradients, so
        several ranks use :class:`labkit.parallel.loss_scaling.GradScaler`, which all-reduces that verdict."""
        if self.cfg.precision != "fp16":
            return None
        if self.dims.world > 1:
            from labkit.parallel.loss_scaling import GradScaler

            return GradScaler(self.device.type)
        return torch.amp.GradScaler(self.device.type)

    def attach(self, optimizer: torch.optim.Optimizer, scheduler: Any, scaler: Any) -> None:
        self.optimizer, self.scheduler, self.scaler = optimizer, scheduler, scaler

    def zero_grad(self) -> None:
        """After the step and its measurement: the gradients freed."""
        self.optimizer.zero_grad(set_to_none=True)

    def training_state(self) -> TrainState:
        """What a checkpoint saves and a resume restores, one Stateful (:mod:`labkit.fault_tolerance.resume`)."""
        from labkit.fault_tolerance.resume import TrainState

        return TrainState(self.module, self.optimizer, self.scheduler, None, self.scaler, self.placed.state_aliases)

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """Every parameter and buffer whole, on the CPU (a collective under sharding)."""
        return self.placed.full_state_dict()
