"""How DeepSpeed's ZeRO stages run the one loop: the engine owns backward, clipping, the optimizer step,
zeroing and the schedule, so the plan hands it the micro-batches and reads what it holds."""
from __future__ import annotations

from contextlib import nullcontext
from dataclasses import asdict
from typing import TYPE_CHECKING, Any

import torch
import torch.nn as nn

from labkit.comm.counter import CommCounter
from labkit.memory.calculator import ModelStates, model_state_breakdown
from labkit.parallel.activation_checkpointing import apply as apply_checkpointing
from labkit.train.plans import Plan

if TYPE_CHECKING:
    from labkit.core.model import GPT
    from labkit.train.config import TrainConfig
    from labkit.train.strategies import Strategy


class DeepSpeedPlan(Plan):
    """DeepSpeed's engine takes over backward, clipping, the optimizer step, zeroing and the schedule."""

    @classmethod
    def check_config(cls, cfg: TrainConfig, spec: Strategy) -> None:
        if cfg.async_save:
            raise ValueError(f"async_save=True is not supported with strategy={spec.name!r}: DeepSpeed writes its "
                             "checkpoints synchronously (engine.save_checkpoint); use async_save=False")
        if cfg.precision == "fp16" and cfg.device != "cuda":
            raise ValueError(f"precision='fp16' with strategy={spec.name!r} needs device='cuda' (DeepSpeed's "
                             "fp16 optimizer); on CPU use precision='bf16' or strategy 'fsdp'")
        if spec.zero_stage == 3 and cfg.activation_checkpointing.startswith("selective"):
            # Measured: with ZeRO-3's patched linear and gathering hooks, PyTorch's selective
            # recomputation drifted from the reference by 4e-4 in loss within 3 steps (and so does
            # any later selective run in the same process); DeepSpeed has no op-level policy.
            raise ValueError(f"activation_checkpointing={cfg.activation_checkpointing!r} is not supported with "
                             "strategy='zero3'; "
                             "use 'full' or 'every:k' (DeepSpeed's checkpointing), or strategy='fsdp'")

    @property
    def _deepspeed_checkpointing(self) -> bool:
        return self.cfg.activation_checkpointing.split(":")[0] in ("full", "every")

    def prepare(self, model: GPT) -> nn.Module:
        if not self._deepspeed_checkpointing:  # selective: PyTorch's, applied before DeepSpeed wraps
            apply_checkpointing(model, self.cfg.activation_checkpointing)
        self.model = model
        return model

    def make_scaler(self) -> None:
        return None  # DeepSpeed scales fp16 losses itself (its "fp16" config)

    def attach(self, optimizer: torch.optim.Optimizer, scheduler: Any, scaler: Any) -> None:
        from labkit.parallel import deepspeed_zero as dz

        micro = self.cfg.batch_size // self.world // self.cfg.grad_accum
        config = dz.deepspeed_config(self.spec.zero_stage, micro, self.world, self.cfg.grad_accum,
                                     self.cfg.grad_clip, self.cfg.precision, self.cfg.offload_optimizer)
        self.engine = dz.initialize(self.model, optimizer, config, self.device, lr_scheduler=scheduler)
        self.model, self.optimizer, self.scheduler = self.engine, self.engine.optimizer, scheduler
        if self._deepspeed_checkpointing:  # DeepSpeed's own checkpointing where it has the policy
            apply_checkpointing(self.engine.module, self.cfg.activation_checkpointing, backend="deepspeed")
        self._states: ModelStates | None = None

    def step(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        from labkit.memory.deepspeed_states import model_states
        from labkit.parallel.deepspeed_zero import train_step

        def measure(engine: Any) -> None:
            # between backward and step, as the step frees gradients: a walk over the engine's
            # buffers, so it stays inside the timed step
            self._states = model_states(engine)

        with CommCounter() if self.counting else nullcontext() as fb:  # DeepSpeed steps inside its backward
            loss = train_step(self.engine, self.split(x, y), after_first_backward=measure)
        self.fwd_bwd_comm.append(dict(fb.bytes) if self.counting else None)
        return loss

    def model_states(self) -> ModelStates:
        return self._states

    def zero_grad(self) -> None:
        pass  # the engine zeroes its own gradients

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        from labkit.parallel.deepspeed_zero import full_state_dict

        return full_state_dict(self.engine.module, zero3=self.spec.zero_stage == 3)

    def predicted_model_states(self, n_params: int) -> dict[str, int]:
        # DeepSpeed's ZeRO optimizers keep an fp32 master partition even when training in fp32
        return asdict(model_state_breakdown(n_params, self.world, self.spec.zero_stage, "fp32_master"))
