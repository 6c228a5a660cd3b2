"""A transformer's shape, and its parameters counted to the one from that shape.

Three families cover the models a reader meets (as Hugging Face's ``transformers`` builds them):

* ``"gpt"``: GPT-2/GPT-3 (Radford et al. 2019; Brown et al. 2020): LayerNorm with bias, one fused
  Q/K/V projection, a GELU MLP of two matrices (h -> 4h -> h), biases on every linear layer, learned
  position embeddings, the output layer tied to the token embedding.
* ``"llama"``: LLaMA, Mistral and Mixtral (Touvron et al. 2023; Jiang et al. 2023, 2024): RMSNorm
  (a weight, no bias), separate Q, K, V, O projections without bias, a SwiGLU MLP of three matrices
  (gate and up h -> I, down I -> h; Shazeer 2020), rotary positions (no parameters), an untied output.
  Grouped-query attention (Ainslie et al. 2023) gives K and V ``kv_heads`` heads of ``head_dim``,
  so their projections are h x (kv_heads x head_dim), smaller than Q's. A mixture of experts keeps
  ``experts`` MLPs and a router (h -> experts) per layer and runs ``experts_per_token`` of them.
* ``"qwen2"``: the llama family plus biases on Q, K and V (Yang et al. 2024, Qwen2 report).

:func:`linear_layers` lists each block's projections (input, output, copies), which LoRA adapts and
QLoRA quantises (:mod:`labkit.memory.finetune`).
"""
from __future__ import annotations

from dataclasses import dataclass

from labkit.core.checks import MAX_COUNT, non_negative_int, one_of, positive_count

FAMILIES = ("gpt", "llama", "qwen2")


@dataclass(frozen=True)
class ModelShape:
    """What the calculator needs to know about a transformer. The fields after ``note`` default to a
    GPT-style model (h -> 4h MLP, as many K/V heads as heads, no experts)."""

    n_params: int
    n_layer: int
    hidden: int
    heads: int
    vocab: int
    seq_len: int
    note: str = ""
    family: str = "gpt"
    kv_heads: int | None = None  # None: as many as heads (multi-head attention)
    intermediate: int | None = None  # None: 4 x hidden
    experts: int = 1
    experts_per_token: int = 1
    head_dim: int | None = None  # None: hidden / heads
    shared_experts: int = 0  # experts every token runs through, unrouted (DeepSeekMoE), each intermediate wide
    n_active_params: int | None = None  # parameters one token runs through; None: all of them

    @property
    def active_params(self) -> int:
        return self.n_params if self.n_active_params is None else self.n_active_params

    @property
    def ffn(self) -> int:
        return self.intermediate or 4 * self.hidden

    @property
    def d_head(self) -> int:
        return self.head_dim or self.hidden // self.heads

    @property
    def n_kv_heads(self) -> int:
        return self.kv_heads or self.heads

    @classmethod
    def from_n_params(cls, n_params: float, seq_len: int = 2048, vocab: int = 50257) -> "ModelShape":
        """A GPT-3-proportioned shape for a bare parameter count: hidden = 128 x layers and
        128-wide heads, as GPT-3's 6.7B, 13B and 175B models are (Brown et al. 2020, Table 2.1)."""
        n = positive_count("n_params", n_params, accept_float=True)
        layers = max(1, round((n / (12 * 128**2)) ** (1 / 3)))
        return cls(n, layers, 128 * layers, layers, vocab, seq_len, "derived from the parameter count")

    @classmethod
    def from_gpt_config(cls, cfg) -> "ModelShape":
        from labkit.core.model import GPT

        n = GPT.count_params(cfg)
        return cls(n, cfg.n_layer, cfg.n_embd, cfg.n_head, cfg.vocab_size, cfg.block_size)

    @classmethod
    def from_dims(cls, family: str, hidden: int, layers: int, heads: int, vocab: int, seq_len: int = 4096,
                  kv_heads: int | None = None, intermediate: int | None = None, experts: int = 1,
                  experts_per_token: int = 1, head_dim: int | None = None, tied: bool | None = None,
                  attention_bias: bool = False, mlp_bias: bool = False, note: str = "",
                  shared_experts: int = 0) -> "ModelShape":
        """A shape whose parameters are counted exactly from its dimensions (:func:`count_params`)."""
        family = one_of("family", family, FAMILIES, "families")
        dims = {n: positive_count(n, v) for n, v in (("hidden", hidden), ("layers", layers), ("heads", heads),
                                                    ("vocab", vocab), ("seq_len", seq_len), ("experts", experts),
                                                    ("experts_per_token", experts_per_token))}
        kv = positive_count("kv_heads", kv_heads) if kv_heads is not None else heads
        if heads % kv:
            raise ValueError(f"kv_heads={kv} must divide heads={heads} (grouped-query attention)")
        if experts_per_token > experts:
            raise ValueError(f"experts_per_token={experts_per_token} must be at most experts={experts}")
        if head_dim is None and hidden % heads:
            raise ValueError(f"heads={heads} must divide hidden={hidden} (or give head_dim)")
        if intermediate is not None:
            inter = positive_count("intermediate", intermediate)
        else:  # GPT: 4h; SwiGLU: 2/3 of 4h rounded up to a multiple of 256, as LLaMA sizes it (11008 for 4096)
            inter = 4 * hidden if family == "gpt" else -(-8 * hidden // 3 // 256) * 256
        shape = cls(0, dims["layers"], dims["hidden"], dims["heads"], dims["vocab"], dims["seq_len"], note, family,
                    kv, inter, experts, experts_per_token,
                    positive_count("head_dim", head_dim) if head_dim is not None else None,
                    non_negative_int("shared_experts", shared_experts))
        tied = (family == "gpt") if tied is None else bool(tied)
        total, active = count_params(shape, tied, attention_bias, mlp_bias)
        if total > MAX_COUNT:  # each dimension within bounds, their product not: refused here, by name
            raise ValueError(f"a shape of hidden={hidden}, layers={layers}, vocab={vocab} and intermediate={inter} "
                             f"holds {total:.3g} parameters; valid: at most {MAX_COUNT:.0e}")
        return cls(total, *(getattr(shape, f) for f in _FIELDS[1:-1]), active if experts > 1 else None)


_FIELDS = tuple(ModelShape.__dataclass_fields__)


def linear_layers(shape: ModelShape) -> dict[str, tuple[int, int, int]]:
    """Each block's projections: name -> (input features, output features, copies per layer).

    The llama and qwen2 families name them as ``transformers`` does without the ``_proj`` suffix:
    q, k, v, o, gate, up, down (the MLP's once per expert); the gpt family has one fused qkv (its K
    and V as wide as grouped-query attention makes them), o, up (c_fc) and down (c_proj)."""
    h, d, E = shape.hidden, shape.d_head, shape.experts
    q, kv = shape.heads * d, shape.n_kv_heads * d
    # Shared experts are one MLP shared_experts x intermediate wide (DeepSeek's code builds them so):
    # every token runs through it, as through a dense MLP.
    shared = shape.shared_experts * shape.ffn
    if shape.family == "gpt":
        lin = {"qkv": (h, q + 2 * kv, 1), "o": (q, h, 1), "up": (h, shape.ffn, E), "down": (shape.ffn, h, E)}
        return {**lin, **({"shared_up": (h, shared, 1), "shared_down": (shared, h, 1)} if shared else {})}
    lin = {"q": (h, q, 1), "k": (h, kv, 1), "v": (h, kv, 1), "o": (q, h, 1),
           "gate": (h, shape.ffn, E), "up": (h, shape.ffn, E), "down": (shape.ffn, h, E)}
    shared_lin = {"shared_gate": (h, shared, 1), "shared_up": (h, shared, 1), "shared_down": (shared, h, 1)}
    return {**lin, **(shared_lin if shared else {})}


def count_params(shape: ModelShape, tied: bool, attention_bias: bool = False,
                 mlp_bias: bool = False) -> tuple[int, int]:
    """(total, active) parameters of ``shape``: embeddings, every block, final norm, output layer.

    Active counts ``experts_per_token`` of the ``experts`` MLPs, as a token runs through them."""
    h, L, V, E, k = shape.hidden, shape.n_layer, shape.vocab, shape.experts, shape.experts_per_token
    lin = linear_layers(shape)
    attn = sum(i * o for name, (i, o, _) in lin.items() if name in ("q", "k", "v", "o", "qkv"))
    mlp = sum(i * o for name, (i, o, _) in lin.items() if name in ("gate", "up", "down"))  # one expert
    router = h * E if E > 1 else 0
    shared = sum(i * o for name, (i, o, _) in lin.items() if name.startswith("shared_"))
    if shape.family == "gpt":  # every linear has a bias; LayerNorms have weight and bias
        attn += sum(o for name, (_, o, _) in lin.items() if name in ("qkv", "o"))
        mlp += shape.ffn + h
        shared += shape.shared_experts * shape.ffn + h if shape.shared_experts else 0
        norms, final_norm, embed = 4 * h, 2 * h, V * h + shape.seq_len * h
    else:
        if attention_bias:
            attn += sum(o for name, (_, o, _) in lin.items() if name in ("q", "k", "v", "o"))
        elif shape.family == "qwen2":
            attn += sum(o for name, (_, o, _) in lin.items() if name in ("q", "k", "v"))
        if mlp_bias:
            mlp += 2 * shape.ffn + h
            shared += 2 * shape.shared_experts * shape.ffn + h if shape.shared_experts else 0
        norms, final_norm, embed = 2 * h, h, V * h
    head = 0 if tied else V * h
    per_layer = attn + router + norms + shared
    outside = embed + final_norm + head
    return outside + L * (per_layer + E * mlp), outside + L * (per_layer + k * mlp)


def _llama(hidden, layers, heads, intermediate, kv_heads=None, vocab=32000, seq_len=4096, note=""):
    return ModelShape.from_dims("llama", hidden, layers, heads, vocab, seq_len, kv_heads, intermediate, note=note)


# Published shapes. GPT-2/GPT-3 use the 4h MLP the activation formula assumes; LLaMA's SwiGLU MLP
# keeps a little more, so its activations are an approximation. The LLaMA counts are exact
# (tests/test_finetune_memory.py holds them to the published totals).
MODELS = {
    "gpt2-124m": ModelShape.from_dims("gpt", 768, 12, 12, 50257, 1024, note="Radford et al. 2019"),
    "gpt3-1.3b": ModelShape(1_300_000_000, 24, 2048, 16, 50257, 2048, "Brown et al. 2020, Table 2.1"),
    "llama2-7b": _llama(4096, 32, 32, 11008, note="Touvron et al. 2023"),
    "10b": ModelShape(10_000_000_000, 40, 4608, 36, 50257, 2048, "a round 10B GPT-style model"),
    "llama2-13b": _llama(5120, 40, 40, 13824, note="Touvron et al. 2023"),
    "llama-65b": _llama(8192, 80, 64, 22016, seq_len=2048, note="LLaMA 65B, Touvron et al. 2023a (QLoRA's 65B)"),
    "llama2-70b": _llama(8192, 80, 64, 28672, kv_heads=8, note="Touvron et al. 2023 (GQA, 8 KV heads)"),
    "gpt3-175b": ModelShape(175_000_000_000, 96, 12288, 96, 50257, 2048, "Brown et al. 2020"),
    # Llama 3 (Dubey et al. 2024, Table 3): 8 KV heads, vocabulary 128,256, 8k context in pre-training.
    "llama3-8b": _llama(4096, 32, 32, 14336, kv_heads=8, vocab=128256, seq_len=8192, note="Dubey et al. 2024"),
    "llama3-70b": _llama(8192, 80, 64, 28672, kv_heads=8, vocab=128256, seq_len=8192, note="Dubey et al. 2024"),
    "llama3-405b": _llama(16384, 126, 128, 53248, kv_heads=8, vocab=128256, seq_len=8192,
                          note="Dubey et al. 2024"),
    "mixtral-8x7b": ModelShape.from_dims("llama", 4096, 32, 32, 32000, 4096, kv_heads=8, intermediate=14336,
                                         experts=8, experts_per_token=2, tied=False,
                                         note="Jiang et al. 2024: 8 experts, 2 per token (46.7B total, 12.9B active)"),
}


def expert_params(shape: ModelShape) -> int:
    """Parameters in the experts' MLPs, every layer and every expert (0 for a dense model): what
    expert parallelism divides over its ranks."""
    if shape.experts <= 1:
        return 0
    mlp = sum(i * o for name, (i, o, _) in linear_layers(shape).items() if name in ("gate", "up", "down"))
    if shape.family == "gpt":
        mlp += shape.ffn + shape.hidden  # biases
    return shape.n_layer * shape.experts * mlp


def moe_costs(shape: ModelShape, value_bytes: int = 2) -> dict[str, float]:
    """One MoE layer of ``shape``, per token: ``params`` (every routed expert, the shared ones, the
    router; biases in the gpt family), ``active_params`` (the ``experts_per_token`` routed experts a
    token runs, the shared ones, the router), ``flops`` (forward matrix multiplies: 2 per weight a
    token meets) and ``dispatch_bytes`` (one all-to-all's rows for the routed copies; the shared
    experts run where the token is, so they send nothing)."""
    lin, h, E, k = linear_layers(shape), shape.hidden, shape.experts, shape.experts_per_token
    if E <= 1:
        raise ValueError(f"{shape.note or 'this shape'} has no experts")
    routed = sum(i * o for i, o, c in lin.values() if c > 1)  # one expert's weights
    shared = sum(i * o for name, (i, o, _) in lin.items() if name.startswith("shared_"))
    gpt = shape.family == "gpt"  # biases: each expert's two layers, the shared MLP's two
    expert_p = routed + (shape.ffn + h if gpt else 0)
    shared_p = shared + (shape.shared_experts * shape.ffn + h if gpt and shape.shared_experts else 0)
    return {"params": E * expert_p + shared_p + h * E, "active_params": k * expert_p + shared_p + h * E,
            "flops": 2 * (k * routed + shared + h * E), "dispatch_bytes": k * h * value_bytes}
