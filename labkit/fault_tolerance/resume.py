"""Everything a bit-exact resume needs, captured from and restored into the training loop.

A run resumed from step ``s`` must continue exactly as if it had never stopped, so the checkpoint
holds: model and optimizer state (through ``torch.distributed.checkpoint.state_dict.get_state_dict``
and ``set_state_dict``, which give the same fully qualified names under DDP, FSDP2 or no wrapper, so a
checkpoint moves between strategies and world sizes), the LR scheduler, the step (the data position:
``labkit.core.data.get_batch`` is a pure function of seed and step), the loss history, the RNG states of
Python, NumPy and torch (CPU and CUDA) per rank, and the settings that define the data order. A
DeepSpeed engine saves and loads itself (``engine.save_checkpoint``), scheduler included.

torchtitan stores the world size for the same reason this module refuses a silent mismatch: a
resume that changes seed, global batch or model is a different run.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from labkit.fault_tolerance.checkpointer import LOCAL, Checkpointer
from labkit.fault_tolerance.rng import rng_state, set_rng_state

if TYPE_CHECKING:
    import torch.nn as nn
    from deepspeed import DeepSpeedEngine
    from torch.optim.lr_scheduler import LRScheduler

MUST_MATCH = ("seed", "batch_size", "model")  # they define the data order and the parameters
# and these the saved optimizer's, scaler's and scheduler's state: a resume with others is refused
# (checkpoints from before they were recorded resume as before)
MUST_MATCH_IF_SAVED = ("precision", "lr_schedule")


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


def check_compatible(saved: dict, meta: dict) -> list[str]:
    """ValueError when ``saved`` belongs to a different run; notes when strategy or world size changed.

    ``meta["reshardable"]`` is False for a checkpoint that only loads as it was written, on the strategy,
    world size and ``meta["layout"]`` that wrote it (DeepSpeed's own format; tensor parallelism, whose
    fused QKV rows are stored grouped by rank)."""
    for key in MUST_MATCH + tuple(k for k in MUST_MATCH_IF_SAVED if k in saved):
        if saved.get(key) != meta.get(key):
            raise ValueError(f"the checkpoint was saved with {key}={saved.get(key)!r} but this run has "
                             f"{key}={meta.get(key)!r}: resuming would be a different run; set {key} back "
                             "or start in a new checkpoint_dir")
    notes = []
    moved = (saved["strategy"], saved["world_size"], saved.get("layout")) != (
        meta["strategy"], meta["world_size"], meta.get("layout"))
    if moved and not (saved.get("reshardable", True) and meta.get("reshardable", True)):
        raise ValueError(f"a {saved['strategy']} checkpoint ({saved.get('layout') or saved['world_size']} ranks) "
                         f"resumes only as it was saved, not as {meta['strategy']} on {meta['world_size']} ranks "
                         f"({meta.get('layout', '')}); valid: strategy={saved['strategy']!r} with "
                         f"{saved['world_size']} ranks" + (f" and {saved['layout']}" if saved.get("layout") else ""))
    if moved:
        notes.append(f"resharded from {saved['strategy']} x{saved['world_size']} to {meta['strategy']} "
                     f"x{meta['world_size']}: per-rank RNG streams restart (they belong to the old ranks)")
    return notes


def new_learning_rate(saved: float, new: float, optimizer, scheduler, engine) -> str:
    """Apply a learning rate changed at resume: the schedule continues at the same point of its curve,
    scaled to the new peak. The note says what was done (the metrics record it)."""
    if engine is not None or optimizer is None:
        raise ValueError(f"lr={new!r} differs from the checkpoint's {saved!r}, and this strategy's optimizer "
                         "restores its own learning rate: resume with --lr set back to the saved value")
    for group in optimizer.param_groups:
        group["lr"] = group["lr"] * new / saved
    if scheduler is not None:
        scheduler.base_lrs = [b * new / saved for b in scheduler.base_lrs]
    return f"lr changed from {saved:g} to {new:g} at resume: applied, the schedule scaled to it"


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
        found.update(saved["meta"])
        moved = check_compatible(saved["meta"], meta)
        notes.extend(moved)
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
        if scheduler is not None:
            scheduler.load_state_dict(state["scheduler"])
        if scaler is not None:
            scaler.load_state_dict(state["scaler"])
    if "lr" in found and "lr" in meta and found["lr"] != meta["lr"]:
        notes.append(new_learning_rate(found["lr"], meta["lr"], optimizer, scheduler, engine))
    if state[LOCAL] is not None:
        set_rng_state(state[LOCAL]["rng"])
    notes += [f"skipped step {s}: {why}" for s, why in ckpt.last_load.skipped]
    return step, list(state["losses"]), notes
