"""The values a lab's string parameters may take, checked before any kernel starts.

``-p precision=fp9`` used to reach the lab and fail in its third cell; each set here is the one the
code that takes the value defines (TRAIN_PRECISIONS, the strategies, the collectives, the model and
hardware tables), so a new choice there is a valid ``-p`` here.
"""
from __future__ import annotations

from typing import Any

from labkit.core.checks import brief


def shown(value: Any) -> str:
    """A value as a message quotes it: a number briefly, a long list by its start."""
    text = brief(value) if isinstance(value, (int, float)) else repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def choices(key: str) -> tuple[str, ...] | None:
    """The values a string parameter (or each item of a list of them) may take, from the module that
    defines them; None for a parameter with no fixed set. Imported only when such a key is changed."""
    if key in ("precision", "fp8_precisions"):
        from labkit.train.config import TRAIN_PRECISIONS
        return TRAIN_PRECISIONS
    if key == "strategy":
        from labkit.train.strategies import STRATEGIES
        return tuple(STRATEGIES)
    if key == "ops":
        from labkit.comm.bench import OPS
        return OPS
    if key.endswith("_model"):
        from labkit.memory.architecture import MODELS
        return tuple(MODELS)
    if key.endswith("_device") and key != "device":
        from labkit.planning.hardware import HARDWARE
        return tuple(HARDWARE)
    if key == "elastic_policies":
        from labkit.fault_tolerance.elastic import POLICIES
        return POLICIES
    if key == "share_periods":
        from labkit.planning.cost import SHARE_PERIOD_DAYS
        return tuple(SHARE_PERIOD_DAYS)
    return {"device": ("cpu", "cuda"), "dtype": ("fp32", "bf16", "fp16")}.get(key)


def check_choice(name: str, key: str, value: Any) -> None:
    """A ValueError naming ``name`` unless ``value`` (or each of its items) is one of ``key``'s choices."""
    if key == "policies":  # a grammar, not a list: "every:3"
        from labkit.parallel.activation_checkpointing import parse_policy

        for i, item in enumerate(value if isinstance(value, list) else [value]):
            try:
                parse_policy(item)
            except ValueError as e:
                raise ValueError(f"{name}[{i}]={item!r}: {e}") from None
        return
    valid = choices(key)
    items = value if isinstance(value, list) else [value]
    bad = [x for x in items if isinstance(x, str) and valid is not None and x not in valid]
    if bad:
        raise ValueError(f"{name}={shown(value)}: {shown(bad[0])} is not one of {list(valid)}")
