"""What tensor- and pipeline-parallel training share with :func:`labkit.train.train`.

The loops in :mod:`labkit.tensor_parallel` and :mod:`labkit.pipeline_parallel` take the same
``TrainConfig`` and return the same result dict as ``labkit.train.train``, so a model-parallel run
is compared with a single-process one field by field. This module holds that common part: the
checks, AdamW (betas 0.9/0.95) and the learning-rate schedule, gradient clipping over a model whose
parameters are split across ranks, and the per-step timing and collective counting.
"""
from __future__ import annotations

import time
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any, Callable, Iterable, Iterator

import torch
import torch.distributed as dist
import torch.nn as nn

from labkit.comm import CommCounter, ring_volume
from labkit.memory_probe import ModelStates, measured_model_states

if TYPE_CHECKING:  # labkit.train dispatches to the loops that import this module
    from labkit.memory import MemoryEstimate, ModelShape
    from labkit.model import GPTConfig
    from labkit.train import TrainConfig

PRECISIONS = ("fp32", "bf16")


def check_config(cfg: TrainConfig, strategy: str) -> None:
    """The parts of a ``TrainConfig`` the model-parallel loops do not implement: clear errors."""
    if cfg.precision not in PRECISIONS:
        raise ValueError(f"precision={cfg.precision!r} is not supported with strategy={strategy!r}; "
                         f"valid precisions: {list(PRECISIONS)}")
    if cfg.activation_checkpointing != "none":
        raise ValueError(f"activation_checkpointing={cfg.activation_checkpointing!r} is not supported with "
                         f"strategy={strategy!r}; use 'none'")
    if getattr(cfg, "checkpoint_dir", None):
        raise ValueError(f"checkpoint_dir is not supported with strategy={strategy!r}; leave it None")


def device_of(cfg: TrainConfig) -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if cfg.device == "cuda" else torch.device("cpu")


def autocast(cfg: TrainConfig, device: torch.device) -> torch.autocast:
    return torch.autocast(device.type, dtype=torch.bfloat16, enabled=cfg.precision == "bf16")


def make_optimizer(params: list[torch.Tensor], cfg: TrainConfig
                   ) -> tuple[torch.optim.AdamW, torch.optim.lr_scheduler.LambdaLR | None]:
    """AdamW and the schedule exactly as ``labkit.train.train`` builds them."""
    opt = torch.optim.AdamW(params, lr=cfg.lr, betas=(0.9, 0.95), weight_decay=cfg.weight_decay)
    sched = None
    if cfg.lr_schedule != "constant" or cfg.warmup_steps:
        from labkit.train import _lr_factor  # at call time: labkit.train dispatches to this package

        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: _lr_factor(cfg, s))
    return opt, sched


def dtensor_groups(p: torch.Tensor) -> tuple:
    """The process groups a DTensor gradient is sharded over (none for a plain tensor)."""
    g = p.grad
    if not hasattr(g, "placements"):
        return ()
    if any(pl.is_partial() for pl in g.placements):
        raise RuntimeError("a gradient is still Partial (not reduced) when clipping")
    # Not ``is_shard()``: FSDP2's _StridedShard (its dimension of a TP-sharded parameter on a 2-D mesh)
    # answers False to it although it splits the tensor (measured: the 2-D run's norm came out wrong).
    return tuple(g.device_mesh.get_group(i) for i, pl in enumerate(g.placements) if not pl.is_replicate())


def reduce_partial_grads(params: list[torch.Tensor]) -> None:
    """All-reduce DTensor gradients left ``Partial``: under sequence parallelism each rank's LayerNorm
    weight gradient covers only its tokens (Megatron-LM all-reduces these explicitly, its
    ``allreduce_sequence_parallel_grads``). Done before clipping, so the norm sees the true gradient."""
    for p in params:
        g = p.grad
        if hasattr(g, "placements") and any(pl.is_partial() for pl in g.placements):
            from torch.distributed.tensor import Replicate

            p.grad = g.redistribute(placements=[Replicate() if pl.is_partial() else pl for pl in g.placements])


def clip_grad_norm_(params: list[torch.Tensor], max_norm: float,
                    groups_of: Callable[[torch.Tensor], tuple] = dtensor_groups,
                    skip: Iterable[torch.Tensor] = ()) -> float:
    """``torch.nn.utils.clip_grad_norm_`` for a model split across ranks (Megatron-LM's clip_grads).

    The global norm is the square root of the sum of squares of every gradient element, each counted
    once: a gradient split over some process groups (``groups_of(p)``: TP shards, FSDP shards, or
    whole pipeline stages) has its local sum of squares summed over those groups, a replicated one is
    counted as it is. ``skip`` holds copies counted elsewhere (a tied weight's second copy); they are
    scaled but not counted. The scale is torch's ``min(1, max_norm / (norm + 1e-6))``.
    """
    skip_ids = {id(t) for t in skip}
    sums: dict[tuple, torch.Tensor] = {}
    for p in params:
        if p.grad is None or id(p) in skip_ids:
            continue
        key = groups_of(p)
        g = p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad
        sq = g.detach().float().pow(2).sum()
        sums[key] = sums[key] + sq if key in sums else sq
    total = 0.0
    for groups, sq in sums.items():
        for group in groups:  # over every dimension the gradient is split across
            dist.all_reduce(sq, group=group)
        total += sq.item()
    norm = total ** 0.5
    if max_norm:
        coef = min(1.0, max_norm / (norm + 1e-6))
        if coef < 1.0:
            for p in params:
                if p.grad is not None:
                    p.grad.mul_(coef)
    return norm


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class StepRecorder:
    """Wall time and collectives of every step, and this rank's figures in ``labkit.train``'s shape."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.times: list[float] = []
        self.comm: list[dict] = []
        self.calls: list[dict] = []
        self.states: ModelStates | None = None

    @contextmanager
    def step(self) -> Iterator[CommCounter]:
        _sync(self.device)
        t0 = time.perf_counter()
        with CommCounter() as counter:
            yield counter
        _sync(self.device)
        self.times.append(time.perf_counter() - t0)
        self.comm.append(dict(counter.bytes))
        self.calls.append(dict(counter.calls))

    def measure_states(self, model: nn.Module, opt: torch.optim.Optimizer) -> None:
        """Call between the optimizer step and ``zero_grad``: what the rank holds at its fullest."""
        self.states = measured_model_states(model, opt)

    def optimizer_step(self, model: nn.Module, opt: torch.optim.Optimizer,
                       sched: torch.optim.lr_scheduler.LRScheduler | None, params: list[torch.Tensor],
                       cfg: TrainConfig, last: bool,
                       groups_of: Callable[[torch.Tensor], tuple] = dtensor_groups,
                       skip: Iterable[torch.Tensor] = ()) -> None:
        """The end of every step, as ``labkit.train``: clip over the split parameters, step Adam and
        the schedule, measure the model states on the last step, free the gradients."""
        if cfg.grad_clip:
            clip_grad_norm_(params, cfg.grad_clip, groups_of, skip=skip)
        opt.step()
        if sched is not None:
            sched.step()
        if last:
            self.measure_states(model, opt)
        opt.zero_grad(set_to_none=True)

    def rank_figures(self, rank: int, world: int, **extra: Any) -> dict:
        s = self.states
        return {"rank": rank, "step_time_s": self.times,
                "allreduce_bytes_per_step": [b.get("allreduce", 0) for b in self.comm],
                "allreduce_calls_per_step": [c.get("allreduce", 0) for c in self.calls],
                "comm_bytes_per_step": self.comm, "comm_calls_per_step": self.calls,
                "comm_volume_per_step": [ring_volume(b, world) for b in self.comm],
                "model_state_bytes": asdict(s) | {"total": s.total} if s else None, **extra}


def gather_ranks(mine: dict) -> list[dict]:
    world = dist.get_world_size() if dist.is_initialized() else 1
    if world == 1:
        return [mine]
    ranks = [None] * world
    dist.all_gather_object(ranks, mine)
    return ranks


def base_result(cfg: TrainConfig, strategy: str, model_cfg: GPTConfig, world: int, losses: list[float],
                times: list[float], ranks: list[dict], grad_bytes: int, **extra: Any) -> dict:
    """The keys of ``labkit.train.train``'s result (no checkpointing here: none saved or restored)."""
    from labkit.model import GPT

    return {"strategy": strategy, "world_size": world, "device": cfg.device, "steps": cfg.steps,
            "precision": cfg.precision, "activation_checkpointing": cfg.activation_checkpointing,
            "seed": cfg.seed, "batch_size": cfg.batch_size, "model": model_cfg.to_dict(),
            "n_params": GPT.count_params(model_cfg), "grad_bytes": grad_bytes, "loss": losses,
            "step_time_s": times, "ranks": ranks, "start_step": 0, "checkpoints": [], "restored": None,
            "preempted": None, "resume_notes": [], **extra}


def run_many(entry: Callable[..., dict], cfg: TrainConfig, model_cfg: GPTConfig | None,
             variants: list[dict]) -> list[dict]:
    """``entry(cfg, model_cfg, **v)`` for each ``v``, in order, in one process group (one launch):
    e.g. ``launch(run_many, train_tp, cfg, model_cfg, [{"impl": "dtensor"}, {"impl": "scratch"}])``.
    A variant's ``"config"`` entry (a dict) replaces those fields of ``cfg`` for that run."""
    from dataclasses import replace

    out = []
    for v in variants:
        v = dict(v)
        out.append(entry(replace(cfg, **v.pop("config", {})), model_cfg, **v))
    return out


@dataclass(frozen=True)
class Layout:
    """One way to place a model on ``tp x pp x dp`` devices, its per-device memory and pipeline bubble."""

    tp: int
    pp: int
    dp: int
    microbatches: int  # per pipeline per step: global batch / (dp x micro batch)
    bubble: float  # (p - 1) / (m + p - 1) of every step
    estimate: MemoryEstimate
    usable_bytes: int

    @property
    def fits(self) -> bool:
        return self.estimate.total <= self.usable_bytes


def layouts(model: str | float | GPTConfig | ModelShape, n_devices: int, global_batch: int,
            micro_batch: int = 1, devices_per_node: int = 8, device_memory_gb: float = 80.0, stage: int = 1,
            recompute: str = "full", headroom: float = 0.1) -> list[Layout]:
    """Every DP x TP x PP layout of ``n_devices`` (Narayanan et al. 2021, section 3) with the memory
    calculator's per-device bytes: tensor parallel within a node (sequence parallel on), 1F1B
    pipelines, ZeRO ``stage`` over the data-parallel ranks (Megatron's distributed optimizer is 1).
    The global batch bounds data parallelism: each of the ``dp`` pipelines needs whole micro-batches.
    """
    from labkit.memory import GB, estimate_memory, model_shape
    from labkit.pp_timeline import bubble_formula

    shape = model_shape(model)
    if global_batch % micro_batch:
        raise ValueError(f"micro_batch={micro_batch} must divide global_batch={global_batch}")
    out = []
    for tp in (t for t in range(1, devices_per_node + 1) if devices_per_node % t == 0 and shape.heads % t == 0):
        for pp in (p for p in range(1, shape.n_layer + 1) if n_devices % (tp * p) == 0):
            dp = n_devices // (tp * pp)
            if global_batch % (dp * micro_batch) or global_batch // (dp * micro_batch) < pp:
                continue
            m = global_batch // (dp * micro_batch)
            est = estimate_memory(shape, micro_batch, n_devices, stage, "mixed", recompute, tp,
                                  sequence_parallel=tp > 1, device_memory_gb=device_memory_gb, pp=pp)
            out.append(Layout(tp, pp, dp, m, bubble_formula(pp, m), est, int(device_memory_gb * GB * (1 - headroom))))
    return out


def choose_layout(options: list[Layout]) -> Layout | None:
    """The layout that fits with the smallest bubble; ties go to less tensor parallelism (fewer
    all-reduces per layer), then fewer stages. None when nothing fits."""
    fitting = [o for o in options if o.fits]
    return min(fitting, key=lambda o: (round(o.bubble, 6), o.tp, o.pp)) if fitting else None
