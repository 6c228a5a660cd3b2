from dataclasses import replace

import numpy as np
import pytest
import torch

import rank_fns
from labkit.memory.recompute import largest_fit, measure_step
from labkit.parallel.activation_checkpointing import apply, parse_policy
from labkit.launch import launch
from labkit.memory.probe import activation_bytes_per_layer_measured
from labkit.core.model import GPTConfig, build_model
from labkit.train import TrainConfig, train, train_many

CFG = GPTConfig(n_layer=4, block_size=128)
POLICIES = ["none", "full", "every:2", "every:3", "selective", "selective:alternate"]


def _batch(cfg, b=2):
    x = torch.randint(0, 256, (b, cfg.block_size), generator=torch.Generator().manual_seed(0))
    return x, torch.roll(x, -1, 1)


@pytest.mark.parametrize("policy", POLICIES)
def test_gradients_equal_the_uncheckpointed_ones(policy):
    x, y = _batch(CFG)
    ref = build_model(CFG)
    ref(x, y)[1].backward()
    model = apply(build_model(CFG), policy)
    assert list(model.state_dict()) == list(ref.state_dict())  # names unchanged
    model(x, y)[1].backward()
    for a, b in zip(ref.parameters(), model.parameters()):
        torch.testing.assert_close(b.grad, a.grad, rtol=0, atol=1e-7)


def test_full_saves_at_least_85_percent_per_layer_at_long_sequences():
    cfg = GPTConfig(block_size=256)  # the lab's GPT at sequence length 256
    none = activation_bytes_per_layer_measured(cfg, 2)
    full = activation_bytes_per_layer_measured(cfg, 2, checkpointing="full")
    assert full == 4 * 256 * 2 * cfg.n_embd  # the block input only, fp32
    assert 1 - full / none >= 0.85


def test_selective_adds_at_most_5_percent_flops_and_saves_memory():
    x, y = _batch(CFG)
    none = measure_step(apply(build_model(CFG), "none"), x, y, repeats=1)
    sel = measure_step(apply(build_model(CFG), "selective"), x, y, repeats=1)
    full = measure_step(apply(build_model(CFG), "full"), x, y, repeats=1)
    assert sel["flops"] <= 1.05 * none["flops"]
    assert sel["saved_bytes"] < none["saved_bytes"]
    assert none["flops"] < full["flops"] <= 4 / 3 * none["flops"]  # at most one extra forward
    assert full["saved_bytes"] < sel["saved_bytes"]


def test_alternate_selective_recomputes_every_second_matmul():
    """torchtitan's op-level policy: between saving every matmul's output and recomputing the block.
    Each block runs 4 matmuls (QKV, attention projection, MLP in and out). Marking the 2nd and 4th for
    recomputation drops two b x s x h outputs, but only the projection's is recomputed: its output
    feeds the residual that the second LayerNorm's backward needs, while nothing in backward needs
    the MLP's last output, and PyTorch's recomputation stops once it has what backward needs."""
    x, y = _batch(CFG)
    sel = measure_step(apply(build_model(CFG), "selective"), x, y, repeats=1)
    alt = measure_step(apply(build_model(CFG), "selective:alternate"), x, y, repeats=1)
    full = measure_step(apply(build_model(CFG), "full"), x, y, repeats=1)
    assert full["saved_bytes"] < alt["saved_bytes"] < sel["saved_bytes"]
    assert sel["flops"] < alt["flops"] < full["flops"]
    b, s, h = x.shape[0], CFG.block_size, CFG.n_embd
    # the two recomputed outputs: attention projection (b s h) and MLP down projection (b s h), fp32
    assert sel["saved_bytes"] - alt["saved_bytes"] == CFG.n_layer * 2 * b * s * h * 4
    # the attention projection once more: 2 b s h^2 per layer
    assert alt["flops"] - sel["flops"] == CFG.n_layer * 2 * b * s * h * h


@pytest.mark.parametrize("policy, match", [
    ("fast", r"policy='fast' is unknown; valid policies: \['none', 'full', 'every:k', 'selective', "
             r"'selective:alternate'\]"),
    ("every:0", "k in 'every:k' must be a positive integer"),
    ("every:x", "k in 'every:k' must be a positive integer"),
    (None, "policy=None is unknown"),
])
def test_bad_policies_list_the_valid_ones(policy, match):
    with pytest.raises(ValueError, match=match):
        parse_policy(policy)
    with pytest.raises(ValueError, match=match):
        apply(build_model(CFG), policy)


def test_applying_twice_and_unknown_backend_are_refused():
    model = apply(build_model(CFG), "full")
    with pytest.raises(RuntimeError, match="already checkpointed"):
        apply(model, "full")
    with pytest.raises(ValueError, match=r"backend='jax' is unknown"):
        apply(build_model(CFG), "full", backend="jax")
    with pytest.raises(ValueError, match="activation_checkpointing: policy='x'"):
        TrainConfig(activation_checkpointing="x")


def test_under_ddp_checkpointed_training_equals_single_process():
    ref = train(TrainConfig(steps=4, batch_size=8), GPTConfig(block_size=32))
    ddp = launch(train, TrainConfig(strategy="ddp", steps=4, batch_size=8, activation_checkpointing="full"),
                 GPTConfig(block_size=32), world_size=2)[0]
    assert np.abs(np.array(ref["loss"]) - np.array(ddp["loss"])).max() < 1e-5


def test_under_fsdp2_checkpointed_training_equals_uncheckpointed():
    plain = launch(rank_fns.fsdp_losses_with_checkpointing, "none", world_size=2)[0]
    ckpt = launch(rank_fns.fsdp_losses_with_checkpointing, "full", world_size=2)[0]
    assert np.abs(np.array(plain) - np.array(ckpt)).max() < 1e-6


def test_deepspeed_activation_checkpointing_same_gradients_and_no_selective():
    full = launch(rank_fns.deepspeed_checkpoint_grads, "full", world_size=2, timeout=900)
    assert all(r["max_diff"] < 1e-6 for r in full)
    sel = launch(rank_fns.deepspeed_checkpoint_grads, "selective", world_size=2, timeout=900)
    assert "no DeepSpeed equivalent" in sel[0]["error"]


def test_largest_fit_grows_with_checkpointing():
    none, full = largest_fit("llama2-7b", "none"), largest_fit("llama2-7b", "full")
    assert full > 4 * none >= 4
    assert largest_fit("llama2-7b", "full", vary="n_layer") > largest_fit("llama2-7b", "none", vary="n_layer")
    with pytest.raises(ValueError, match="vary='width' is unknown"):
        largest_fit("llama2-7b", "full", vary="width")


def test_deepspeed_strategies_use_deepspeed_checkpointing_and_train_identically():
    cfg = TrainConfig(strategy="zero2", steps=3, batch_size=8, activation_checkpointing="full")
    ref = train(TrainConfig(steps=3, batch_size=8), GPTConfig(block_size=32))
    # ZeRO-3 last: DeepSpeed's stage 3 patches torch.nn.functional.linear for the rest of the
    # process, which then upsets PyTorch's selective checkpointing in later runs (measured).
    out = launch(train_many, [cfg, replace(cfg, activation_checkpointing="selective"),
                                          replace(cfg, strategy="zero3")],
                 GPTConfig(block_size=32), world_size=2, timeout=900)[0]
    for r in out:
        assert np.abs(np.array(ref["loss"]) - np.array(r["loss"])).max() < 1e-5, (r["strategy"], r["activation_checkpointing"])
    with pytest.raises(ValueError, match="'selective' is not supported with strategy='zero3'"):
        TrainConfig(strategy="zero3", activation_checkpointing="selective")
