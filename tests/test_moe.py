"""Mixture of experts (labkit.core.moe) and expert parallelism (labkit.parallel.expert_parallel):
the block against a loop that routes one token at a time, and expert-parallel training on 2 and 4
gloo ranks against one process, step by step in fp32."""
import math
from dataclasses import replace

import pytest
import torch

import moe_fns
from labkit.core.moe import MoEMLP, expert_capacity
from labkit.launch import launch
from labkit.parallel.expert_parallel import all_to_all_bytes, expected_all_to_all_bytes
from tp_pp_fns import one_thread

E, K, STEPS, BATCH = 4, 2, 4, 8
# capacity = ceil(4 x 2 x T / 4) = 2T: no expert can overflow. TIGHT holds half the mean load.
FREE = moe_fns.MoEConfig(block_size=16, n_layer=2, n_head=2, n_embd=32, moe_experts=E, moe_top_k=K,
                         moe_capacity_factor=4.0)
# A large auxiliary weight, so that a wrong aux gradient under expert parallelism shows in the parameters.
TIGHT = replace(FREE, moe_capacity_factor=0.5, moe_aux_weight=1.0)
# Measured: losses within 1e-6 and parameters within 5e-6 of one process after 4 AdamW steps (the
# experts and the all-reduces sum rows in another order; Adam divides by sqrt(v)).
TOL = 1e-5
RUNS = {2: [("ep2", dict(cfg=FREE, steps=STEPS, ep=2, count_steps=1)),
            ("ep2_torch_a2a", dict(cfg=FREE, steps=2, ep=2, a2a="torch")),
            ("ep2_tight", dict(cfg=TIGHT, steps=3, ep=2)),
            ("dp2_ep1_tight", dict(cfg=TIGHT, steps=3, ep=1))],  # data parallel, routing global
        4: [("dp2_ep2", dict(cfg=FREE, steps=STEPS, ep=2)),
            ("ep4", dict(cfg=FREE, steps=STEPS, ep=4)),
            ("dp2_ep2_tight", dict(cfg=TIGHT, steps=3, ep=2))]}


@pytest.fixture(scope="module")
def refs():
    with one_thread():
        return {"free": moe_fns.train_moe(FREE, STEPS, BATCH), "tight": moe_fns.train_moe(TIGHT, 3, BATCH)}


@pytest.fixture(scope="module", params=[2, 4], ids=["2ranks", "4ranks"])
def runs(request):
    world = request.param
    ranks = launch(moe_fns.ep_suite, [dict(kw, batch=BATCH) for _, kw in RUNS[world]], world_size=world,
                   timeout=300, quiet=True)
    return {name: [r[i] for r in ranks] for i, (name, _) in enumerate(RUNS[world])}


def _block(cf, k=K, seed=0, sharp=1.0):
    torch.manual_seed(seed)
    block = MoEMLP(16, E, k, cf)
    with torch.no_grad():
        block.router.weight.mul_(sharp)
    return block, torch.randn(3, 10, 16)


def _routing(block, h):
    probs = torch.softmax(h @ block.router.weight.t(), dim=-1)
    top_p, top_e = probs.topk(block.top_k, dim=-1)
    return probs, top_p, top_e


def test_router_sends_each_token_to_its_top_k_experts_with_renormalised_gates():
    for k, renormalised in ((2, True), (1, False)):  # GShard/Mixtral at k > 1, Switch at k = 1
        block, x = _block(0, k, sharp=50.0)
        h = x.reshape(-1, 16)
        probs, top_p, top_e = _routing(block, h)
        p, choice, gates = block.route(h)
        assert torch.allclose(p, probs, atol=1e-6) and torch.equal(choice, top_e.t())
        want = top_p / top_p.sum(-1, keepdim=True) if renormalised else top_p
        assert torch.allclose(gates, want.t(), atol=1e-6)
        assert torch.allclose(gates.sum(0), torch.ones(30), atol=1e-6) == renormalised


def test_capacity_is_ceil_of_factor_times_k_tokens_over_experts():
    assert expert_capacity(128, 4, 2, 1.25) == 80 and expert_capacity(10, 3, 1, 1.0) == 4
    assert expert_capacity(30, 4, 2, 0.5) == 8 and expert_capacity(30, 4, 2, 0) is None
    block, x = _block(0.5)
    block(x)
    assert block.stats.capacity == 8 and block.stats.tokens == 30


@pytest.mark.parametrize("cf", [0.5, 1.0, 0])
def test_dropped_choices_follow_the_priority_order_of_a_token_by_token_loop(cf):
    """First choices before second choices, earlier tokens first; a dropped choice adds nothing."""
    block, x = _block(cf, sharp=50.0)  # a sharp router overloads some experts
    h = x.reshape(-1, 16)
    _, top_p, top_e = _routing(block, h)
    gates = top_p / top_p.sum(-1, keepdim=True)
    cap, fill = expert_capacity(30, E, K, cf), [0] * E
    want, kept = torch.zeros_like(h), torch.zeros(K, 30, dtype=torch.bool)
    for j in range(K):
        for t in range(30):
            e = int(top_e[t, j])
            if cap is None or fill[e] < cap:
                fill[e] += 1
                kept[j, t] = True
                want[t] += gates[t, j] * block.experts[str(e)](h[t:t + 1])[0]
    with torch.no_grad():
        got = block(x).reshape(-1, 16)
    assert (got - want).abs().max() < 1e-6
    s = block.stats
    routed = torch.bincount(top_e.flatten(), minlength=E).tolist()
    assert s.routed == routed and s.kept == fill == s.sent and s.dropped == sum(routed) - sum(fill)
    passed = ~kept.any(0)
    assert s.passed_through == int(passed.sum()) and torch.equal(got[passed], torch.zeros_like(got[passed]))
    if cf == 0.5:
        assert s.dropped > 0 and s.passed_through > 0  # those tokens ride the residual stream alone


def test_aux_loss_is_switch_eq4_and_one_for_a_balanced_router():
    block, x = _block(1.25, sharp=20.0)
    block(x)
    probs, _, top_e = _routing(block, x.reshape(-1, 16))
    f = torch.bincount(top_e.flatten(), minlength=E) / (K * 30)  # fraction of token-choices, sum 1
    want = E * (f * probs.mean(0)).sum()
    assert abs(block.aux_loss.item() - want.item()) < 1e-6 and block.stats.aux == pytest.approx(want.item())
    # f is a count (no gradient); the gradient reaches the router through P alone
    grad = torch.autograd.grad(block.aux_loss, block.router.weight)[0]
    w = block.router.weight.detach().requires_grad_()
    p = torch.softmax(x.reshape(-1, 16) @ w.t(), dim=-1).mean(0)
    assert torch.allclose(grad, torch.autograd.grad(E * (f * p).sum(), w)[0], atol=1e-7)
    # Uniform probabilities (a zero router): E * sum_i f_i / E = 1 whatever the choices; the model
    # then adds moe_aux_weight x 1 per MoE block to the cross-entropy.
    model = moe_fns.build(FREE)
    for b in model.blocks:
        torch.nn.init.zeros_(b.mlp.router.weight)
    x = torch.randint(0, 256, (2, 16))
    logits, loss = model(x, x)
    ce = torch.nn.functional.cross_entropy(logits.view(-1, 256), x.view(-1))
    assert all(abs(s.aux - 1) < 1e-6 for s in model.moe_stats())
    assert abs(loss.item() - ce.item() - FREE.moe_aux_weight * FREE.n_layer) < 1e-6


def _merged(ranks):
    """One state dict from the ranks' shards; replicas of a parameter must be bit-identical."""
    out = {}
    for r in ranks:
        for k, v in r["params"].items():
            assert k not in out or torch.equal(out[k], v), k
            out[k] = v
    return out


def _routing_of(run):
    return [[(s.tokens, s.capacity, s.routed, s.kept, s.dropped) for s in step] for step in run["stats"]]


@pytest.mark.parametrize("kind", ["free", "tight"])
def test_expert_parallel_training_equals_one_process(refs, runs, kind):
    for name, ranks in runs.items():
        if ("tight" in name) != (kind == "tight"):
            continue
        ref, world = refs[kind], ranks[0]["world"]
        steps = len(ranks[0]["loss"])
        assert all(r["loss"] == ranks[0]["loss"] for r in ranks)  # every rank reports the global loss
        assert max(abs(a - b) for a, b in zip(ref["loss"], ranks[0]["loss"])) < TOL, name
        assert all(_routing_of(r) == _routing_of(ref)[:steps] for r in ranks), name  # drops included
        aux = [[s.aux for s in step] for step in ref["stats"][:steps]]
        assert all(torch.allclose(torch.tensor([[s.aux for s in st] for st in r["stats"]]), torch.tensor(aux), atol=1e-6)
                   for r in ranks), name  # every rank reports the global batch's aux loss
        dropped = sum(s.dropped for step in ref["stats"] for s in step)
        assert (dropped > 0) == (kind == "tight")
        if steps == len(ref["loss"]):
            params = _merged(ranks)
            assert params.keys() == ref["params"].keys()
            assert all(r["full"].keys() == params.keys() and all(torch.equal(r["full"][k], v) for k, v in params.items())
                       for r in ranks)  # full_state_dict gathers the experts on every rank
            assert max((params[k] - ref["params"][k]).abs().max().item() for k in params) < TOL, name
        ep = int(name.split("ep")[-1][0])
        experts = {k.split(".experts.")[1].split(".")[0] for k in ranks[0]["params"] if ".experts." in k}
        assert len(experts) == E // ep and world % ep == 0, (name, experts)


def test_library_all_to_all_gives_the_same_run_as_the_hand_written_one(runs):
    if "ep2_torch_a2a" in runs:
        a, b = runs["ep2"], runs["ep2_torch_a2a"]
        assert a[0]["loss"][:2] == b[0]["loss"]


def test_all_to_all_bytes_equal_the_formula_from_the_routing_counts(runs):
    for name, ranks in runs.items():
        if name == "ep2_torch_a2a":
            continue  # the library's all-to-all is not recorded
        ep = int(name.split("ep")[-1][0])
        for step in range(len(ranks[0]["loss"])):
            for r in ranks:
                group = ranks[r["rank"] // ep * ep:(r["rank"] // ep + 1) * ep]
                want = sum(all_to_all_bytes([g["stats"][step][layer].sent for g in group], FREE.n_embd, 4)[r["rank"] % ep]
                           for layer in range(FREE.n_layer))
                log = r["a2a"][step]
                assert log["bytes"] == want and log["calls"] == (4 * FREE.n_layer if ep > 1 else 0), (name, step)
                counted = r["counter"][step]
                if counted is not None:  # what c10d was handed: tokens both ways, plus E split sizes per block
                    assert counted["alltoall_base"] == log["received"] + FREE.n_layer * E * 8
    # With uniform routing and nothing dropped the counts give the expectation exactly.
    tokens, ep = 64, 4
    sent = [[K * tokens // E] * E for _ in range(ep)]
    assert all(b == expected_all_to_all_bytes(tokens, K, 32, 4, ep) for b in all_to_all_bytes(sent, 32, 4))
    assert expected_all_to_all_bytes(tokens, K, 32, 4, ep) == 4 * K * tokens * 32 * 4 * 3 / 4
    assert math.isclose(expected_all_to_all_bytes(tokens, K, 32, 2, 1), 0)
