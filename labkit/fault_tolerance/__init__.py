"""Keeping a run alive: checkpoints that survive any kill, bit-exact resume, preemption, faults on purpose.

* :mod:`labkit.fault_tolerance.checkpointer`: :class:`Checkpointer`, atomic, checksummed, retained,
  optionally asynchronous checkpoints over DCP (and DeepSpeed's own format).
* :mod:`labkit.fault_tolerance.files`: the checkpoint's files: layout, checksums, durable writes, safe reads.
* :mod:`labkit.fault_tolerance.directory`: a checkpoint directory: names, manifests, publication, retention.
* :mod:`labkit.fault_tolerance.loading`: verifying and reading a checkpoint back, every rank agreeing.
* :mod:`labkit.fault_tolerance.lock`: one writer per directory.
* :mod:`labkit.fault_tolerance.resume`: the training state a bit-exact resume needs, saved and restored.
* :mod:`labkit.fault_tolerance.changes`: what a resume meets that changed: refused in one line, or applied with a note.
* :mod:`labkit.fault_tolerance.rng`: every RNG state of a rank.
* :mod:`labkit.fault_tolerance.preemption`: SIGTERM/SIGUSR1 to "finish the step, save, exit 75".
* :mod:`labkit.fault_tolerance.step_log`: one JSON line per event, safe against SIGKILL.
* :mod:`labkit.fault_tolerance.injection`: torchrun jobs killed and preempted on purpose.
* :mod:`labkit.fault_tolerance.bench`: what a checkpoint costs, and what plain saves lose.

Failures at scale (the chapter after fault tolerance):

* :mod:`labkit.fault_tolerance.goodput`: interruptions as a job grows, Young's and Daly's intervals, goodput.
* :mod:`labkit.fault_tolerance.sdc`: a cross-replica fingerprint that finds a flipped bit and its rank.
* :mod:`labkit.fault_tolerance.stragglers`: compute against waiting, per rank: the slow rank waits least.
* :mod:`labkit.fault_tolerance.replicas`: data-parallel replicas written out, with faults put in on purpose.
* :mod:`labkit.fault_tolerance.peer_checkpoint`: in-memory checkpoints kept by a peer, restored without disk.
* :mod:`labkit.fault_tolerance.quorum`: a process group re-created over a store when replicas come and go.
* :mod:`labkit.fault_tolerance.elastic` and :mod:`~labkit.fault_tolerance.elastic_launch`: replicas that
  train through a lost one, under torchrun, held against the arithmetic of their batches.

``Checkpointer`` and ``CheckpointError`` are importable from here; they load DCP (about a second)
only when first asked for, so the training loop pays for it only when it checkpoints.
"""
from __future__ import annotations

from typing import Any

__all__ = ["Checkpointer", "CheckpointError", "LOCAL"]


def __getattr__(name: str) -> Any:  # PEP 562: import the checkpointer on first use
    if name in __all__:
        from labkit.fault_tolerance import checkpointer

        return getattr(checkpointer, name)
    raise AttributeError(f"module 'labkit.fault_tolerance' has no attribute {name!r}")
