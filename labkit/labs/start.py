"""A lab's first call: its profile's parameters, printed, and the lab GPT and base run they describe.

Every lab opens the same way: a parameters cell (``PROFILE``, ``OVERRIDES``, ``GPUS``; papermill sets
them), then one call::

    P, model_cfg, base = start("zero_fsdp", PROFILE, GPUS, OVERRIDES, return_params=True)

``P`` is the profile made concrete (:func:`labkit.labs.parameters.resolve`); ``model_cfg`` the
:class:`~labkit.core.model.GPTConfig` of its ``n_layer``, ``n_head``, ``n_embd`` and ``block_size``
(and ``dropout``); ``base`` the :class:`~labkit.train.TrainConfig` of its ``steps``, ``batch_size``,
``lr``, ``seed`` and ``device`` (and ``strategy``, ``precision`` and ``tf32`` where the profile has
them). Each is None where the profile does not describe one. The profile is printed as the lab's
first output, so an executed notebook says what it ran.
"""
from __future__ import annotations

import textwrap
from typing import Any

from labkit.core.model import GPTConfig
from labkit.labs.parameters import resolve
from labkit.train import TrainConfig

_MODEL = ("n_layer", "n_head", "n_embd", "block_size")
_MODEL_IF_GIVEN = ("dropout",)
_BASE = ("steps", "batch_size", "lr", "seed", "device")
_BASE_IF_GIVEN = ("strategy", "precision", "tf32")


def start(lab: str, profile: str, gpus: int | None = None, overrides: dict | None = None, *,
          one_thread: bool = False, **base: Any) -> tuple[dict, GPTConfig | None, TrainConfig | None]:
    """``(P, model_cfg, base)`` for ``lab`` under ``profile`` (module docstring); ``base`` keywords go to
    the base run (``return_params=True``). ``one_thread``: on CPU, this process computes with one
    thread, as each rank does, so that a single-process reference does not spin against the ranks on
    the same cores."""
    P = resolve(lab, profile, gpus=gpus, **(overrides or {}))
    if one_thread and P.get("device") == "cpu":
        import torch

        torch.set_num_threads(1)
    model_cfg = None
    if all(k in P for k in _MODEL):
        model_cfg = GPTConfig(**{k: P[k] for k in (*_MODEL, *(k for k in _MODEL_IF_GIVEN if k in P))})
    run = None
    if all(k in P for k in _BASE):
        run = TrainConfig(**{k: P[k] for k in (*_BASE, *(k for k in _BASE_IF_GIVEN if k in P))}, **base)
    settings = ", ".join(f"{k}={v}" for k, v in P.items())
    print(textwrap.fill(f"profile {profile!r}: {settings}", 90, subsequent_indent="    "))
    return P, model_cfg, run
