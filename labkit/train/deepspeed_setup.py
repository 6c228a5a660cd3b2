"""How DeepSpeed's ZeRO stages run the one loop: the engine owns backward, clipping, the optimizer step,
zeroing and the schedule, so the setup hands it the micro-batches and reads what it holds."""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from labkit.parallel.activation_checkpointing import apply as apply_checkpointing
from labkit.parallel.placed import Placed
from labkit.train.setup import Setup

if TYPE_CHECKING:
    from labkit.core.model import GPT
    from labkit.fault_tolerance.resume import TrainState
    from labkit.train.probe import Probe


class DeepSpeedSetup(Setup):
    """DeepSpeed's engine takes over backward, clipping, the optimizer step, zeroing and the schedule."""

    @property
    def _deepspeed_checkpointing(self) -> bool:
        return self.cfg.activation_checkpointing.split(":")[0] in ("full", "every")

    def place(self, model: GPT) -> None:
        if not self._deepspeed_checkpointing:  # selective: PyTorch's, applied before DeepSpeed wraps
            apply_checkpointing(model, self.cfg.activation_checkpointing)
        self.placed = Placed(model=model, module=model, dims=self.dims, parts=[model])

    def make_optimizer(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.placed.params, lr=self.cfg.lr, betas=(0.9, 0.95),
                                 weight_decay=self.cfg.weight_decay)

    def make_scaler(self) -> None:
        return None  # DeepSpeed scales fp16 losses itself (its "fp16" config)

    def attach(self, optimizer: torch.optim.Optimizer, scheduler: Any, scaler: Any) -> None:
        from labkit.parallel import deepspeed_zero as dz

        world = self.dims.world
        micro = self.cfg.batch_size // world // self.cfg.grad_accum
        config = dz.deepspeed_config(self.spec.zero_stage, micro, world, self.cfg.grad_accum,
                                     self.cfg.grad_clip, self.cfg.precision, self.cfg.offload_optimizer)
        self.engine = dz.initialize(self.placed.model, optimizer, config, self.device, lr_scheduler=scheduler)
        self.placed.model = self.engine
        self.optimizer, self.scheduler = self.engine.optimizer, scheduler
        if self._deepspeed_checkpointing:  # DeepSpeed's own checkpointing where it has the policy
            apply_checkpointing(self.engine.module, self.cfg.activation_checkpointing, backend="deepspeed")

    def engine_step(self, x: torch.Tensor, y: torch.Tensor, probe: Probe) -> torch.Tensor:
        """The engine's own step over this rank's micro-batches, run by the loop in place of its
        ``train_step``; the probe reads the engine between the first backward and the update (what the
        engine frees in its step)."""
        from labkit.parallel.deepspeed_zero import engine_step

        micros = list(zip(x.chunk(self.cfg.grad_accum), y.chunk(self.cfg.grad_accum)))
        return engine_step(self.engine, micros, after_first_backward=probe.after_backward)

    def zero_grad(self) -> None:
        pass  # the engine zeroes the gradients in its own step

    def training_state(self) -> TrainState:
        from labkit.fault_tolerance.resume import TrainState

        return TrainState(engine=self.engine)

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        from labkit.parallel.deepspeed_zero import full_state_dict

        return full_state_dict(self.engine.module, zero3=self.spec.zero_stage == 3)
