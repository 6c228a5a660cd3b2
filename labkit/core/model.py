"""A small GPT: the one model every lab trains.

Decoder-only transformer as in Radford et al. 2019 (GPT-2): token + learned position embeddings,
pre-norm blocks of causal self-attention and an MLP, a final LayerNorm and a head tied to the token
embedding (Press & Wolf 2017). Plain PyTorch on purpose: this module imports nothing distributed.
Strategies wrap it from outside, which is why the blocks live in an ``nn.ModuleList``.
With ``moe_experts > 0`` every block's MLP is a mixture of experts (:mod:`labkit.core.moe`) and the
loss adds ``moe_aux_weight`` times each block's load-balancing loss.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from labkit.core.checks import at_most, non_negative_int, non_negative_number, positive_count, positive_int
from labkit.core.moe import MoEMLP, RoutingStats


@dataclass(frozen=True)
class GPTConfig:
    """Shape of the GPT. The defaults are the CPU lab model (~0.1 M parameters)."""

    vocab_size: int = 256  # byte-level: every byte is a token
    block_size: int = 64  # longest sequence (context length)
    n_layer: int = 2
    n_head: int = 2
    n_embd: int = 64
    dropout: float = 0.0  # 0 keeps parallel runs comparable step by step
    bias: bool = True
    moe_experts: int = 0  # experts per MoE MLP; 0: the dense MLP
    moe_top_k: int = 2  # experts each token is sent to
    moe_capacity_factor: float = 1.25  # expert capacity = ceil(factor x top_k x tokens / experts); 0: no limit
    moe_aux_weight: float = 0.01  # weight of the load-balancing loss, per MoE block (Switch: 1e-2)
    moe_expert_ffn: int = 0  # each expert's hidden width; 0: 4 x n_embd (fine-grained experts: narrower)
    moe_shared: int = 0  # shared experts, run on every token without routing (DeepSeekMoE)
    moe_bias_rate: float = 0.0  # auxiliary-loss-free balancing: the bias update speed (DeepSeek-V3); 0: off
    moe_groups: int = 0  # node-limited routing: the experts cut into this many groups (nodes); 0: off
    moe_group_limit: int = 0  # ... and each token routed to experts of at most this many groups

    def __post_init__(self) -> None:
        for name in ("vocab_size", "block_size", "n_layer", "n_head", "n_embd"):
            positive_count(f"GPTConfig.{name}", getattr(self, name))
        if self.n_embd % self.n_head:
            divisors = [h for h in range(1, min(self.n_embd, 4096) + 1) if self.n_embd % h == 0]
            raise ValueError(
                f"GPTConfig.n_head={self.n_head} must divide n_embd={self.n_embd}; "
                f"valid n_head values: {divisors}"
            )
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"GPTConfig.dropout must be in [0, 1), got {self.dropout!r}")
        non_negative_int("GPTConfig.moe_experts", self.moe_experts)
        if self.moe_experts:
            positive_count("GPTConfig.moe_experts", self.moe_experts)
        positive_int("GPTConfig.moe_top_k", self.moe_top_k)
        non_negative_number("GPTConfig.moe_capacity_factor", self.moe_capacity_factor)
        at_most("GPTConfig.moe_capacity_factor", self.moe_capacity_factor, 1e3,
                "a factor of moe_experts / moe_top_k already drops no token")
        non_negative_number("GPTConfig.moe_aux_weight", self.moe_aux_weight)
        at_most("GPTConfig.moe_aux_weight", self.moe_aux_weight, 1e3, "Switch uses 1e-2; more drowns the loss")
        if self.moe_experts and self.moe_top_k > self.moe_experts:
            raise ValueError(f"GPTConfig.moe_top_k={self.moe_top_k} must be at most moe_experts={self.moe_experts}")
        for name in ("moe_expert_ffn", "moe_shared", "moe_groups", "moe_group_limit"):
            at_most(f"GPTConfig.{name}", non_negative_int(f"GPTConfig.{name}", getattr(self, name)), 10**7,
                    "more than any model's width or expert count")
        non_negative_number("GPTConfig.moe_bias_rate", self.moe_bias_rate)
        at_most("GPTConfig.moe_bias_rate", self.moe_bias_rate, 1.0, "DeepSeek-V3 uses 1e-3 on probabilities of at most 1")
        if self.moe_experts and self.moe_groups and self.moe_experts % self.moe_groups:
            raise ValueError(f"GPTConfig.moe_groups={self.moe_groups} must divide moe_experts={self.moe_experts}")
        if bool(self.moe_groups) != bool(self.moe_group_limit) or self.moe_group_limit > self.moe_groups:
            raise ValueError(f"GPTConfig.moe_group_limit={self.moe_group_limit} must be in 1..moe_groups="
                             f"{self.moe_groups} (both 0: no limit)")
        if self.moe_experts and self.moe_groups and \
                self.moe_group_limit * (self.moe_experts // self.moe_groups) < self.moe_top_k:
            raise ValueError(f"GPTConfig.moe_group_limit={self.moe_group_limit} groups hold fewer experts than "
                             f"moe_top_k={self.moe_top_k}")

    def to_dict(self) -> dict:
        return asdict(self)


class CausalSelfAttention(nn.Module):
    """Multi-head causal self-attention (Vaswani et al. 2017), fused QKV projection.

    The fused matrix is stored head-major, as Megatron-LM stores it: its output features are
    ``[q_0 k_0 v_0 | q_1 k_1 v_1 | ...]``, one ``3 x head_dim`` group per head. Cut into contiguous
    row blocks (what tensor parallelism does), each block is whole heads with their Q, K and V, and the
    forward infers how many heads it holds from the width it gets.
    """

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.n_head, self.head_dim = cfg.n_head, cfg.n_embd // cfg.n_head
        self.qkv = nn.Linear(cfg.n_embd, 3 * cfg.n_embd, bias=cfg.bias)
        self.proj = nn.Linear(cfg.n_embd, cfg.n_embd, bias=cfg.bias)
        self.dropout = cfg.dropout
        # A strategy may replace the attention kernel, (q, k, v) -> output, each (B, heads, T, head_dim):
        # context parallelism's ring attention sees only this rank's slice of the sequence.
        self.attend = None

    def forward(self, x: torch.Tensor, attn_mask: torch.Tensor | None = None) -> torch.Tensor:
        B, T, _ = x.shape
        # (B, T, heads x 3 x head_dim) -> three (B, heads, T, head_dim); heads: those this rank holds
        qkv = self.qkv(x).view(B, T, -1, 3, self.head_dim)
        q, k, v = (t.transpose(1, 2) for t in qkv.unbind(dim=3))
        if self.attend is not None:
            y = self.attend(q, k, v)
        else:  # is_causal=True lets SDPA pick its fused causal kernels; a packed batch brings its own mask
            y = F.scaled_dot_product_attention(
                q, k, v, attn_mask=attn_mask, is_causal=attn_mask is None,
                dropout_p=self.dropout if self.training else 0.0,
            )
        return self.proj(y.transpose(1, 2).reshape(B, T, -1))


class MLP(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.fc = nn.Linear(cfg.n_embd, 4 * cfg.n_embd, bias=cfg.bias)
        self.proj = nn.Linear(4 * cfg.n_embd, cfg.n_embd, bias=cfg.bias)
        self.drop = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.drop(self.proj(F.gelu(self.fc(x))))


class Block(nn.Module):
    """Pre-norm transformer block: x + attn(ln(x)), then x + mlp(ln(x))."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(cfg.n_embd, bias=cfg.bias)
        self.attn = CausalSelfAttention(cfg)
        self.ln_2 = nn.LayerNorm(cfg.n_embd, bias=cfg.bias)
        self.mlp = MoEMLP.from_config(cfg) if cfg.moe_experts else MLP(cfg)

    def forward(self, x: torch.Tensor, attn_mask: torch.Tensor | None = None) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x), attn_mask)
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    def __init__(self, cfg: GPTConfig | None = None) -> None:
        super().__init__()
        self.config = cfg = cfg or GPTConfig()
        self.wte = nn.Embedding(cfg.vocab_size, cfg.n_embd)
        self.wpe = nn.Embedding(cfg.block_size, cfg.n_embd)
        self.drop = nn.Dropout(cfg.dropout)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
        self.ln_f = nn.LayerNorm(cfg.n_embd, bias=cfg.bias)
        self.head = nn.Linear(cfg.n_embd, cfg.vocab_size, bias=False)
        self.head.weight = self.wte.weight  # weight tying: one tensor, two uses
        self.aux_loss: torch.Tensor | None = None  # the last forward's weighted MoE loss (detached)
        # A strategy may fix the positions of the tokens this rank holds: context parallelism gives a
        # rank zig-zag chunks of every sequence, not its first tokens. None: 0, 1, ..., T-1.
        self.positions: torch.Tensor | None = None
        self.apply(self._init_weights)
        # GPT-2's scaled init of residual projections keeps the residual stream's variance flat.
        for name, p in self.named_parameters():
            if name.endswith("proj.weight"):
                nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * cfg.n_layer))

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)

    def num_params(self) -> int:
        """Trainable parameters, the tied embedding counted once."""
        return sum(p.numel() for p in self.parameters())

    @staticmethod
    def count_params(cfg: GPTConfig) -> int:
        """The same count from the config alone, without building the model."""
        C, b = cfg.n_embd, int(cfg.bias)
        ln = C * (1 + b)
        mlp = (4 * C * C + 4 * C * b) + (4 * C * C + C * b)
        if cfg.moe_experts:  # E experts F wide, a router (no bias), shared experts as one MLP S x F wide
            F = cfg.moe_expert_ffn or 4 * C
            expert = lambda w: (C * w + w * b) + (w * C + C * b)  # noqa: E731
            mlp = cfg.moe_experts * expert(F) + C * cfg.moe_experts + (expert(cfg.moe_shared * F) if cfg.moe_shared else 0)
        block = 2 * ln + (3 * C * C + 3 * C * b) + (C * C + C * b) + mlp
        return cfg.vocab_size * C + cfg.block_size * C + cfg.n_layer * block + ln

    def forward(
        self,
        idx: torch.Tensor,
        targets: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        doc_ids: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Logits and, with ``targets``, the mean cross-entropy over targets that are not -100.

        Packed rows (``labkit.feeding.collate``) pass ``position_ids`` (restarting per sequence) and
        ``doc_ids`` (which sequence each token belongs to): a token then attends only to earlier
        tokens with its own doc id, a block-diagonal causal mask (Krell et al. 2021).
        """
        B, T = idx.shape
        if T > self.config.block_size:
            raise ValueError(f"sequence length {T} exceeds block_size={self.config.block_size}")
        for name, t in (("position_ids", position_ids), ("doc_ids", doc_ids)):
            if t is not None and t.shape != idx.shape:
                raise ValueError(f"{name} must have the shape of idx {tuple(idx.shape)}, got {tuple(t.shape)}")
        pos = position_ids if position_ids is not None else (
            self.positions if self.positions is not None else torch.arange(T, device=idx.device))
        mask = None
        if doc_ids is not None:
            causal = torch.ones(T, T, dtype=torch.bool, device=idx.device).tril()
            mask = ((doc_ids[:, :, None] == doc_ids[:, None, :]) & causal)[:, None]  # (B, 1, T, T)
        x = self.drop(self.wte(idx) + self.wpe(pos))
        for block in self.blocks:
            x = block(x) if mask is None else block(x, mask)
        logits = self.head(self.ln_f(x))
        loss = None
        if targets is not None:
            # In the logits' dtype: a pure-bf16 model (the fine-tuning lab's QLoRA) keeps a bf16
            # log-softmax, which its chapter measures; torchtitan casts to fp32 first
            loss = F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))
            if self.config.moe_experts:
                aux = self.config.moe_aux_weight * sum(b.mlp.aux_loss for b in self.blocks)
                self.aux_loss = aux.detach()
                loss = loss + aux
        return logits, loss

    def moe_stats(self) -> list[RoutingStats]:
        """Each MoE block's routing in the last forward (empty for a dense model)."""
        return [b.mlp.stats for b in self.blocks if isinstance(b.mlp, MoEMLP)]


def build_model(cfg: GPTConfig | None = None, seed: int = 0) -> GPT:
    """The GPT with weights fixed by ``seed``, identical on every rank and in every strategy."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return GPT(cfg)


def blocks_of(model: nn.Module) -> list[nn.Module]:
    """The transformer blocks of a GPT (``blocks``, a ModuleList) or of a part of one (a pipeline
    stage keeps them in a ModuleDict under their GPT indices), in order."""
    blocks = model.blocks
    return list(blocks.values()) if isinstance(blocks, nn.ModuleDict) else list(blocks)
