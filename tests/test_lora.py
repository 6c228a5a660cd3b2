"""LoRA by hand against peft's, the merge, NF4 storage and error, and what fine-tuning leaves alone.

Hu et al. 2021 (arXiv:2106.09685), Dettmers et al. 2023 (arXiv:2305.14314). fp32 comparisons with
``peft`` are held to 1e-6 (they agree to the last bit here: same operations in the same order).
"""
import copy
import math

import pytest
import torch
import torch.nn as nn

from labkit.core.data import get_batch, load_corpus
from labkit.core.model import GPTConfig, build_model
from labkit.memory.finetune_probe import bytes_by_kind, prepare
from labkit.memory.lora import (LoRALinear, apply_lora, lora_pairs, lora_parameter_count, merge,
                                  peft_lora, trainable_parameters)
from labkit.memory.qlora import NF4_LEVELS, expected_nf4_bytes, nf4_bytes, nf4_roundtrip, qlora

CFG = GPTConfig()  # the CPU lab GPT: 2 layers, n_embd 64
R, ALPHA = 8, 16.0
TOL = 1e-6


def _batch(seed: int = 0, batch: int = 4):
    g = torch.Generator().manual_seed(seed)
    idx = torch.randint(0, CFG.vocab_size, (batch, CFG.block_size), generator=g)
    return idx, torch.roll(idx, -1, dims=1)


def _same_adapters(src: nn.Module, dst: nn.Module, seed: int = 1) -> None:
    """Give ``src``'s adapters random A and a non-zero B (B = 0 would hide B's gradient), copied to ``dst``."""
    g = torch.Generator().manual_seed(seed)
    pairs, other = lora_pairs(src), lora_pairs(dst)
    assert pairs.keys() == other.keys() and pairs
    for name, (a, b) in pairs.items():
        with torch.no_grad():
            a.copy_(torch.randn(a.shape, generator=g) / math.sqrt(a.shape[1]))
            b.copy_(torch.randn(b.shape, generator=g) * 0.02)
            other[name][0].copy_(a)
            other[name][1].copy_(b)


@pytest.fixture(scope="module")
def pair():
    """The same GPT adapted by hand and by peft, with equal adapters."""
    scratch = apply_lora(build_model(CFG, seed=0), R, ALPHA)
    peft_model = peft_lora(build_model(CFG, seed=0), R, ALPHA)
    return scratch, peft_model


def test_same_layers_same_count_same_init(pair):
    scratch, peft_model = pair
    expected = 16 * R * CFG.n_embd * CFG.n_layer  # r(C+3C) + r(2C) + r(C+4C) + r(4C+C) per layer
    assert lora_parameter_count(build_model(CFG), R) == expected == 16_384
    assert trainable_parameters(scratch) == peft_model.get_nb_trainable_parameters()[0] == expected
    assert lora_pairs(scratch).keys() == lora_pairs(peft_model).keys() == {
        f"blocks.{i}.{m}" for i in range(CFG.n_layer) for m in ("attn.qkv", "attn.proj", "mlp.fc", "mlp.proj")}
    for a, b in lora_pairs(scratch).values():  # Kaiming-uniform A (bound 1/sqrt(in)), B = 0
        assert a.abs().max() <= 1 / math.sqrt(a.shape[1]) and a.std() > 0.25 / math.sqrt(a.shape[1])
        assert not b.any()
    idx, _ = _batch()
    assert torch.equal(scratch(idx)[0], build_model(CFG, seed=0)(idx)[0])  # B = 0: the base model


def test_scratch_lora_matches_peft_outputs_and_gradients(pair):
    scratch, peft_model = pair
    _same_adapters(peft_model, scratch)
    idx, tgt = _batch()
    out_s, loss_s = scratch(idx, tgt)
    out_p, loss_p = peft_model(idx, tgt)
    torch.testing.assert_close(out_s, out_p, rtol=0, atol=TOL)
    loss_s.backward()
    loss_p.backward()
    theirs = lora_pairs(peft_model)
    for name, (a, b) in lora_pairs(scratch).items():
        assert b.grad.abs().max() > 0 and a.grad.abs().max() > 0
        torch.testing.assert_close(a.grad, theirs[name][0].grad, rtol=TOL, atol=TOL)
        torch.testing.assert_close(b.grad, theirs[name][1].grad, rtol=TOL, atol=TOL)
    assert all(p.grad is None for n, p in scratch.named_parameters() if "lora_" not in n)


def test_merged_weight_gives_the_adapted_forward(pair):
    scratch, peft_model = pair
    _same_adapters(peft_model, scratch, seed=2)
    idx, _ = _batch(seed=3)
    with torch.no_grad():
        adapted = scratch(idx)[0]
        merged = merge(copy.deepcopy(scratch))
        assert not any(isinstance(m, LoRALinear) for m in merged.modules())
        lin = scratch.blocks[0].attn.qkv
        torch.testing.assert_close(merged.blocks[0].attn.qkv.weight,
                                   lin.base.weight + ALPHA / R * lin.lora_B @ lin.lora_A, rtol=0, atol=TOL)
        torch.testing.assert_close(merged(idx)[0], adapted, rtol=0, atol=1e-5)
        theirs = copy.deepcopy(peft_model).merge_and_unload()
        for name in lora_pairs(scratch):
            torch.testing.assert_close(merged.get_submodule(name).weight,
                                       theirs.get_submodule(name).weight, rtol=0, atol=TOL)


def test_nf4_levels_round_trip_error_and_storage():
    from bitsandbytes.functional import get_4bit_type

    assert torch.equal(torch.tensor(NF4_LEVELS), get_4bit_type("nf4", device="cpu"))
    w = torch.randn(256, 512, generator=torch.Generator().manual_seed(0)) * 0.02
    rel = {}
    for dq in (False, True):
        back = nf4_roundtrip(w, blocksize=64, double_quant=dq)
        rel[dq] = ((back - w).pow(2).mean().sqrt() / w.pow(2).mean().sqrt()).item()
        blocks = back.reshape(-1, 64)  # each value is a level times its block's (dequantised) absmax
        ratio = blocks / blocks.abs().amax(dim=1, keepdim=True)
        assert (ratio[..., None] - torch.tensor(NF4_LEVELS)).abs().amin(-1).max() < 1e-6
    # Gaussian weights: ~9.3% relative RMS error; double quantisation adds under 0.5 points
    assert 0.08 < rel[False] < 0.10 and 0 <= rel[True] - rel[False] < 0.005, rel
    e = expected_nf4_bytes(w.numel())
    assert e == {"packed": 65_536, "absmax": 2048, "nested_absmax": 32, "offset": 4, "total": 67_620}
    assert abs(expected_nf4_bytes(10**9)["total"] / 10**9 - 4.127 / 8) < 1e-4  # QLoRA's 4.127 bits


def test_qlora_stores_nf4_and_matches_peft_in_bf16():
    ours = qlora(build_model(CFG, seed=0), R, ALPHA)
    quantised = [m.base for m in ours.modules() if isinstance(m, LoRALinear)]
    assert all(type(q).__name__ == "Linear4bit" for q in quantised) and len(quantised) == 4 * CFG.n_layer
    for q in quantised:
        assert nf4_bytes(q) == {**expected_nf4_bytes(q.in_features * q.out_features), "tables": 64 + 1024}
    numel = sum(q.in_features * q.out_features for q in quantised)  # 12 C^2 per layer
    nf4_total = sum(nf4_bytes(q)["total"] for q in quantised)
    assert numel == 12 * CFG.n_embd**2 * CFG.n_layer and nf4_total / numel == pytest.approx(0.5163, abs=1e-4)
    assert all(a.dtype == torch.bfloat16 for pr in lora_pairs(ours).values() for a in pr)
    theirs = prepare(build_model(CFG, seed=0), "qlora", R, ALPHA, impl="peft")
    assert type(theirs.base_model.model.blocks[0].attn.qkv).__module__ == "peft.tuners.lora.bnb"
    _same_adapters(theirs, ours)
    idx, tgt = _batch()
    out_o, loss_o = ours(idx, tgt)
    out_t, loss_t = theirs(idx, tgt)
    assert out_o.dtype == torch.bfloat16 and torch.equal(out_o, out_t)
    loss_o.backward()
    loss_t.backward()
    for name, (a, b) in lora_pairs(ours).items():
        assert torch.equal(a.grad, lora_pairs(theirs)[name][0].grad)


def _frozen_state(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters() if not p.requires_grad}


@pytest.mark.parametrize("method", ["lora", "qlora"])
def test_finetuning_lowers_the_loss_and_leaves_the_base_bit_identical(method):
    data = load_corpus()
    model = prepare(build_model(CFG, seed=0), method, r=R, alpha=ALPHA)
    frozen = _frozen_state(model)
    lora_layers = [m for m in model.modules() if isinstance(m, LoRALinear)]
    absmax = [m.base.weight.quant_state.absmax.clone() for m in lora_layers if method == "qlora"]
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2, weight_decay=0.0)
    held_out = get_batch(data, 10_000, 16, CFG.block_size)  # a batch no step trains on
    with torch.no_grad():
        before = model(*held_out)[1].item()
    kinds = bytes_by_kind(model, opt, *get_batch(data, 0, 8, CFG.block_size))  # step 0, measured
    n_tensors = len([p for p in model.parameters() if p.requires_grad])
    assert kinds["gradients"] == kinds["trainable"] == trainable_parameters(model) * (2 if method == "qlora" else 4)
    assert kinds["optimizer"] == 2 * kinds["trainable"] + 4 * n_tensors  # AdamW: m, v, a fp32 step each
    for step in range(1, 12):
        opt.zero_grad()
        model(*get_batch(data, step, 8, CFG.block_size))[1].backward()
        opt.step()
    with torch.no_grad():
        after = model(*held_out)[1].item()
    assert after < before - 0.15, (before, after)  # a random-init base: LoRA learns byte frequencies
    now = _frozen_state(model)
    assert now.keys() == frozen.keys() and all(torch.equal(now[n], frozen[n]) for n in frozen)
    assert all(torch.equal(a, m.base.weight.quant_state.absmax) for a, m in zip(absmax, lora_layers))
