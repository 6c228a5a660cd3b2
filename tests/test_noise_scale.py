"""Choosing the batch: McCandlish et al. 2018's noise-scale estimator on gradients with a known answer,
the steps/examples trade-off, the learning-rate optimum, and the measuring training step on the GPT."""
import math

import pytest
import torch

from labkit.core.data import get_batch, load_corpus
from labkit.core.model import GPTConfig, build_model
from labkit.planning.batch import (NoiseScale, examples_ratio, lr_optimum, rank_table, scaled_lr,
                                   steps_ratio, two_batch_estimates, useful_ranks)
from labkit.train.noise_scale import accumulate_with_norms, pretrain_measuring_noise


def test_two_batch_estimates_invert_the_expected_norms_exactly():
    # E|G_b|^2 = |G|^2 + tr(Sigma)/b (appendix A.1): fed the expectations, the estimator returns both
    g2, trace = 0.37, 5.9
    for b, big in [(1, 2), (4, 16), (3, 300)]:
        got = two_batch_estimates(g2 + trace / b, g2 + trace / big, b, big)
        assert got == pytest.approx((g2, trace), rel=1e-12)
    with pytest.raises(ValueError, match="b_big=4 must exceed b_small=4"):
        two_batch_estimates(1.0, 0.5, 4, 4)
    with pytest.raises(ValueError, match="b_small"):
        two_batch_estimates(1.0, 0.5, 0, 4)


def _synthetic_gradients(steps: int, b: int, n_small: int, seed: int = 0):
    """Per-example gradients G + noise with a known G and covariance: ``steps`` steps, each of
    ``n_small`` small batches of ``b`` examples (the big batch is all of them)."""
    g = torch.Generator().manual_seed(seed)
    d = 40
    G = torch.linspace(-0.2, 0.3, d, dtype=torch.float64)
    scale = torch.linspace(0.5, 2.0, d, dtype=torch.float64)  # Sigma = diag(scale^2)
    examples = G + scale * torch.randn(steps, n_small, b, d, generator=g, dtype=torch.float64)
    return G, scale, examples


def test_noise_scale_recovers_tr_sigma_over_g2_from_sampled_gradients():
    G, scale, ex = _synthetic_gradients(steps=3000, b=4, n_small=4)
    want = float(scale.pow(2).sum() / G.pow(2).sum())  # B_simple = tr(Sigma) / |G|^2: 77.6 examples
    ns = NoiseScale()
    small = ex.mean(dim=2)  # (steps, n_small, d): each small batch's mean gradient
    for step in range(ex.shape[0]):
        sq_small = small[step].pow(2).sum(dim=1).mean().item()  # averaged over the small batches
        sq_big = small[step].mean(dim=0).pow(2).sum().item()
        ns.update(sq_small, sq_big, 4, 16)
    assert ns.g2 / ns.weight == pytest.approx(float(G.pow(2).sum()), rel=0.05)
    assert ns.trace / ns.weight == pytest.approx(float(scale.pow(2).sum()), rel=0.02)
    assert ns.b_simple == pytest.approx(want, rel=0.06) and 70 < want < 85
    # each step's own ratio is noisy (|G|^2 < 0 on some steps): the paper's ratio of averages is stable
    assert any(h["g2"] < 0 for h in ns.history)
    assert len(ns.history) == 3000 and math.isfinite(ns.history[-1]["b_simple"])


def test_noise_scale_decay_and_bad_values():
    ns = NoiseScale(decay=0.5)
    ns.update(2.0, 1.0, 1, 2)  # g2 0, trace 2: B_simple infinite while |G|^2 is not positive
    assert ns.b_simple == float("inf")
    ns.update(5.0, 3.0, 1, 2)  # g2 1, trace 4
    assert (ns.g2, ns.trace, ns.weight) == (1.0, 5.0, 1.5) and ns.b_simple == 5.0
    with pytest.raises(ValueError, match="decay"):
        NoiseScale(decay=0.0).update(2.0, 1.0, 1, 2)


def test_steps_against_examples_and_what_ranks_buy():
    bn = 40.0
    for batch in (1, 10, 40, 400):  # (S/S_min - 1)(E/E_min - 1) = 1 on the whole curve
        assert (steps_ratio(batch, bn) - 1) * (examples_ratio(batch, bn) - 1) == pytest.approx(1.0)
    assert steps_ratio(bn, bn) == examples_ratio(bn, bn) == 2.0  # B_crit: twice both minimums
    rows = rank_table(bn, micro_batch=4, ranks=[1, 2, 10, 100])
    assert rows[0]["speedup"] == 1.0 and rows[0]["efficiency"] == 1.0
    for r in rows:  # efficiency = compute at one rank / compute at N ranks = (b + Bn) / (N b + Bn)
        assert r["efficiency"] == pytest.approx((4 + bn) / (r["ranks"] * 4 + bn))
        assert r["global_batch"] == 4 * r["ranks"] and r["speedup"] <= r["ranks"]
    assert rows[2]["efficiency"] == pytest.approx(0.55)  # 10 ranks: the global batch is B_noise
    assert rows[3]["speedup"] < 1 + bn / 4  # never faster than an infinite batch
    assert useful_ranks(bn, 4) == 10 and useful_ranks(2.0, 4) == 1
    assert scaled_lr(1e-3, 8, 32, 0.5) == pytest.approx(2e-3) and scaled_lr(1e-3, 8, 32, 1.0) == pytest.approx(4e-3)


def test_lr_optimum_finds_the_vertex_between_grid_points():
    lrs = [1e-4, 3e-4, 1e-3, 3e-3, 1e-2]
    for best in (2e-4, 7e-4, 2e-3):
        losses = [(math.log(lr / best)) ** 2 + 1.0 for lr in lrs]
        assert lr_optimum(lrs, losses) == pytest.approx(best, rel=1e-9)
    assert lr_optimum(lrs, [5, 4, 3, 2, 1]) == 1e-2  # on the edge: the edge
    assert lr_optimum(lrs[::-1], [1, 2, 3, 4, 5]) == 1e-2  # order does not matter
    with pytest.raises(ValueError, match="same, non-zero length"):
        lr_optimum(lrs, [1.0])


def test_accumulated_step_gives_the_full_batch_gradient_and_both_norms():
    cfg = GPTConfig()
    data = load_corpus()
    x, y = get_batch(data, 0, 8, cfg.block_size)
    ref = build_model(cfg, seed=0)
    ref(x, y)[1].backward()
    model = build_model(cfg, seed=0)
    micros = list(zip(x.split(2), y.split(2)))
    loss, sq_small, sq_big = accumulate_with_norms(model, micros)
    for p, q in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-7)
    assert sq_big == pytest.approx(sum(float(q.grad.pow(2).sum()) for q in ref.parameters()), rel=1e-5)
    own = []
    for mx, my in micros:
        m = build_model(cfg, seed=0)
        m(mx, my)[1].backward()
        own.append(sum(float(p.grad.pow(2).sum()) for p in m.parameters()))
    assert sq_small == pytest.approx(sum(own) / len(own), rel=1e-5) and sq_small > sq_big
    assert loss == pytest.approx(ref(x, y)[1].item(), rel=1e-5)


def test_pretraining_run_measures_a_positive_noise_scale_that_grows_as_the_loss_falls():
    r = pretrain_measuring_noise(GPTConfig(), load_corpus(), steps=60, micro_batch=4, accum=4, window=20)
    assert r["losses"][-1] < r["losses"][0] - 2
    w = r["windows"]
    assert [x["first_step"] for x in w] == [0, 20, 40] and all(x["g2"] > 0 for x in w)
    assert all(0 < x["b_simple"] < 1e4 for x in w) and w[-1]["b_simple"] > w[0]["b_simple"]
    with pytest.raises(ValueError, match="accum=1"):
        pretrain_measuring_noise(GPTConfig(), load_corpus(), steps=2, accum=1)
