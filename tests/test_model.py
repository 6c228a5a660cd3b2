import math

import pytest
import torch

from labkit.core.model import GPT, GPTConfig, build_model


def test_default_config_is_the_small_cpu_model():
    model = GPT(GPTConfig())
    cfg = model.config
    assert (cfg.vocab_size, cfg.n_layer) == (256, 2)
    assert isinstance(model.blocks, torch.nn.ModuleList) and len(model.blocks) == cfg.n_layer
    # parameters by hand: embeddings + per block (2 LN, qkv, proj, fc, proj) + final LN; head tied
    C, V, T = cfg.n_embd, cfg.vocab_size, cfg.block_size
    block = 2 * 2 * C + (3 * C * C + 3 * C) + (C * C + C) + (4 * C * C + 4 * C) + (4 * C * C + C)
    assert model.num_params() == V * C + T * C + cfg.n_layer * block + 2 * C
    for other in (GPTConfig(n_layer=3, n_embd=96, n_head=4, bias=False), GPTConfig(block_size=128)):
        assert GPT(other).num_params() == GPT.count_params(other)


def test_head_is_tied_to_token_embedding():
    model = GPT()
    assert model.head.weight is model.wte.weight


def test_forward_shapes_and_initial_loss_near_uniform():
    model = build_model(GPTConfig(), seed=0)
    g = torch.Generator().manual_seed(0)
    idx, targets = torch.randint(0, 256, (2, 3, 16), generator=g)
    logits, loss = model(idx, targets)
    assert logits.shape == (3, 16, 256)
    assert abs(loss.item() - math.log(256)) < 0.1  # small init: predictions start near uniform


def test_causal_future_tokens_do_not_change_past_logits():
    model = build_model(GPTConfig(), seed=0).eval()
    a = torch.randint(0, 256, (1, 12))
    b = a.clone()
    b[0, 8:] = (b[0, 8:] + 1) % 256
    la, lb = model(a)[0], model(b)[0]
    assert torch.equal(la[0, :8], lb[0, :8])
    assert not torch.equal(la[0, 8:], lb[0, 8:])


def test_build_model_is_deterministic_and_leaves_global_rng_alone():
    torch.manual_seed(123)
    before = torch.get_rng_state()
    m1, m2 = build_model(seed=7), build_model(seed=7)
    assert torch.equal(torch.get_rng_state(), before)
    for p1, p2 in zip(m1.parameters(), m2.parameters()):
        assert torch.equal(p1, p2)
    assert not torch.equal(build_model(seed=8).wte.weight, m1.wte.weight)


def test_sequence_longer_than_block_size_is_rejected():
    model = GPT(GPTConfig(block_size=8))
    with pytest.raises(ValueError, match="block_size=8"):
        model(torch.zeros(1, 9, dtype=torch.long))


@pytest.mark.parametrize("kwargs, match", [
    (dict(n_embd=64, n_head=3), r"n_head=3 must divide n_embd=64; valid n_head values: \[1, 2, 4, 8, 16, 32, 64\]"),
    (dict(n_layer=0), "n_layer must be a positive integer"),
    (dict(vocab_size=2.5), "vocab_size must be a positive integer"),
    (dict(dropout=1.0), r"dropout must be in \[0, 1\)"),
])
def test_bad_config_names_the_field_and_what_is_valid(kwargs, match):
    with pytest.raises(ValueError, match=match):
        GPTConfig(**kwargs)
