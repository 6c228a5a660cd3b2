"""The old import path of the lab GPT; it lives in :mod:`labkit.core.model`."""
from labkit.core.model import GPT, Block, CausalSelfAttention, GPTConfig, MLP, build_model  # noqa: F401
