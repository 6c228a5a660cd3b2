"""What a resume meets that changed since the checkpoint was saved: refused in one line, or applied with a note.

Every setting that shapes the trajectory is in the checkpoint's ``meta`` (:func:`labkit.train.loop.train`
writes it). Refused, naming the setting and both values, because the resumed run would be another run:
``seed``, ``batch_size`` and the corpus's bytes (with the step they are the data order), the model (field
by field), ``precision`` and ``lr_schedule`` (the saved optimizer, scaler and scheduler states belong to
them). Applied, each with a note the metrics keep (``resume_notes``): ``lr`` (the schedule scaled to it),
``weight_decay`` (every parameter group: the optimizer state would otherwise bring the saved one back),
``grad_clip`` (read at every step), and ``warmup_steps`` or, under a cosine schedule, ``steps``: the
schedule is a function of the global step, so the run goes on with the new curve's value at the step it
resumes from. A DeepSpeed engine restores its own optimizer and schedule, so there lr, weight decay and
the schedule's settings are refused instead. A setting an older checkpoint did not record is not checked:
such checkpoints resume as before.
"""
from __future__ import annotations

import hashlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch
    from torch.optim.lr_scheduler import LRScheduler

MUST_MATCH = ("seed", "batch_size", "model")  # they define the data order and the parameters
# and these the saved optimizer's, scaler's and scheduler's state: a resume with others is refused
# (checkpoints from before they were recorded resume as before)
MUST_MATCH_IF_SAVED = ("precision", "lr_schedule")
# DeepSpeed's engine loads its optimizer's hyperparameters and its scheduler from its own checkpoint
ENGINE_RESTORES = ("lr", "weight_decay", "warmup_steps")


def corpus_record(path: str | None, data: torch.Tensor) -> dict:
    """What identifies the data source in a checkpoint: the path given (None: the shipped text), and
    the size and SHA-256 of its bytes (exact, and a few milliseconds for the lab's corpora)."""
    return {"path": None if path is None else str(path), "bytes": int(data.numel()),
            "sha256": hashlib.sha256(data.contiguous().numpy()).hexdigest()}


def _refused(key: str, saved: object, new: object, why: str) -> ValueError:
    return ValueError(f"the checkpoint was saved with {key}={saved!r} but this run has {key}={new!r}: {why}; "
                      f"pass {key}={saved!r} again or start in a new checkpoint_dir")


def _check_model(saved: dict, new: dict) -> None:
    diff = [k for k in sorted(set(saved) | set(new)) if saved.get(k) != new.get(k)]
    if diff:  # the fields that differ, not two whole dicts
        was = ", ".join(f"{k}={saved.get(k)!r}" for k in diff)
        raise ValueError(f"the checkpoint was saved with a model of {was} but this run has "
                         f"{', '.join(f'{k}={new.get(k)!r}' for k in diff)}: its parameters would not fit; "
                         f"pass {was} again or start in a new checkpoint_dir")


def _check_corpus(saved: dict, new: dict) -> list[str]:
    def said(c: dict) -> str:
        return f"corpus={c['path']!r} ({c['bytes']} bytes, sha256 {c['sha256'][:12]})"

    if (saved["bytes"], saved["sha256"]) != (new["bytes"], new["sha256"]):
        raise ValueError(f"the checkpoint was saved with {said(saved)} but this run has {said(new)}: the data "
                         f"order would change; pass corpus={saved['path']!r} again (those bytes) or start in a "
                         "new checkpoint_dir")
    if saved["path"] != new["path"]:
        return [f"corpus read from {new['path']!r}, saved from {saved['path']!r}: the same bytes "
                f"(sha256 {new['sha256'][:12]}), so the same data order"]
    return []


def check_compatible(saved: dict, meta: dict) -> list[str]:
    """ValueError when ``saved`` belongs to a different run; notes when strategy or world size changed
    (each such note: the run's layout differs from the saver's).

    ``meta["reshardable"]`` is False for a checkpoint that only loads as it was written, on the strategy,
    world size and ``meta["layout"]`` that wrote it: DeepSpeed's own format (``Strategy.reshardable``).
    Tensor-parallel checkpoints reshard like any DCP checkpoint: the GPT stores its fused QKV matrix
    head-major, so a shard is whole heads at any degree (tests/test_mesh.py resumes a TP x PP x DP run as
    FSDP and as one process)."""
    for key in MUST_MATCH + tuple(k for k in MUST_MATCH_IF_SAVED if k in saved):
        if key == "model" and isinstance(saved.get(key), dict) and isinstance(meta.get(key), dict):
            _check_model(saved["model"], meta["model"])
        elif saved.get(key) != meta.get(key):
            raise _refused(key, saved.get(key), meta.get(key), "resuming would be a different run")
    moved = (saved["strategy"], saved["world_size"], saved.get("layout")) != (
        meta["strategy"], meta["world_size"], meta.get("layout"))
    if moved and not saved.get("reshardable", True):
        raise ValueError(f"a {saved['strategy']} checkpoint ({saved.get('layout') or saved['world_size']} ranks) "
                         f"resumes only as it was saved, not as {meta['strategy']} on {meta['world_size']} ranks "
                         f"({meta.get('layout', '')}); valid: strategy={saved['strategy']!r} with "
                         f"{saved['world_size']} ranks" + (f" and {saved['layout']}" if saved.get("layout") else ""))
    if moved and not meta.get("reshardable", True):  # the checkpoint reshards; the run's engine cannot read it
        readers = ", ".join(map(repr, dict.fromkeys((saved["strategy"], "fsdp", "mesh"))))
        who = "DeepSpeed" if meta["strategy"].startswith("zero") else f"strategy {meta['strategy']!r}"
        raise ValueError(f"strategy={meta['strategy']!r} cannot resume a {saved['strategy']} checkpoint: that "
                         f"one is in DCP's format, and {who} loads only checkpoints it saved itself; resume "
                         f"with a strategy that reads DCP ({readers}, ...) or start {meta['strategy']} in a new "
                         "checkpoint_dir")
    notes = [f"resharded from {saved['strategy']} x{saved['world_size']} to {meta['strategy']} "
             f"x{meta['world_size']}: per-rank RNG streams restart (they belong to the old ranks)"] if moved else []
    return notes


def check_corpus(saved: dict, meta: dict) -> list[str]:
    """ValueError when the run reads other bytes than the checkpoint's (with seed and step they are the
    data order); a note when the same bytes come from another path."""
    return _check_corpus(saved["corpus"], meta["corpus"]) if "corpus" in saved and "corpus" in meta else []


def _schedule_keys(saved: dict, meta: dict) -> list[str]:
    """The schedule's settings that changed: warmup, and the length a cosine decays over."""
    keys = ["warmup_steps"] + (["steps"] if meta.get("lr_schedule") == "cosine" else [])
    return [k for k in keys if k in saved and k in meta and saved[k] != meta[k]]


def check_engine(saved: dict, meta: dict) -> None:
    """Before a DeepSpeed engine loads: what it would silently restore to the saved value, refused."""
    for key in [k for k in ENGINE_RESTORES if k in saved and k in meta] + _schedule_keys(saved, meta):
        if saved[key] != meta[key]:
            raise ValueError(f"{key}={meta[key]!r} differs from the checkpoint's {saved[key]!r}, and DeepSpeed "
                             f"restores its own optimizer and schedule: resume with {key}={saved[key]!r}, or "
                             "start in a new checkpoint_dir")


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


def _new_schedule(keys: list[str], saved: dict, meta: dict, step: int, optimizer: torch.optim.Optimizer,
                  scheduler: LRScheduler | None) -> str:
    """The learning rate of step ``step`` on the new schedule's curve (the loaded one is the old curve's)."""
    groups = optimizer.param_groups
    before = groups[0]["lr"]
    if scheduler is not None:
        for g, base, factor in zip(groups, scheduler.base_lrs, scheduler.lr_lambdas):
            g["lr"] = base * factor(step)
        scheduler._last_lr = [g["lr"] for g in groups]  # what get_last_lr reports until its next step
    else:  # none now: a constant lr without warmup
        for g in groups:
            g["lr"] = meta["lr"]
    what = f"{keys[0]} changed from {saved[keys[0]]} to {meta[keys[0]]}" + "".join(
        f" and {k} from {saved[k]} to {meta[k]}" for k in keys[1:])
    return (f"{what} at resume: applied, the schedule continues from step {step} on the new curve "
            f"(lr {before:.4g} -> {groups[0]['lr']:.4g})")


def apply_changes(saved: dict, meta: dict, step: int, optimizer: torch.optim.Optimizer | None,
                  scheduler: LRScheduler | None, engine: object | None) -> list[str]:
    """After the state is loaded: the settings this run changed, applied, one note each."""
    def changed(key: str) -> bool:
        return key in saved and key in meta and saved[key] != meta[key]

    notes = []
    if changed("lr"):
        notes.append(new_learning_rate(saved["lr"], meta["lr"], optimizer, scheduler, engine))
    if changed("weight_decay") and engine is None and optimizer is not None:
        for group in optimizer.param_groups:  # the loaded state brought the saved one back
            group["weight_decay"] = meta["weight_decay"]
        notes.append(f"weight_decay changed from {saved['weight_decay']:g} to {meta['weight_decay']:g} at resume: "
                     "applied to every parameter group")
    keys = _schedule_keys(saved, meta)
    if keys and engine is None and optimizer is not None:
        notes.append(_new_schedule(keys, saved, meta, step, optimizer, scheduler))
    if changed("grad_clip"):  # the loop and DeepSpeed's config read the run's own value
        notes.append(f"grad_clip changed from {saved['grad_clip']:g} to {meta['grad_clip']:g} at resume: applied "
                     f"from step {step}")
    return notes
