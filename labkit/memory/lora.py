"""LoRA: fine-tune a frozen model through low-rank updates, by hand and through ``peft``.

Hu et al. 2021, "LoRA: Low-Rank Adaptation of Large Language Models" (arXiv:2106.09685): a frozen
weight ``W`` (out x in) is adapted as ``W + (alpha / r) B A`` with ``A`` (r x in) and ``B`` (out x r)
the only trained tensors. ``B`` starts at zero, so the adapted model starts as the pretrained one;
``A`` starts Kaiming-uniform, as ``nn.Linear`` and ``peft`` do. The forward pass never forms
``B A``: it adds ``(alpha / r) B (A x)`` to ``W x``, so activations stay ``r``-wide. After training,
:func:`merge` folds the product back into ``W`` and inference costs what it did before.

:class:`LoRALinear` wraps any ``nn.Linear``, including bitsandbytes' 4-bit ``Linear4bit`` (the QLoRA
base of :mod:`labkit.memory.qlora`, Dettmers et al. 2023, arXiv:2305.14314). :func:`apply_lora`
targets the course GPT's linears by name with ``peft``'s rule (a module's name, or its last parts,
equals a target), so ``apply_lora(m, targets=T)`` and ``peft_lora(m, targets=T)`` adapt the same
layers. The tied ``head`` (it is the token embedding) is left out by default.
"""
from __future__ import annotations

import math
from collections.abc import Iterable

import torch
import torch.nn as nn
import torch.nn.functional as F

from labkit.core.checks import non_negative_number, positive_int, positive_number

# attn.qkv, attn.proj, mlp.fc and mlp.proj of every block: all the block's linears, as in QLoRA
DEFAULT_TARGETS: tuple[str, ...] = ("qkv", "proj", "fc")


def _dense_weight(base: nn.Linear) -> torch.Tensor:
    """``base``'s weight as a dense (out, in) tensor; a 4-bit bitsandbytes weight is dequantised."""
    state = getattr(base.weight, "quant_state", None)
    if state is None:
        return base.weight.detach()
    from bitsandbytes.functional import dequantize_4bit

    return dequantize_4bit(base.weight.data, state)


class LoRALinear(nn.Module):
    """``y = W x + b + (alpha / r) B A dropout(x)`` with ``W``, ``b`` frozen and ``A``, ``B`` trained."""

    def __init__(self, base: nn.Linear, r: int = 8, alpha: float = 16.0, dropout: float = 0.0,
                 dtype: torch.dtype | None = None) -> None:
        super().__init__()
        positive_int("r", r)
        positive_number("alpha", alpha)
        if not 0.0 <= non_negative_number("dropout", dropout) < 1.0:
            raise ValueError(f"dropout must be in [0, 1), got {dropout!r}")
        self.base = base.requires_grad_(False)
        if dtype is None:  # the base's own dtype, or the compute dtype of a quantised base
            dtype = base.weight.dtype if base.weight.is_floating_point() else base.compute_dtype
        self.r, self.alpha, self.scaling = r, alpha, alpha / r
        device = base.weight.device
        self.lora_A = nn.Parameter(torch.empty(r, base.in_features, device=device, dtype=dtype))
        self.lora_B = nn.Parameter(torch.zeros(base.out_features, r, device=device, dtype=dtype))
        nn.init.kaiming_uniform_(self.lora_A, a=math.sqrt(5))  # bound 1/sqrt(in), as peft and nn.Linear
        self.dropout = nn.Dropout(dropout) if dropout > 0 else nn.Identity()

    @property
    def in_features(self) -> int:
        return self.base.in_features

    @property
    def out_features(self) -> int:
        return self.base.out_features

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.base(x)
        # peft's order of operations, so both agree to the last bit in fp32
        h = F.linear(F.linear(self.dropout(x.to(self.lora_A.dtype)), self.lora_A), self.lora_B)
        return (y + h * self.scaling).to(y.dtype)

    def delta_weight(self) -> torch.Tensor:
        """``(alpha / r) B A``, the (out, in) update that :func:`merge` adds to ``W``."""
        return (self.lora_B.detach().float() @ self.lora_A.detach().float()) * self.scaling

    def merged_linear(self, dtype: torch.dtype | None = None) -> nn.Linear:
        """A plain ``nn.Linear`` holding ``W + (alpha / r) B A`` (and the bias), in ``dtype``."""
        w = _dense_weight(self.base).float() + self.delta_weight()
        dtype = dtype or self.lora_A.dtype
        out = nn.Linear(self.in_features, self.out_features, bias=self.base.bias is not None,
                        device=w.device, dtype=dtype)
        with torch.no_grad():
            out.weight.copy_(w)
            if self.base.bias is not None:
                out.bias.copy_(self.base.bias)
        return out.requires_grad_(False)

    def extra_repr(self) -> str:
        return f"r={self.r}, alpha={self.alpha}, scaling={self.scaling:g}"


def matches(name: str, targets: Iterable[str]) -> bool:
    """``peft``'s rule for a list of ``target_modules``: the name equals a target or ends in ``.target``."""
    return any(name == t or name.endswith("." + t) for t in targets)


def replace_module(model: nn.Module, name: str, new: nn.Module) -> None:
    """Put ``new`` where the submodule called ``name`` (dotted) is."""
    parent, _, child = name.rpartition(".")
    setattr(model.get_submodule(parent) if parent else model, child, new)


def target_linears(model: nn.Module, targets: Iterable[str] = DEFAULT_TARGETS) -> list[str]:
    """Names of the ``nn.Linear`` modules of ``model`` that ``targets`` select, in module order."""
    targets = tuple(targets)
    names = [n for n, m in model.named_modules() if isinstance(m, nn.Linear) and matches(n, targets)]
    if not names:
        linears = [n for n, m in model.named_modules() if isinstance(m, nn.Linear)]
        raise ValueError(f"targets={list(targets)} select no nn.Linear; the model's linears: {linears}")
    return names


def apply_lora(model: nn.Module, r: int = 8, alpha: float = 16.0, dropout: float = 0.0,
               targets: Iterable[str] = DEFAULT_TARGETS, dtype: torch.dtype | None = None) -> nn.Module:
    """Freeze every parameter of ``model`` and wrap each targeted linear in a :class:`LoRALinear`.

    Works in place and returns ``model``; only the adapters' ``A`` and ``B`` are left trainable.
    """
    names = target_linears(model, targets)
    model.requires_grad_(False)
    for name in names:
        replace_module(model, name, LoRALinear(model.get_submodule(name), r, alpha, dropout, dtype))
    return model


def merge(model: nn.Module, dtype: torch.dtype | None = None) -> nn.Module:
    """Replace every :class:`LoRALinear` by a plain linear holding ``W + (alpha / r) B A``, in place.

    A 4-bit base is dequantised first, so a QLoRA model merges into a 16-bit one (``dtype``, default
    the adapters' dtype): 4-bit ``W`` plus the update is no longer on the NF4 grid.
    """
    for name in [n for n, m in model.named_modules() if isinstance(m, LoRALinear)]:
        replace_module(model, name, model.get_submodule(name).merged_linear(dtype))
    return model


def trainable_parameters(model: nn.Module) -> int:
    """Elements of the parameters that require gradients, each tensor counted once."""
    return sum(p.numel() for p in model.parameters() if p.requires_grad)


def lora_parameter_count(model: nn.Module, r: int, targets: Iterable[str] = DEFAULT_TARGETS) -> int:
    """``r (in + out)`` summed over the targeted linears: what :func:`apply_lora` will train.

    For the course GPT with all four block linears this is ``16 r C`` per layer (C = n_embd):
    qkv ``r(C + 3C)``, attn.proj ``r(2C)``, mlp.fc ``r(C + 4C)``, mlp.proj ``r(4C + C)``.
    """
    positive_int("r", r)
    return sum(r * (m.in_features + m.out_features)
               for m in (model.get_submodule(n) for n in target_linears(model, targets)))


def lora_pairs(model: nn.Module, adapter: str = "default") -> dict[str, tuple[nn.Parameter, nn.Parameter]]:
    """``{linear name: (A, B)}`` for a model adapted here or by ``peft``, names as in the plain model.

    ``peft`` keeps ``A`` and ``B`` as ``lora_A[adapter].weight``/``lora_B[adapter].weight`` under a
    ``base_model.model.`` prefix; both come back in the same shapes ((r, in) and (out, r)).
    """
    pairs = {}
    for name, m in model.named_modules():
        name = name.removeprefix("base_model.model.")
        if isinstance(m, LoRALinear):
            pairs[name] = (m.lora_A, m.lora_B)
        elif isinstance(getattr(m, "lora_A", None), nn.ModuleDict) and adapter in m.lora_A:
            pairs[name] = (m.lora_A[adapter].weight, m.lora_B[adapter].weight)
    return pairs


def peft_lora(model: nn.Module, r: int = 8, alpha: float = 16.0, dropout: float = 0.0,
              targets: Iterable[str] = DEFAULT_TARGETS, adapter_dtype: torch.dtype | None = None):
    """The same adaptation through ``peft``: ``get_peft_model(model, LoraConfig(...))``.

    On a base whose linears are bitsandbytes ``Linear4bit`` (:func:`labkit.memory.qlora.quantize_nf4`)
    the model is marked ``is_loaded_in_4bit``, as ``transformers`` marks a model it loaded in 4 bits,
    so ``peft`` picks its bitsandbytes LoRA layer. ``peft`` keeps adapters in fp32 unless
    ``adapter_dtype`` says otherwise (QLoRA: ``torch.bfloat16``).
    """
    from peft import LoraConfig, get_peft_model

    if any(type(m).__name__ == "Linear4bit" for m in model.modules()):
        model.is_loaded_in_4bit = True
    config = LoraConfig(r=r, lora_alpha=alpha, lora_dropout=dropout, target_modules=list(targets),
                        bias="none")
    peft_model = get_peft_model(model, config)
    if adapter_dtype is not None:
        for a, b in lora_pairs(peft_model).values():
            a.data, b.data = a.data.to(adapter_dtype), b.data.to(adapter_dtype)
    return peft_model
