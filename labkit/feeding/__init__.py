"""Feeding the accelerator: how long steps wait for data, and rows that carry no padding.

* :mod:`labkit.feeding.stalls`: the time each step waits for its batch, and the diagnosis.
* :mod:`labkit.feeding.prefetch`: loading and host-to-device copies off the critical path.
* :mod:`labkit.feeding.workloads`: loaders whose cost per sample is known and controllable.
* :mod:`labkit.feeding.packing`: best-fit-decreasing sequence packing.
* :mod:`labkit.feeding.batching`: batching policies and the padding each wastes.
* :mod:`labkit.feeding.collate`: packed rows to model inputs with per-document masks.
"""
