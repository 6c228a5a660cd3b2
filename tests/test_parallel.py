"""Every parallel path against the single-process reference, step by step (fp32, gloo, CPU)."""
from dataclasses import replace

import numpy as np
import pytest
import torch

import rank_fns
from labkit.comm.ring import ring_bytes_per_rank, ring_check
from labkit.launch import launch
from labkit.core.model import GPTConfig
from labkit.train import TrainConfig, train, train_many

MODEL = GPTConfig(block_size=32)
CFG = TrainConfig(steps=8, batch_size=8, return_params=True)
BUCKETS = {"ddp": 0.05, "dp_bucketed": 0.05}  # several buckets on this small model
LOSS_TOL = 1e-5  # fp32: the sums differ only in the order ranks add their halves
PARAM_TOL = 5e-5  # Adam divides by sqrt(v): last-bit gradient differences grow a little


@pytest.fixture(scope="module")
def runs():
    ref = train(CFG, MODEL)
    strategies = ["ddp", "dp_naive", "dp_bucketed"]
    out = launch(train_many, [replace(CFG, strategy=s, **({"bucket_cap_mb": BUCKETS[s]} if s in BUCKETS else {}))
                              for s in strategies], MODEL, world_size=2)
    par = [dict(zip(strategies, rank)) for rank in out]
    return ref, par


def _max_param_diff(a, b):
    return max((a["params"][k] - b["params"][k]).abs().max().item() for k in a["params"])


def test_ddp_matches_single_process_every_step(runs):
    ref, par = runs
    ddp = par[0]["ddp"]
    diff = np.abs(np.array(ref["loss"]) - np.array(ddp["loss"]))
    assert len(diff) == CFG.steps and diff.max() < LOSS_TOL, diff
    assert _max_param_diff(ref, ddp) < PARAM_TOL
    assert ref["loss"][-1] < ref["loss"][0] - 0.5  # it actually trains


def test_ranks_end_with_identical_replicas(runs):
    _, par = runs
    for s in ("ddp", "dp_naive", "dp_bucketed"):
        assert _max_param_diff(par[0][s], par[1][s]) == 0.0, s


@pytest.mark.parametrize("strategy", ["dp_naive", "dp_bucketed"])
def test_hand_written_data_parallel_matches_ddp(runs, strategy):
    _, par = runs
    ddp, mine = par[0]["ddp"], par[0][strategy]
    assert np.abs(np.array(ddp["loss"]) - np.array(mine["loss"])).max() < 1e-6
    assert _max_param_diff(ddp, mine) < 1e-6


def test_allreduce_payload_is_the_gradient_every_step(runs):
    _, par = runs
    for s in ("ddp", "dp_naive", "dp_bucketed"):
        for rank in par[0][s]["ranks"]:
            assert rank["allreduce_bytes_per_step"] == [par[0][s]["grad_bytes"]] * CFG.steps, s
    n_tensors = len(list(par[0]["ddp"]["params"]))  # state_dict: tied weight listed twice
    naive_calls = par[0]["dp_naive"]["ranks"][0]["allreduce_calls_per_step"]
    bucketed_calls = par[0]["dp_bucketed"]["ranks"][0]["allreduce_calls_per_step"]
    assert naive_calls == [n_tensors - 1] * CFG.steps
    assert 1 < bucketed_calls[0] < naive_calls[0]


@pytest.mark.parametrize("wrapper", ["naive", "bucketed"])
def test_frozen_and_tied_parameters_get_ddp_gradients(wrapper):
    ddp = launch(rank_fns.toy_grads, "ddp", world_size=2)
    mine = launch(rank_fns.toy_grads, wrapper, world_size=2)
    for r in range(2):
        for step_d, step_m in zip(ddp[r]["grads"], mine[r]["grads"]):
            assert step_m["frozen.weight"] is None and step_d["frozen.weight"] is None
            for name, g in step_d.items():
                if g is not None:
                    torch.testing.assert_close(step_m[name], g, rtol=0, atol=1e-7)
    if wrapper == "bucketed":
        assert mine[0]["n_buckets"] > 1


@pytest.mark.parametrize("world, numel", [(2, 1000), (3, 1001), (4, 4096), (3, 2)])
def test_ring_all_reduce_equals_all_reduce_and_sends_the_formula(world, numel):
    res = launch(ring_check, numel, world_size=world)
    for r in res:
        assert r["max_abs_diff"] < 1e-5
    # Summed over ranks the formula is exact whatever the chunk sizes: N * 2(N-1)/N * Psi.
    total_sent = sum(r["bytes_sent"] for r in res)
    assert total_sent == 2 * (world - 1) * 4 * numel
    assert total_sent / world == pytest.approx(ring_bytes_per_rank(4 * numel, world), rel=1e-12)


def test_ring_formula_values():
    assert ring_bytes_per_rank(100, 1) == 0
    assert ring_bytes_per_rank(100, 2) == 100
    assert ring_bytes_per_rank(100, 4) == 150
    with pytest.raises(ValueError, match="world_size"):
        ring_bytes_per_rank(100, 0)


def test_functional_and_coalesced_collectives_are_counted_whole():
    """The payload is the whole tensor a collective works on (the ZeRO paper's Psi), whatever API issued it:
    a functional all-gather is handed its shard but gathers the whole; coalesced calls count under the
    plain names, so the ring model weighs them (they once counted under names it did not know: zero)."""
    from labkit.comm.counter import ring_volume

    got = launch(rank_fns.counted_collectives, world_size=2)[0]
    assert got == {"functional all-gather": {"allgather_base": 64}, "functional reduce-scatter": {"reduce_scatter_base": 32},
                   "coalesced all-reduce": {"allreduce": 32}, "coalesced all-gather": {"allgather_base": 64},
                   "coalesced reduce-scatter": {"reduce_scatter_base": 64}}
    assert ring_volume(got["coalesced all-gather"], 2) == 32 and ring_volume(got["coalesced all-reduce"], 2) == 32


# Data parallelism's normalisation, held on the gradient itself: AdamW divides by sqrt(v), so a
# gradient off by a constant factor (a division by the token ranks done twice, or not at all) trains
# to within the parameter tolerances above; the gradient it hands the optimizer shows it.
GRAD_LAYOUTS = {
    "fsdp": (dict(strategy="fsdp"), MODEL),  # FSDP2 sums a loss over the global token count
    "ddp": (dict(strategy="ddp"), MODEL),  # DDP averages each rank's mean
    "dp_shard 2 cp 2": (dict(dp_shard=2, cp=2), MODEL),  # FSDP over rows and tokens (4 ranks)
    "dp_shard 2 ep 2": (dict(dp_shard=2, ep=2), replace(MODEL, moe_experts=4)),  # experts summed whole
}


@pytest.mark.parametrize("name", list(GRAD_LAYOUTS))
def test_the_optimizer_gets_the_global_batchs_gradient(name):
    fields, model = GRAD_LAYOUTS[name]
    cfg = TrainConfig(batch_size=8, grad_clip=0.0, **fields)
    world = 4 if "cp" in fields else 2
    ref = rank_fns.first_gradients(TrainConfig(batch_size=8, grad_clip=0.0), model)
    got: dict = {}
    for rank in launch(rank_fns.first_gradients, cfg, model, world_size=world, quiet=True):
        got.update(rank)  # an expert's gradient lives on the ranks that hold it
    assert set(got) == set(ref), set(got) ^ set(ref)
    for n, g in ref.items():
        torch.testing.assert_close(got[n], g, rtol=1e-4, atol=1e-6, msg=lambda m: f"{name} {n}: {m}")
