"""The loop's side of fault tolerance: resume at the start, save on schedule, stop cleanly when warned.

:class:`Resumable` wires :class:`labkit.fault_tolerance.Checkpointer`, the training state of
:mod:`labkit.fault_tolerance.resume` and :class:`labkit.fault_tolerance.preemption.PreemptionHandler`
into :func:`labkit.train.loop.train`. DCP is imported only by runs that checkpoint.
"""
from __future__ import annotations

import threading
import time
from dataclasses import asdict
from typing import TYPE_CHECKING

from labkit.fault_tolerance.preemption import CONTINUE, SAVE_AND_EXIT, PreemptionHandler
from labkit.fault_tolerance.step_log import StepLog

if TYPE_CHECKING:
    from labkit.fault_tolerance.checkpointer import Checkpointer
    from labkit.fault_tolerance.resume import TrainState
    from labkit.train.config import TrainConfig


class Resumable:
    """The training loop's side of fault tolerance: resume at the start, save every ``save_every``
    steps and at the end, and on SIGTERM/SIGUSR1 finish the step, save, stop."""

    def __init__(self, cfg: TrainConfig, meta: dict, train: TrainState) -> None:
        self.cfg, self.meta, self.train = cfg, meta, train  # what the setup trains (Setup.training_state)
        self.log = StepLog(cfg.step_log)
        self.ckpt = None
        if cfg.checkpoint_dir:  # DCP imports in ~1 s: only runs that checkpoint pay for it
            from labkit.fault_tolerance.checkpointer import Checkpointer

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
            from labkit.fault_tolerance.resume import restore

            step, losses, self.notes = restore(self.ckpt, self.meta, self.train,
                                               if_unusable="start_over" if self.cfg.restart_if_unusable else "raise")
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
        from labkit.fault_tolerance.resume import training_state

        stats = self.ckpt.save(step, training_state(step, self.meta, losses, self.train))
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
        """The loop failed: give the signals back at once (no saving, no waiting for a save in flight), and
        the checkpoint directory's lock (a notebook keeps the failed call's frames, and with them the
        Checkpointer: the next run in the same kernel would find it locked). With a save in flight, the
        lock goes once that save is published, from a thread of its own."""
        if self.handler is not None:
            self.handler.uninstall()
        if self.ckpt is None:
            return
        if self.ckpt.pending is None:
            try:
                self.ckpt.close()
            except Exception:  # the loop's own error is the one to report
                pass
        else:  # the lock only: the process groups are the caller's to tear down, from its own thread
            threading.Thread(target=_release_when_saved, args=(self.ckpt,), name="labkit-checkpoint-close",
                             daemon=True).start()

    def finish(self) -> dict[str, object]:
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


def _release_when_saved(ckpt: Checkpointer) -> None:
    try:
        ckpt.wait()
    except BaseException:  # noqa: BLE001 - the loop's own error is the one to report
        pass
    finally:
        if ckpt.lock is not None:
            ckpt.lock.release()
