"""The old import path of activation checkpointing; it lives in :mod:`labkit.parallel.activation_checkpointing`."""
from labkit.parallel.activation_checkpointing import POLICIES, apply, parse_policy  # noqa: F401
