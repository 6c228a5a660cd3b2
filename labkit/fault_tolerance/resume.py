"""Everything a bit-exact resume needs, captured from and restored into the training loop.

A run resumed from step ``s`` must continue exactly as if it had never stopped, so the checkpoint
holds: model and optimizer state (through ``torch.distributed.checkpoint.state_dict.get_state_dict``
and ``set_state_dict``, which give the same fully qualified names under DDP, FSDP2 or no wrapper, so a
checkpoint moves between strategies and world sizes), the LR scheduler, the step (the data position:
``labkit.core.data.get_batch`` is a pure function of seed and step), the loss history, the RNG states of
Python, NumPy and torch (CPU and CUDA) per rank, and the settings that define the data order. A
DeepSpeed engine saves and loads itself (``engine.save_checkpoint``), scheduler included.

torchtitan stores the world size for the same reason this module refuses a silent mismatch: a
resume that changes seed, global batch, corpus or model is a different run. What a resume meets that
changed is refused in one line or applied with a note (:mod:`labkit.fault_tolerance.changes`).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from labkit.fault_tolerance.changes import (  # noqa: F401 - part of this module's names
    MUST_MATCH,
    MUST_MATCH_IF_SAVED,
    apply_changes,
    check_compatible,
    check_corpus,
    check_engine,
    new_learning_rate,
)
from labkit.fault_tolerance.checkpointer import LOCAL, Checkpointer
from labkit.fault_tolerance.rng import rng_state, set_rng_state

if TYPE_CHECKING:
    import torch.nn as nn
    from deepspeed import DeepSpeedEngine
    from torch.optim.lr_scheduler import LRScheduler


def _unwrap(model):
    return getattr(model, "module", model)  # DDP and the hand-written data parallels keep it in .module


def _renamed(osd: dict, names: dict[str, str]) -> dict:
    """An optimizer state dict (DCP's, keyed by parameter name) with parameters renamed."""
    if not names:
        return osd
    return {**osd, "state": {names.get(k, k): v for k, v in osd["state"].items()},
            "param_groups": [{**g, "params": [names.get(p, p) for p in g["params"]]} for g in osd["param_groups"]]}


@dataclass(eq=False)
class TrainState:
    """What a run trains, saved and restored as one object with the protocol of DCP's ``Stateful``
    (``state_dict`` and ``load_state_dict``): the model and its optimizer, by parameter name, the LR
    scheduler and fp16's loss scaler; or DeepSpeed's engine, which saves and loads itself.

    ``aliases``: parameters whose optimizer state is saved under another's name (a pipeline's last stage
    holds a copy of the tied embedding as ``head.weight``; one process keeps that state as ``wte.weight``),
    so the checkpoint reads the same whichever layout wrote it."""

    model: nn.Module | None = None
    optimizer: torch.optim.Optimizer | None = None
    scheduler: LRScheduler | None = None
    engine: DeepSpeedEngine | None = None
    scaler: torch.amp.GradScaler | None = None
    aliases: dict[str, str] = field(default_factory=dict)

    def state_dict(self) -> dict:
        if self.engine is not None:  # DeepSpeed: model, optimizer partitions and its scheduler in its own format
            return {"engine": self.engine}
        from torch.distributed.checkpoint.state_dict import get_state_dict

        model, osd = get_state_dict(_unwrap(self.model), self.optimizer)
        state = {"model": model, "optim": _renamed(osd, self.aliases)}
        if self.scheduler is not None:
            state["scheduler"] = self.scheduler.state_dict()
        if self.scaler is not None:  # fp16 loss scale and its growth counter
            state["scaler"] = self.scaler.state_dict()
        return state

    def load_state_dict(self, state: dict) -> None:
        """``state``: a checkpoint as :func:`training_state` made it (its ``step`` included)."""
        if self.engine is not None:
            return  # the engine loaded itself, in the checkpointer's read
        from torch.distributed.checkpoint.state_dict import set_state_dict

        back = {v: k for k, v in self.aliases.items()}
        set_state_dict(_unwrap(self.model), self.optimizer, model_state_dict=state["model"],
                       optim_state_dict=_renamed(state["optim"], back))
        if self.scheduler is not None and "scheduler" in state:
            self.scheduler.load_state_dict(state["scheduler"])
        elif self.scheduler is not None:  # warmup added to a run saved without a schedule: at the saved lr, at step
            self.scheduler.base_lrs = [g["lr"] for g in self.optimizer.param_groups]
            self.scheduler.last_epoch = state["step"]
        if self.scaler is not None:
            self.scaler.load_state_dict(state["scaler"])


def training_state(step: int, meta: dict, losses: list[float], train: TrainState) -> dict:
    """The state a resume needs, ready for :meth:`labkit.fault_tolerance.Checkpointer.save`: the step,
    the run's settings, the loss history, this rank's RNG states and ``train``'s state dict."""
    return {"step": step, "meta": meta, "losses": list(losses), LOCAL: {"rng": rng_state()},
            **train.state_dict()}


def restore(ckpt: Checkpointer, meta: dict, train: TrainState,
            if_unusable: str = "raise") -> tuple[int, list[float], list[str]]:
    """Load the newest good checkpoint into ``train``'s live objects: ``(start_step, losses, notes)``.

    ``(0, [], [])`` when there is none. Raises ValueError for a checkpoint of a different run, and
    CheckpointError when there are checkpoints and none is usable, unless ``if_unusable="start_over"``.
    """
    if not ckpt.steps():
        return 0, [], []
    # get_state_dict gives a fresh optimizer its state (a zero-gradient step at lr 0) to load into
    template = training_state(0, meta, [], train)
    notes: list[str] = []
    found: dict = {}

    def check(saved: dict) -> bool:  # True: another layout saved it
        found.clear()
        found.update(saved["meta"], had_scheduler="scheduler" in saved)
        moved = check_compatible(saved["meta"], meta)
        data = check_corpus(saved["meta"], meta)
        if train.engine is not None:  # before it loads: what it would restore over this run's settings
            check_engine(saved["meta"], meta)
        notes.extend(moved + data)
        return bool(moved)

    got = ckpt.load_latest(template, check=check,
                           if_unusable=if_unusable)
    if got is None:  # none verified and asked to start over, as a run without checkpoints would
        if train.optimizer is not None and train.engine is None:
            train.optimizer.state.clear()
        return 0, [], [f"skipped step {s}: {why}" for s, why in ckpt.last_skipped]
    step, state = got
    # what the checkpoint held: the template's own scheduler entry is not the saved one
    train.load_state_dict({**{k: v for k, v in state.items() if k != "scheduler" or found["had_scheduler"]},
                           "step": step})
    notes += apply_changes(found, meta, step, train.optimizer, train.scheduler, train.engine)
    if state[LOCAL] is not None:
        set_rng_state(state[LOCAL]["rng"])
    notes += [f"skipped step {s}: {why}" for s, why in ckpt.last_load.skipped]
    return step, list(state["losses"]), notes
