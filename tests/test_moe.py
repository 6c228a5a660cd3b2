"""Mixture of experts (labkit.core.moe) and expert parallelism (labkit.parallel.experts.placement):
the block against a loop that routes one token at a time, and expert-parallel training on 2 and 4
gloo ranks against one process, step by step in fp32."""
import math
from dataclasses import replace

import pytest
import torch

import moe_fns
from torch.utils.flop_counter import FlopCounterMode

from labkit.comm.all_to_all import all_to_all_split
from labkit.core.moe import MoEMLP, expert_capacity
from labkit.core.moe_grouped import can_group, per_token_reference, run_experts
from labkit.core.moe_routing import bias_step, choose, update_router_biases
from labkit.launch import launch
from labkit.memory.architecture import ModelShape, moe_costs
from labkit.parallel.experts.nodes import routed_rows
from labkit.parallel.experts.nodes_check import MODES, uniform_all_to_all
from labkit.parallel.experts.placement import all_to_all_bytes, expected_all_to_all_bytes
from tp_pp_fns import one_thread

E, K, STEPS, BATCH = 4, 2, 4, 8
# capacity = ceil(4 x 2 x T / 4) = 2T: no expert can overflow. TIGHT holds half the mean load.
FREE = moe_fns.MoEConfig(block_size=16, n_layer=2, n_head=2, n_embd=32, moe_experts=E, moe_top_k=K,
                         moe_capacity_factor=4.0)
# A large auxiliary weight, so that a wrong aux gradient under expert parallelism shows in the parameters.
TIGHT = replace(FREE, moe_capacity_factor=0.5, moe_aux_weight=1.0)
# DeepSeek-V3's routing: the bias moved after every step, each token on experts of at most one of two
# "nodes" (groups of two experts), dispatched in two hops over 4 ranks as 2 nodes of 2.
NODES = replace(FREE, moe_aux_weight=0.0, moe_bias_rate=0.01, moe_groups=2, moe_group_limit=1)
# Measured: losses within 1e-6 and parameters within 5e-6 of one process after 4 AdamW steps (the
# experts and the all-reduces sum rows in another order; Adam divides by sqrt(v)).
TOL = 1e-5
RUNS = {2: [("ep2", dict(cfg=FREE, steps=STEPS, ep=2, count_steps=1)),
            ("ep2_torch_a2a", dict(cfg=FREE, steps=2, ep=2, a2a="torch")),
            ("ep2_tight", dict(cfg=TIGHT, steps=3, ep=2)),
            ("dp2_ep1_tight", dict(cfg=TIGHT, steps=3, ep=1))],  # data parallel, routing global
        4: [("dp2_ep2", dict(cfg=FREE, steps=STEPS, ep=2)),
            ("ep4", dict(cfg=FREE, steps=STEPS, ep=4)),
            ("dp2_ep2_tight", dict(cfg=TIGHT, steps=3, ep=2)),
            ("ep4_nodes", dict(cfg=NODES, steps=3, ep=4, per_node=2))]}


@pytest.fixture(scope="module")
def refs():
    with one_thread():
        return {"free": moe_fns.train_moe(FREE, STEPS, BATCH), "tight": moe_fns.train_moe(TIGHT, 3, BATCH),
                "nodes": moe_fns.train_moe(NODES, 3, BATCH)}


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


@pytest.mark.parametrize("kind", ["free", "tight", "nodes"])
def test_expert_parallel_training_equals_one_process(refs, runs, kind):
    for name, ranks in runs.items():
        if next((k for k in ("tight", "nodes") if name.endswith(k)), "free") != kind:
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
        if name == "ep2_torch_a2a" or name.endswith("nodes"):
            continue  # the library's all-to-all is not recorded; two hops have their own formula
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


# -- dropless experts, DeepSeek-V3's routing, fine-grained and shared experts, experts across nodes --

def _layer(**kw):
    torch.manual_seed(0)
    return MoEMLP(16, kw.pop("n_experts", E), kw.pop("top_k", K), 0.0, **kw), torch.randn(3, 10, 16)


@pytest.mark.parametrize("kw", [{}, dict(n_experts=8, top_k=4, expert_ffn=16, shared=1)], ids=["coarse", "fine+shared"])
def test_grouped_gemms_equal_the_loop_and_the_per_token_reference(kw):
    """torch._grouped_mm (this CPU build has it in fp32) against one GEMM per expert, forward and every
    gradient, and both against each token routed alone through its experts."""
    outs, grads = {}, {}
    for impl in ("grouped", "loop"):
        block, x = _layer(**dict(kw))
        block.impl = impl
        x.requires_grad_()
        y = block(x)
        (y * torch.linspace(-1, 1, y.numel()).view_as(y)).sum().backward()  # a gradient with no zero strides
        outs[impl], grads[impl] = y.detach(), [x.grad] + [p.grad for p in block.parameters()]
        with torch.no_grad():
            assert (y - per_token_reference(block, x)).abs().max() < 1e-6, impl
    assert can_group(list(block.experts.values()), x)
    assert (outs["grouped"] - outs["loop"]).abs().max() < 1e-6
    assert all((a - b).abs().max() < 1e-6 for a, b in zip(*grads.values()))
    block, x = _layer(**dict(kw))
    block.impl = "grouped"
    block(x.requires_grad_()).sum().backward()  # y.sum()'s expanded gradient, which _grouped_mm refuses alone
    with FlopCounterMode(display=False) as grouped:
        block(x)
    block.impl = "loop"
    with FlopCounterMode(display=False) as loop:
        block(x)
    assert grouped.get_total_flops() == loop.get_total_flops() > 0  # the registered formula counts it


def test_grouped_gemms_step_aside_where_they_cannot_run():
    from labkit.device.fp8 import to_fp8

    block, x = _layer()
    to_fp8(block)  # FP8 linears: their own GEMMs, one per expert
    assert not can_group(list(block.experts.values()), x)
    with pytest.raises(ValueError, match="plain nn.Linear"):
        run_experts(list(block.experts.values()), x.view(-1, 16), [30, 0, 0, 0], "grouped")
    odd = MoEMLP(6, E, K, 0.0)  # 6 fp32 values a row: not the 16-byte rows the kernel takes
    assert not can_group(list(odd.experts.values()), torch.randn(2, 6))
    assert odd(torch.randn(2, 3, 6)).shape == (2, 3, 6)
    with pytest.raises(ValueError, match="impl='fast' is unknown"):
        run_experts(list(odd.experts.values()), torch.randn(2, 6), [2, 0, 0, 0], "fast")


def test_the_bias_steers_the_choice_and_never_the_gates():
    """DeepSeek-V3 eq. 16: top-k of s + b, gates from s; the bias moves gamma against the load."""
    probs = torch.tensor([[0.4, 0.3, 0.2, 0.1], [0.1, 0.2, 0.3, 0.4]])
    assert choose(probs, 2).tolist() == [[0, 1], [3, 2]]
    assert choose(probs, 2, torch.tensor([0.0, 0.0, 0.25, 0.0])).tolist() == [[2, 0], [2, 3]]
    step = bias_step(torch.tensor([10.0, 2.0, 4.0, 0.0]), 0.5)  # mean 4: down, up, still, up; centred
    assert torch.allclose(step, torch.tensor([-0.5, 0.5, 0.0, 0.5]) - 0.125) and abs(step.sum()) < 1e-7
    block, x = _layer(bias_rate=0.1)
    with torch.no_grad():
        block.router_bias.copy_(torch.tensor([5.0, 0.0, 0.0, -5.0]))  # expert 0 always, expert 3 never
        _, choice, gates = block.route(x.view(-1, 16))
        probs = torch.softmax(block.router(x.view(-1, 16)), -1)
    assert (choice[0] == 0).all() and not (choice == 3).any()
    top = probs.gather(1, choice.t())
    assert torch.allclose(gates.t(), top / top.sum(-1, keepdim=True), atol=1e-6)  # unbiased, renormalised
    assert "router_bias" in block.state_dict() and "router_bias" not in _layer()[0].state_dict()
    block.eval()
    block(x)
    assert block.load_since_update.sum() == 0  # evaluation counts no load
    block.train()
    block(x)
    block(x)  # the step's load is every forward's (a recomputed block doubles every count alike)
    assert block.load_since_update.tolist() == [2.0 * n for n in block.stats.routed]
    before = block.router_bias.clone()
    assert update_router_biases(block) == 1 and block.load_since_update.sum() == 0
    assert torch.allclose(block.router_bias - before, bias_step(torch.tensor(block.stats.routed), 0.1))


def test_the_training_loop_moves_the_bias_after_every_step():
    from labkit.train import TrainConfig, train

    cfg = replace(FREE, moe_capacity_factor=0.0, moe_aux_weight=0.0, moe_bias_rate=0.01)
    run = train(TrainConfig(steps=4, batch_size=4, progress=False, return_params=True), cfg)
    biases = [v for k, v in run["params"].items() if k.endswith("router_bias")]
    assert len(biases) == FREE.n_layer and all(b.abs().sum() > 0 for b in biases)
    assert all(abs(float(b.sum())) < 1e-6 for b in biases)  # centred steps


def test_node_limited_routing_keeps_every_token_on_at_most_m_groups():
    torch.manual_seed(0)
    scores = torch.rand(200, 16)
    for k, groups, limit in ((4, 4, 2), (4, 2, 1), (3, 8, 3)):
        chosen = choose(scores, k, groups=groups, group_limit=limit)
        assert chosen.shape == (200, k)
        used = [{int(e) // (16 // groups) for e in row} for row in chosen]
        assert max(len(u) for u in used) <= limit
        per_group = scores.view(200, groups, -1).topk(-(-k // limit), -1).values.sum(-1)
        best = per_group.topk(limit, -1).indices
        assert all(u <= set(b.tolist()) for u, b in zip(used, best))  # the groups with the best top scores
    with pytest.raises(ValueError, match="moe_group_limit=3 must be in 1..moe_groups=2"):
        replace(FREE, moe_groups=2, moe_group_limit=3)
    with pytest.raises(ValueError, match="fewer experts than moe_top_k=2"):
        replace(FREE, moe_experts=4, moe_groups=4, moe_group_limit=1)


@pytest.fixture(scope="module")
def node_runs():
    layouts = [dict(n_embd=32, experts=16, top_k=4, per_node=2, group_limit=1, tokens=24),
               dict(n_embd=32, experts=8, top_k=3, per_node=1, group_limit=2, tokens=24)]  # 4 nodes of 1
    ranks = launch(moe_fns.node_suite, layouts, world_size=4, timeout=300, quiet=True)
    uniform = launch(uniform_all_to_all, 6, 8, 2, world_size=4, timeout=300, quiet=True)
    return layouts, ranks, uniform


def test_two_hops_equal_one_process_and_send_what_the_routing_implies(node_runs):
    layouts, ranks, uniform = node_runs
    for i, layout in enumerate(layouts):
        results = [r[i] for r in ranks]
        for mode in MODES:
            assert max(r[mode]["max_err"] for r in results) < 2e-5, (layout, mode)
            for link in ("inside", "leaving"):  # the group's bytes, as each sender handed them over
                assert sum(r[mode][link] for r in results) == sum(r[mode]["formula"][link] for r in results)
        leaving = {mode: sum(r[mode]["leaving"] for r in results) for mode in MODES}
        assert leaving["two hops"] <= leaving["flat"]  # one row per (token, node) never exceeds one per choice
        rows = leaving["two hops, node-limited"] / (4 * results[0]["flat"]["row_bytes"] * 4 * layout["tokens"])
        assert rows <= layout["group_limit"]  # each token crosses to at most M nodes
    for u in uniform:  # an even all-to-all is the planner's formula, to the byte
        assert (u["inside"], u["leaving"]) == (u["formula_inside"], u["formula_leaving"]) == (6 * 8 * 4, 2 * 6 * 8 * 4)


def test_routed_rows_counts_each_token_once_per_remote_node():
    experts = torch.tensor([[0, 1, 4, 6], [2, 3, 5, 7]])  # 8 experts, 1 a rank, 2 ranks a node: rank r's node r // 2
    flat = routed_rows(experts, rank=0, local=1, per_node=2, two_hop=False)
    assert flat == {"leaving": 6, "inside": 1 + 0}  # token 1: experts 2, 3 (other node); 5, 7: other nodes too
    two = routed_rows(experts, rank=0, local=1, per_node=2, two_hop=True)
    # token 0 lands on nodes 0 (home), 2, 3; token 1 on nodes 1, 2, 3: 2 + 3 remote (token, node) rows
    assert two["leaving"] == 5


def test_the_calculator_counts_fine_grained_and_shared_experts_as_the_model_has_them():
    for kw in (dict(moe_experts=4, moe_top_k=2), dict(moe_experts=16, moe_top_k=8, moe_expert_ffn=32),
               dict(moe_experts=16, moe_top_k=7, moe_expert_ffn=32, moe_shared=1)):
        cfg = replace(FREE, moe_capacity_factor=0.0, **kw)
        model = moe_fns.build(cfg)
        shape = ModelShape.from_dims("gpt", cfg.n_embd, cfg.n_layer, cfg.n_head, cfg.vocab_size, cfg.block_size,
                                     intermediate=cfg.moe_expert_ffn or 4 * cfg.n_embd, experts=cfg.moe_experts,
                                     experts_per_token=cfg.moe_top_k, shared_experts=cfg.moe_shared)
        costs = moe_costs(shape, value_bytes=4)
        layer = model.blocks[0].mlp
        assert shape.n_params == model.num_params() == moe_fns.MoEGPT.count_params(cfg), kw
        assert costs["params"] == sum(p.numel() for p in layer.parameters()), kw
        x = torch.randn(2, 8, cfg.n_embd)
        with torch.no_grad(), FlopCounterMode(display=False) as flops:
            layer(x)
        assert costs["flops"] * 16 == flops.get_total_flops(), kw
        assert costs["dispatch_bytes"] == cfg.moe_top_k * cfg.n_embd * 4 == sum(layer.stats.sent) * cfg.n_embd * 4 / 16


def test_the_planner_prices_the_all_to_all_with_the_labs_formula(monkeypatch):
    from labkit.planning import collectives
    from labkit.planning.hardware import HARDWARE

    seen = []
    monkeypatch.setattr(collectives, "all_to_all_split", lambda *a: seen.append(a) or all_to_all_split(*a))
    collectives.all_to_all(next(iter(HARDWARE.values())), collectives.group(64, 1, 8), 1e6)
    assert seen == [(64, 8, 1e6)]
    assert all_to_all_split(64, 8, 64.0) == (7.0, 56.0)  # k(n - k)/n of a rank's bytes leave each node of k
