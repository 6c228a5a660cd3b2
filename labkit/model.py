"""The old import path of the lab GPT; it lives in :mod:`labkit.core.model`."""
from labkit.core.model import (  # noqa: F401
    GPT,
    MLP,
    Block,
    CausalSelfAttention,
    GPTConfig,
    build_model,
)
