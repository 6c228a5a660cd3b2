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


def training_state(step: int, meta: dict, losses: list[float],
                   model: nn.Module | None = None, optimizer: torch.optim.Optimizer | None = None,
                   scheduler: LRScheduler | None = None, engine: DeepSpeedEngine | None = None,
                   scaler: torch.amp.GradScaler | None = None, aliases: dict[str, str] | None = None) -> dict:
    """The state a resume needs, ready for :meth:`labkit.fault_tolerance.Checkpointer.save`.

    ``aliases``: parameters whose optimizer state is saved under another's name (a pipeline's last stage
    holds a copy of the tied embedding as ``head.weight``; one process keeps that state as ``wte.weight``),
    so the checkpoint reads the same whichever layout wrote it."""
    state = {"step": step, "meta": meta, "losses": list(losses), LOCAL: {"rng": rng_state()}}
    if engine is not None:  # DeepSpeed: model, optimizer partitions and its scheduler in its own format
        state["engine"] = engine
        return state
    from torch.distributed.checkpoint.state_dict import get_state_dict

    state["model"], osd = get_state_dict(_unwrap(model), optimizer)
    state["optim"] = _renamed(osd, aliases or {})
    if scheduler is not None:
        state["scheduler"] = scheduler.state_dict()
    if scaler is not None:  # fp16 loss scale and its growth counter
        state["scaler"] = scaler.state_dict()
    return state


def restore(ckpt: Checkpointer, meta: dict,
            model: nn.Module | None = None, optimizer: torch.optim.Optimizer | None = None,
            scheduler: LRScheduler | None = None, engine: DeepSpeedEngine | None = None,
            scaler: torch.amp.GradScaler | None = None,
            if_unusable: str = "raise", aliases: dict[str, str] | None = None) -> tuple[int, list[float], list[str]]:
    """Load the newest good checkpoint into the live objects: ``(start_step, losses, notes)``.

    ``(0, [], [])`` when there is none. Raises ValueError for a checkpoint of a different run, and
    CheckpointError when there are checkpoints and none is usable, unless ``if_unusable="start_over"``.
    """
    if not ckpt.steps():
        return 0, [], []
    # get_state_dict gives a fresh optimizer its state (a zero-gradient step at lr 0) to load into
    template = training_state(0, meta, [], model, optimizer, scheduler, engine, scaler, aliases)
    notes: list[str] = []
    found: dict = {}

    def check(saved: dict) -> bool:  # True: another layout saved it
        found.clear()
        found.update(saved["meta"], had_scheduler="scheduler" in saved)
        moved = check_compatible(saved["meta"], meta)
        data = check_corpus(saved["meta"], meta)
        if engine is not None:  # before it loads: what it would restore over this run's settings
            check_engine(saved["meta"], meta)
        notes.extend(moved + data)
        return bool(moved)

    got = ckpt.load_latest(template, check=check,
                           if_unusable=if_unusable)
    if got is None:  # none verified and asked to start over, as a run without checkpoints would
        if optimizer is not None and engine is None:
            optimizer.state.clear()
        return 0, [], [f"skipped step {s}: {why}" for s, why in ckpt.last_skipped]
    step, state = got
    if engine is None:
        from torch.distributed.checkpoint.state_dict import set_state_dict

        back = {v: k for k, v in (aliases or {}).items()}
        set_state_dict(_unwrap(model), optimizer, model_state_dict=state["model"],
                       optim_state_dict=_renamed(state["optim"], back))
        if scheduler is not None and found["had_scheduler"]:
            scheduler.load_state_dict(state["scheduler"])
        elif scheduler is not None:  # warmup added to a run saved without a schedule: at the saved lr, at step
            scheduler.base_lrs, scheduler.last_epoch = [g["lr"] for g in optimizer.param_groups], step
        if scaler is not None:
            scaler.load_state_dict(state["scaler"])
    notes += apply_changes(found, meta, step, optimizer, scheduler, engine)
    if state[LOCAL] is not None:
        set_rng_state(state[LOCAL]["rng"])
    notes += [f"skipped step {s}: {why}" for s, why in ckpt.last_load.skipped]
    return step, list(state["losses"]), notes
