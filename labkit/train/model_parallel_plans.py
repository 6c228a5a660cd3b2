"""How tensor and pipeline parallelism run the one loop (:mod:`labkit.train.plans` for the interface).

* :class:`TensorParallelPlan` (strategies ``tp`` and ``tp_scratch``): Megatron-LM's split of every
  block over ``tp`` ranks, with DTensor or with the hand-written ``f``/``g`` layers; the other
  ``world / tp`` ranks are FSDP2 data parallel over a 2-D (dp, tp) mesh. Each tensor-parallel group
  reads its data-parallel rank's rows; the norm for clipping sums every split gradient once.
* :class:`PipelinePlan` (``pp`` and ``pp_scratch``): the layers cut into one stage per rank (two
  chunks per rank when interleaved), every rank reading the global batch, which the schedule cuts
  into microbatches. The stages' timeline, bubble and activations in flight are recorded.
"""
from __future__ import annotations

import statistics
from typing import TYPE_CHECKING, Any, ContextManager

import torch
import torch.distributed as dist
import torch.nn as nn

from labkit.parallel import pipeline_parallel as pipe
from labkit.parallel import tensor_parallel as tpar
from labkit.parallel.activation_checkpointing import apply as apply_checkpointing
from labkit.parallel.clipping import (
    clip_grad_norm_,
    dtensor_groups,
    reduce_partial_grads,
)
from labkit.parallel.pipeline_timeline import (
    ActivationMeter,
    Event,
    Timeline,
    bubble_formula,
    bubble_fraction,
)
from labkit.train.plans import Plan

if TYPE_CHECKING:
    from labkit.core.model import GPT
    from labkit.train.config import TrainConfig
    from labkit.train.strategies import Strategy


def _fp32_adamw_states(n: float) -> dict[str, int]:
    # fp32 AdamW: 4 bytes of weights, 4 of gradients, 8 of moments per parameter the rank holds
    return {"params": round(4 * n), "grads": round(4 * n), "optimizer": round(8 * n), "grad_accum": 0}


class TensorParallelPlan(Plan):
    @property
    def scratch(self) -> bool:
        return self.spec.name == "tp_scratch"

    @property
    def tp(self) -> int:
        return self.cfg.tp or self.world

    @property
    def dp(self) -> int:
        return self.world // self.tp

    @property
    def layout(self) -> str:
        return f"tp={self.tp} dp={self.dp}"

    def check_run(self) -> None:
        tpar.check_tp(self.tp, self.model_cfg, self.world)
        if self.dp > 1 and (self.scratch or self.cfg.sequence_parallel):
            raise ValueError(f"world_size={self.world} with tp={self.tp} needs data parallelism (FSDP2 on a 2-D "
                             "mesh), which runs with strategy 'tp' and sequence_parallel=False; set "
                             "tp=world_size otherwise")
        if self.cfg.sequence_parallel and self.model_cfg.block_size % self.tp:
            raise ValueError(f"sequence_parallel needs tp={self.tp} to divide block_size="
                             f"{self.model_cfg.block_size}")
        super().check_run()

    @property
    def data_rank(self) -> int:
        return self.rank // self.tp  # the mesh is (dp, tp), row-major: ranks of one TP group are adjacent

    @property
    def data_world(self) -> int:
        return self.dp

    def wrap(self, model: GPT) -> nn.Module:
        self.group, self.dp_group = None, None
        if self.world == 1:
            return model
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh(self.device.type, (self.dp, self.tp), mesh_dim_names=("dp", "tp"))
        self.group, self.dp_group = mesh["tp"].get_group(), mesh["dp"].get_group()
        if self.scratch:
            tpar.parallelize_scratch(model, self.group)
        else:
            tpar.parallelize_dtensor(model, mesh["tp"], self.cfg.sequence_parallel)
        if self.dp > 1:  # FSDP2 over the data-parallel dimension, on top of the TP-sharded blocks
            from torch.distributed.fsdp import fully_shard

            for block in model.blocks:
                fully_shard(block, mesh=mesh["dp"])
            fully_shard(model, mesh=mesh["dp"])
        return model

    def no_sync(self, last: bool) -> ContextManager:
        if self.dp > 1:
            self.model.set_requires_gradient_sync(last)
        return super().no_sync(last)

    def finish_backward(self) -> None:
        reduce_partial_grads(self.params)

    def _groups_of(self, p: torch.Tensor) -> tuple:
        if self.scratch:
            return (self.group,) if getattr(p, "tp_shard_dim", None) is not None else ()
        return dtensor_groups(p)

    def clip(self, max_norm: float) -> None:
        clip_grad_norm_(self.params, max_norm, self._groups_of)

    def global_loss(self, local: torch.Tensor) -> torch.Tensor:
        loss = local.clone()
        if self.dp > 1:  # every TP rank of a data-parallel group holds the same loss
            dist.all_reduce(loss, group=self.dp_group)
            loss /= self.dp
        return loss

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        return tpar.full_state_dict(self.model, self.tp, self.group)

    def predicted_model_states(self, n_params: int) -> dict[str, int]:
        return _fp32_adamw_states(tpar.params_per_rank(self.model_cfg, self.tp) / self.dp)

    def result_fields(self, ranks: list[dict]) -> dict[str, Any]:
        rows = self.cfg.batch_size // self.dp
        return {"tp": self.tp, "dp": self.dp, "impl": "scratch" if self.scratch else "dtensor",
                "sequence_parallel": self.cfg.sequence_parallel,
                "comm_formula_bytes_per_step": self.model_cfg.n_layer * tpar.comm_bytes_per_layer(
                    rows, self.model_cfg.block_size, self.model_cfg.n_embd, 4 if self.cfg.precision == "fp32" else 2)}


class PipelinePlan(Plan):
    @classmethod
    def check_config(cls, cfg: TrainConfig, spec: Strategy) -> None:
        if spec.name == "pp_scratch" and cfg.pp_schedule == "interleaved":
            raise ValueError("pp_schedule='interleaved' needs torch pipelining (strategy 'pp'); the hand-written "
                             "pipeline (strategy 'pp_scratch') has 'gpipe' and '1f1b'")

    @property
    def scratch(self) -> bool:
        return self.spec.name == "pp_scratch"

    @property
    def pp(self) -> int:
        return self.cfg.pp or self.world

    @property
    def virtual(self) -> int:
        return pipe.VIRTUAL[self.cfg.pp_schedule]

    @property
    def layout(self) -> str:
        return f"pp={self.pp} virtual={self.virtual}"

    def check_run(self) -> None:
        pipe.check_pp(self.pp, self.model_cfg.n_layer, self.cfg.microbatches, self.cfg.pp_schedule,
                      self.cfg.batch_size, "scratch" if self.scratch else "torch")
        if self.pp != self.world:
            raise ValueError(f"pp={self.pp} must equal world_size={self.world}: one stage per rank, no data "
                             "parallelism here")

    @property
    def data_rank(self) -> int:  # every stage sees the global batch: the first feeds it, the last scores it
        return 0

    @property
    def data_world(self) -> int:
        return 1

    def prepare(self, model: GPT) -> nn.Module:
        apply_checkpointing(model, self.cfg.activation_checkpointing)
        n_stages = self.pp * self.virtual
        stages = [pipe.GPTStage(model, self.rank + k * self.pp, n_stages)  # interleaved: r, r + p, ...
                  for k in range(self.virtual)]
        self.model = pipe.RankStages(stages)
        self.meter = ActivationMeter(self.model)
        self.timeline = Timeline(self.rank, self.device, self.meter)
        self.peaks: list[int] = []
        # every rank takes part in new_group, whether or not it is in the group
        self.tied_group = dist.new_group([0, self.pp - 1]) if self.pp > 1 else None
        T, C, V = self.model_cfg.block_size, self.model_cfg.n_embd, self.model_cfg.vocab_size
        self.micro_shape = (self.cfg.batch_size // self.cfg.microbatches, T, C, V)
        self.loss_scale = 1.0
        if not self.scratch:
            logits_dtype = torch.float32 if self.cfg.precision == "fp32" else {
                "bf16": torch.bfloat16, "fp16": torch.float16}[self.cfg.precision]  # autocast's head output
            self.schedule = pipe.build_schedule(stages, n_stages, self.device, self.timeline, self.cfg.microbatches,
                                                self.cfg.pp_schedule, self.micro_shape, logits_dtype, self._loss)
        return self.model

    def _loss(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return pipe.lm_loss(logits, targets) * self.loss_scale if self.scaler else pipe.lm_loss(logits, targets)

    def split(self, x: torch.Tensor, y: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
        return [(x, y)]  # the schedule cuts the microbatches itself

    def forward_backward(self, micros: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
        (x, y), = micros
        self.timeline.start()
        if self.scaler:  # the schedule computes the loss: scale it there (this also starts the scaler)
            self.loss_scale = float(self.scaler.scale(torch.ones((), device=self.device)))
        mb_losses: list[torch.Tensor] = []
        with self.meter, self.autocast():
            if self.scratch:
                mb = self.micro_shape[0]
                mb_losses = pipe.scratch_step(self.model.parts[0], self.cfg.pp_schedule, self.pp, list(x.split(mb)),
                                              list(y.split(mb)), self.timeline, self.micro_shape[:3], torch.float32,
                                              loss_scale=self.loss_scale if self.scaler else 1.0)
            else:
                last = self.model.last is not None
                kwargs = {"target": y, "losses": mb_losses} if last else {}
                kwargs["return_outputs"] = False  # else the last stage keeps every microbatch's logits
                self.schedule.step(*((x,) if self.model.first is not None else ()), **kwargs)
        if self.model.last is None:
            return torch.zeros((), device=self.device)
        loss = torch.stack(mb_losses).mean()
        return loss / self.loss_scale if self.scaler and not self.scratch else loss

    def finish_backward(self) -> None:
        if self.tied_group is not None and (self.model.first is not None or self.model.last is not None):
            # Like Megatron-LM's embedding group: the two copies of the tied matrix get the sum of
            # both gradients, so they stay equal.
            tied = self.model.first.wte.weight if self.model.first is not None else self.model.last.head.weight
            dist.all_reduce(tied.grad, group=self.tied_group)

    def before_step(self) -> None:
        if self.world > 1:
            dist.barrier()  # the common start of the step's timeline

    def after_step(self) -> None:
        self.timeline.finish()
        self.peaks.append(self.meter.peak)

    def clip(self, max_norm: float) -> None:
        # stages hold disjoint parameters: clip over the squares summed on all; the head copy is skipped
        last = self.model.last
        clip_grad_norm_(self.params, max_norm, lambda p: (None,) if self.world > 1 else (),
                        skip=[last.head.weight] if last is not None and self.pp > 1 else [])

    def global_loss(self, local: torch.Tensor) -> torch.Tensor:
        loss = local.clone()
        if self.world > 1:
            dist.broadcast(loss, src=self.pp - 1)
        return loss

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        from labkit.core.devices import gather_objects

        mine = {k: t.detach().cpu().clone() for k, t in self.model.state_dict().items()}
        return {k: t for part in gather_objects(mine) for k, t in part.items()}

    def _params_per_rank(self) -> list[int]:
        n_stages = self.pp * self.virtual
        return [sum(pipe.stage_params(self.model_cfg, n_stages, r + k * self.pp) for k in range(self.virtual))
                for r in range(self.pp)]

    def predicted_model_states(self, n_params: int) -> dict[str, int]:
        return _fp32_adamw_states(max(self._params_per_rank()))  # the binding (largest) stage

    def rank_figures(self) -> dict[str, Any]:
        saved = [e.saved_bytes for st in self.timeline.steps for e in st if e.kind == "F"]
        return {**super().rank_figures(), "peak_activation_bytes": self.peaks,
                "activation_bytes_per_microbatch": statistics.median(saved) if saved else 0,
                "events": [[e.__dict__ for e in st] for st in self.timeline.steps]}

    def result_fields(self, ranks: list[dict]) -> dict[str, Any]:
        steps = len(ranks[0]["events"])
        steps_events = [[Event(**e) for r in ranks for e in r["events"][i]] for i in range(steps)]
        per_step = [bubble_fraction(evs) for evs in steps_events]
        for r in ranks:
            del r["events"]
        n_stages = self.pp * self.virtual
        return {"pp": self.pp, "microbatches": self.cfg.microbatches, "pp_schedule": self.cfg.pp_schedule,
                "impl": "scratch" if self.scratch else "torch", "virtual_stages": self.virtual,
                "stage_layers": pipe.stage_bounds(self.model_cfg.n_layer, n_stages),
                "bubble_fraction": statistics.median(per_step[1:] or per_step) if per_step else None,
                "bubble_fraction_per_step": per_step,
                "bubble_formula": bubble_formula(self.pp, self.cfg.microbatches, self.virtual),
                "timeline": [e.__dict__ for e in steps_events[-1]] if steps_events else [],
                "predicted_params_per_rank": self._params_per_rank()}
