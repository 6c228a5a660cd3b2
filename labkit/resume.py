"""Everything a bit-exact resume needs, captured from and restored into the training loop.

A run resumed from step ``s`` must continue exactly as if it had never stopped, so the checkpoint
holds: model and optimizer state (through ``torch.distributed.checkpoint.state_dict.get_state_dict``
and ``set_state_dict``, which give the same fully qualified names under DDP, FSDP2 or no wrapper, so a
checkpoint moves between strategies and world sizes), the LR scheduler, the step (the data position:
``labkit.data.get_batch`` is a pure function of seed and step), the loss history, the RNG states of
Python, NumPy and torch (CPU and CUDA) per rank, and the settings that define the data order. A
DeepSpeed engine saves and loads itself (``engine.save_checkpoint``), scheduler included.

torchtitan stores the world size for the same reason this module refuses a silent mismatch: a
resume that changes seed, global batch or model is a different run.
"""
from __future__ import annotations

import json
import math
import os
import random
import threading
import time
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch
import torch.distributed as dist

from labkit.preemption import CONTINUE, SAVE_AND_EXIT, PreemptionHandler, check_grace

if TYPE_CHECKING:
    import torch.nn as nn
    from deepspeed import DeepSpeedEngine
    from torch.optim.lr_scheduler import LRScheduler

    from labkit.fault_tolerance import Checkpointer
    from labkit.train import TrainConfig

MUST_MATCH = ("seed", "batch_size", "model")  # they define the data order and the parameters
# `python -m labkit.train --help` for the fault-tolerance flags (batch scripts read these)
CLI_HELP = {
    "checkpoint_dir": "save checkpoints here and resume from the newest good one (labkit.fault_tolerance)",
    "save_every": "steps between checkpoints; 0: only at the end and on preemption",
    "keep_last": "checkpoints to keep (the newest always)",
    "async_save": "block training only for the copy to host memory; write in a background thread",
    "resume": "start from the newest good checkpoint in --checkpoint-dir (--no-resume refuses a non-empty one)",
    "grace_s": "seconds from SIGTERM/SIGUSR1 to SIGKILL: finish the step, save if it fits, exit 75 (requeue)",
    "reserve_s": "seconds of --grace-s kept back for leaving cleanly: a save that would eat into them is skipped",
    "step_log": "append one JSON line per step, checkpoint, restore and preemption (rank 0)",
    "lr_schedule": "constant, or cosine decay to lr/10 at the last step (after --warmup-steps)",
    "tp": "strategy tp: tensor-parallel degree (0: every rank; the other world/tp ranks are FSDP2 data parallel)",
    "pp": "strategy pp: pipeline stages, one per rank (0: every rank)",
    "microbatches": "strategy pp: microbatches the global batch is cut into",
    "schedule": "strategy pp: pipeline schedule",
}


def rng_state() -> dict:
    """This process's RNG states: Python, NumPy, torch CPU and, when CUDA is in use, every GPU's."""
    np_state = np.random.get_state()
    state = {"python": random.getstate(), "torch": torch.get_rng_state(),
             "numpy": [np_state[0], np_state[1].tolist(), *map(_py, np_state[2:])]}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def seed_rngs(seed: int, rank: int = 0) -> None:
    """Seed Python, NumPy and torch (CPU and CUDA) per rank, so a run's random draws (dropout) depend
    on its seed and rank only, not on what the process did before."""
    s = seed * 1_000_003 + rank
    random.seed(s)
    np.random.seed(s % 2**32)
    torch.manual_seed(s)


def _py(v):
    return v.item() if hasattr(v, "item") else v


def set_rng_state(state: dict) -> None:
    random.setstate(state["python"])
    kind, key, *rest = state["numpy"]
    np.random.set_state((kind, np.array(key, dtype=np.uint32), *rest))
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def _unwrap(model):
    return getattr(model, "module", model)  # DDP and the hand-written data parallels keep it in .module


def training_state(step: int, meta: dict, losses: list[float],
                   model: nn.Module | None = None, optimizer: torch.optim.Optimizer | None = None,
                   scheduler: LRScheduler | None = None, engine: DeepSpeedEngine | None = None,
                   scaler: torch.amp.GradScaler | None = None) -> dict:
    """The state a resume needs, ready for :meth:`labkit.fault_tolerance.Checkpointer.save`."""
    from labkit.fault_tolerance import LOCAL

    state = {"step": step, "meta": meta, "losses": list(losses), LOCAL: {"rng": rng_state()}}
    if engine is not None:  # DeepSpeed: model, optimizer partitions and its scheduler in its own format
        state["engine"] = engine
        return state
    from torch.distributed.checkpoint.state_dict import get_state_dict

    state["model"], state["optim"] = get_state_dict(_unwrap(model), optimizer)
    if scheduler is not None:
        state["scheduler"] = scheduler.state_dict()
    if scaler is not None:  # fp16 loss scale and its growth counter
        state["scaler"] = scaler.state_dict()
    return state


def check_checkpointing(cfg: TrainConfig) -> None:
    """Clear errors for checkpoint settings a strategy cannot honour (called by ``TrainConfig``)."""
    if cfg.checkpoint_dir and cfg.strategy == "zero1_scratch":
        raise ValueError("checkpoint_dir is not supported with strategy='zero1_scratch' (its sharded optimizer "
                         "has no state_dict); use 'zero1' (DeepSpeed) or 'fsdp'")
    if cfg.async_save and cfg.strategy in ("zero1", "zero2", "zero3"):
        raise ValueError(f"async_save=True is not supported with strategy={cfg.strategy!r}: DeepSpeed writes its "
                         "checkpoints synchronously (engine.save_checkpoint); use async_save=False")
    check_grace(cfg.grace_s, cfg.reserve_s)


def check_compatible(saved: dict, meta: dict) -> list[str]:
    """ValueError when ``saved`` belongs to a different run; notes when strategy or world size changed."""
    for key in MUST_MATCH:
        if saved.get(key) != meta.get(key):
            raise ValueError(f"the checkpoint was saved with {key}={saved.get(key)!r} but this run has "
                             f"{key}={meta.get(key)!r}: resuming would be a different run; set {key} back "
                             "or start in a new checkpoint_dir")
    notes = []
    ds = ("zero1", "zero2", "zero3")
    if saved["strategy"] != meta["strategy"] or saved["world_size"] != meta["world_size"]:
        if saved["strategy"] in ds or meta["strategy"] in ds:
            raise ValueError(f"a DeepSpeed checkpoint resumes only with the strategy and world size it was saved "
                             f"with ({saved['strategy']} on {saved['world_size']} ranks), not "
                             f"{meta['strategy']} on {meta['world_size']}; valid: strategy={saved['strategy']!r} "
                             f"with {saved['world_size']} ranks")
        notes.append(f"resharded from {saved['strategy']} x{saved['world_size']} to {meta['strategy']} "
                     f"x{meta['world_size']}: per-rank RNG streams restart (they belong to the old ranks)")
    return notes


def restore(ckpt: Checkpointer, meta: dict,
            model: nn.Module | None = None, optimizer: torch.optim.Optimizer | None = None,
            scheduler: LRScheduler | None = None, engine: DeepSpeedEngine | None = None,
            scaler: torch.amp.GradScaler | None = None) -> tuple[int, list[float], list[str]]:
    """Load the newest good checkpoint into the live objects: ``(start_step, losses, notes)``.

    ``(0, [], [])`` when there is none. Raises ValueError for a checkpoint of a different run.
    """
    from labkit.fault_tolerance import LOCAL

    if not ckpt.steps():
        return 0, [], []
    # get_state_dict gives a fresh optimizer its state (a zero-gradient step at lr 0) to load into
    template = training_state(0, meta, [], model, optimizer, scheduler, engine, scaler)
    notes: list[str] = []
    got = ckpt.load_latest(template, check=lambda saved: notes.extend(check_compatible(saved["meta"], meta)))
    if got is None:  # none verified: start over, as a run without checkpoints would
        if optimizer is not None and engine is None:
            optimizer.state.clear()
        return 0, [], [f"skipped step {s}: {why}" for s, why in ckpt.last_skipped]
    step, state = got
    if engine is None:
        from torch.distributed.checkpoint.state_dict import set_state_dict

        set_state_dict(_unwrap(model), optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
        if scheduler is not None:
            scheduler.load_state_dict(state["scheduler"])
        if scaler is not None:
            scaler.load_state_dict(state["scaler"])
    if state[LOCAL] is not None:
        set_rng_state(state[LOCAL]["rng"])
    notes += [f"skipped step {s}: {why}" for s, why in ckpt.last_load.skipped]
    return step, list(state["losses"]), notes


class StepLog:
    """Append-only JSON lines (one per event) that survive a SIGKILL of the writer: rank 0 logs steps,
    checkpoints and restores; every rank logs its start (pid, restart count) so a fault injector can
    find it."""

    def __init__(self, path: str | os.PathLike | None) -> None:
        self.path = Path(path) if path else None
        self.rank = dist.get_rank() if dist.is_initialized() else 0
        self.restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", 0))
        if self.path:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self.event("start", all_ranks=True, pid=os.getpid())

    def event(self, kind: str, all_ranks: bool = False, **fields) -> None:
        if self.path is None or (self.rank != 0 and not all_ranks):
            return
        line = json.dumps({"event": kind, "rank": self.rank, "restart": self.restart, "time": time.time(), **fields})
        with open(self.path, "a") as f:  # one write of one line: appends from several ranks stay whole
            f.write(line + "\n")


class Resumable:
    """The training loop's side of fault tolerance, for ``labkit.train``: resume at the start, save
    every ``save_every`` steps and at the end, and on SIGTERM/SIGUSR1 finish the step, save, stop."""

    def __init__(self, cfg: TrainConfig, meta: dict,
                 model: nn.Module | None = None, optimizer: torch.optim.Optimizer | None = None,
                 scheduler: LRScheduler | None = None, engine: DeepSpeedEngine | None = None,
                 scaler: torch.amp.GradScaler | None = None) -> None:
        self.cfg, self.meta, self.objs = cfg, meta, (model, optimizer, scheduler, engine, scaler)
        self.log = StepLog(cfg.step_log)
        self.ckpt = None
        if cfg.checkpoint_dir:  # DCP imports in ~1 s: only runs that checkpoint pay for it
            from labkit.fault_tolerance import Checkpointer

            self.ckpt = Checkpointer(cfg.checkpoint_dir, cfg.keep_last, cfg.async_save)
        self.handler: PreemptionHandler | None = None
        self.saves: list[dict] = []
        self.restored: dict | None = None
        self.preempted: dict | None = None
        self.notes: list[str] = []
        self._last_saved = -1

    def start(self) -> tuple[int, list[float]]:
        """The step to start from and the loss history so far."""
        if self.ckpt is None:
            return 0, []
        if not self.cfg.resume and self.ckpt.steps():
            raise ValueError(f"checkpoint_dir={self.cfg.checkpoint_dir!r} already holds checkpoints up to step "
                             f"{self.ckpt.steps()[-1]}; with resume=False the runs would mix: use a new directory")
        t0 = time.perf_counter()
        try:
            step, losses, self.notes = restore(self.ckpt, self.meta, *self.objs)
        except BaseException:
            self.ckpt.close()
            raise
        if threading.current_thread() is threading.main_thread():  # signals reach the main thread only
            self.handler = PreemptionHandler(self.cfg.grace_s, self.cfg.reserve_s).install()
        if step:
            self.restored = {"step": step, "seconds": time.perf_counter() - t0,
                             "saved_world_size": self.ckpt.last_load.world_size}
            self._last_saved = step
        self.log.event("restore", step=step, seconds=time.perf_counter() - t0, notes=self.notes)
        return step, losses

    def _save(self, step: int, losses: list[float]) -> None:
        self._record(self.ckpt.wait())
        stats = self.ckpt.save(step, training_state(step, self.meta, losses, *self.objs))
        self._last_saved = step
        self.log.event("save", step=step, blocking_s=stats.blocking_s, is_async=not stats.done)
        if stats.done:
            self._record(stats)

    def _record(self, stats) -> None:
        if stats is not None:
            self.saves.append(asdict(stats))
            self.log.event("saved", **{k: v for k, v in asdict(stats).items() if k != "done"})

    def end_of_step(self, step: int, losses: list[float]) -> bool:
        """After ``step`` steps are done: log, save if due; True when a preemption says stop now."""
        self.log.event("step", step=step, loss=losses[-1])
        if self.ckpt is None:
            return False
        if step == self.cfg.steps or (self.cfg.save_every and step % self.cfg.save_every == 0):
            self._save(step, losses)
        if self.handler is None:
            return False
        estimate = max((s["total_s"] for s in self.saves), default=0.0)
        action = self.handler.poll(estimate)
        if action == CONTINUE or step == self.cfg.steps:
            return False
        if action == SAVE_AND_EXIT and self._last_saved != step:
            self._save(step, losses)
        self._record(self.ckpt.wait())  # an async save in flight must be durable before we leave
        self.preempted = {"signal": self.handler.signal_name, "step": step, "saved": self._last_saved == step,
                          "time_left_s": self.handler.time_left()}
        self.log.event("preempted", **self.preempted)
        return True

    def abort(self) -> None:
        """The loop failed: give the signals back at once (no saving, no waiting for a save in flight)."""
        if self.handler is not None:
            self.handler.uninstall()

    def finish(self) -> dict:
        """Wait for the last save, restore the signal handlers; what the result reports."""
        try:
            if self.ckpt is not None:
                self._record(self.ckpt.wait())
                self.ckpt.close()
        finally:
            if self.handler is not None:
                self.handler.uninstall()
        return {"checkpoints": self.saves, "restored": self.restored, "preempted": self.preempted,
                "resume_notes": self.notes}
