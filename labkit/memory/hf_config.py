"""A Hugging Face ``config.json`` read into a :class:`~labkit.memory.architecture.ModelShape`.

Reads the keys ``transformers`` builds the model from, with its defaults where a key is absent:

* llama, mistral, mixtral, qwen2: ``hidden_size``, ``num_hidden_layers``, ``num_attention_heads``,
  ``num_key_value_heads`` (default: as many as heads), ``intermediate_size``, ``vocab_size``,
  ``tie_word_embeddings`` (default false), ``head_dim`` (default hidden / heads),
  ``attention_bias`` and ``mlp_bias`` (llama; default false), ``max_position_embeddings``; and for
  mixtral ``num_local_experts`` and ``num_experts_per_tok``.
* gpt2: ``n_embd``, ``n_layer``, ``n_head``, ``n_inner`` (null: 4 x n_embd), ``vocab_size``,
  ``n_positions``; the output layer is always tied to the token embedding.

No ``transformers`` import: the file is plain JSON, and the counts are held against the published
totals in the tests.
"""
from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

from labkit.core.checks import MAX_COUNT, brief
from labkit.memory.architecture import ModelShape

MODEL_TYPES = {"llama": "llama", "mistral": "llama", "mixtral": "llama", "qwen2": "qwen2", "gpt2": "gpt"}


def _read(path) -> tuple[Path, dict]:
    p = Path(path)
    if p.is_dir():
        p = p / "config.json"
    if not p.is_file():
        raise ValueError(f"model={str(path)!r}: no such config.json")
    try:
        cfg = json.loads(p.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, RecursionError) as e:
        why = "nested too deeply" if isinstance(e, RecursionError) else e
        raise ValueError(f"model={str(path)!r} is not a readable JSON config: {why}") from None
    if not isinstance(cfg, dict):
        raise ValueError(f"model={str(path)!r} is not a config.json object")
    return p, cfg


def _get(cfg: dict, key: str, where: str, default=None, kind=int):
    value = cfg.get(key, default)
    if value is None:
        raise ValueError(f"{where} lacks {key!r}")
    if kind is int and (isinstance(value, bool) or not isinstance(value, int)):
        raise ValueError(f"{where}: {key} must be an integer, got {value!r}")
    if kind is int and not 0 <= value <= MAX_COUNT:
        raise ValueError(f"{where}: {key} must be between 0 and {MAX_COUNT:.0e}, got {brief(value)}")
    if kind is bool and not isinstance(value, bool):
        raise ValueError(f"{where}: {key} must be true or false, got {value!r}")
    return value


def shape_from_hf_config(path, seq_len: int | None = None) -> ModelShape:
    """The shape of the model a ``config.json`` (or a folder holding one) describes.

    ``seq_len`` defaults to the model's ``max_position_embeddings`` (gpt2: ``n_positions``)."""
    p, cfg = _read(path)
    where = f"config {str(path)!r}"
    model_type = cfg.get("model_type")
    if model_type not in MODEL_TYPES:
        raise ValueError(f"{where}: model_type={model_type!r} is unknown; valid model types: {sorted(MODEL_TYPES)}")
    family, note = MODEL_TYPES[model_type], f"{model_type} config.json: {p}"
    if family == "gpt":
        h = _get(cfg, "n_embd", where)
        positions = _get(cfg, "n_positions", where, cfg.get("n_ctx", 1024))
        inner = cfg.get("n_inner")
        shape = ModelShape.from_dims("gpt", h, _get(cfg, "n_layer", where), _get(cfg, "n_head", where),
                                    _get(cfg, "vocab_size", where), positions,
                                    intermediate=_get(cfg, "n_inner", where) if inner is not None else None,
                                    tied=True, note=note)
        return replace(shape, seq_len=seq_len) if seq_len else shape
    heads = _get(cfg, "num_attention_heads", where)
    experts = _get(cfg, "num_local_experts", where, 1) if model_type == "mixtral" else 1
    shape = ModelShape.from_dims(
        family, _get(cfg, "hidden_size", where), _get(cfg, "num_hidden_layers", where), heads,
        _get(cfg, "vocab_size", where), _get(cfg, "max_position_embeddings", where, 4096),
        kv_heads=_get(cfg, "num_key_value_heads", where, heads),
        intermediate=_get(cfg, "intermediate_size", where), experts=experts,
        experts_per_token=_get(cfg, "num_experts_per_tok", where, 2) if experts > 1 else 1,
        head_dim=cfg.get("head_dim") and _get(cfg, "head_dim", where),
        tied=_get(cfg, "tie_word_embeddings", where, False, bool),
        attention_bias=_get(cfg, "attention_bias", where, False, bool),
        mlp_bias=_get(cfg, "mlp_bias", where, False, bool), note=note)
    return replace(shape, seq_len=seq_len) if seq_len else shape
