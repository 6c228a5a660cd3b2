"""Tensor parallelism (DTensor and hand-written) against single-process training, step by step (fp32, gloo)."""
from dataclasses import replace

import numpy as np
import pytest
import torch

import tp_pp_fns
from tp_pp_fns import one_thread
from labkit.launch import launch
from labkit.core.model import GPT, GPTConfig, build_model
from labkit.parallel.tensor_parallel import check_tp, comm_bytes_per_layer, params_per_rank
from labkit.train import TrainConfig, train

MODEL = GPTConfig(block_size=32, n_head=4)
CFG = TrainConfig(steps=20, batch_size=8, lr=1e-3, return_params=True)  # 3e-3 spikes: see test_pipeline_parallel
LOSS_TOL = 1e-5
# A row-parallel matmul sums its inner dimension in two halves and then across ranks: a different
# order from one process, so gradients differ in the last bits; Adam divides by sqrt(v), which blows
# such differences up where a gradient is near zero (measured 1e-4 after 20 steps at lr 3e-3). A wrong
# split is off by ~lr per step.
PARAM_TOL = 3e-4
VARIANTS = {"dtensor": replace(CFG, strategy="tp"), "scratch": replace(CFG, strategy="tp_scratch"),
            "dtensor_sp": replace(CFG, strategy="tp", sequence_parallel=True)}
# What the one loop gives every strategy, on tensor parallelism too: a warmed-up cosine schedule,
# clipping that bites, recomputation (and bf16 autocast), each against one process doing the same.
EXTRAS = {"cosine_clip_full": dict(lr_schedule="cosine", warmup_steps=2, grad_clip=0.05,
                                   activation_checkpointing="full", steps=8),
          "selective_grad_accum": dict(activation_checkpointing="selective", grad_accum=2, steps=6),
          "fp16": dict(precision="fp16", steps=6)}
EXTRA_TOL = {"fp16": 5e-3}  # fp16 autocast (and loss scaling) against one process doing the same


@pytest.fixture(scope="module")
def ref():
    with one_thread():
        return train(CFG, MODEL)


@pytest.fixture(scope="module")
def suite():
    extras = [replace(CFG, strategy=s, **kw) for kw in EXTRAS.values() for s in ("tp", "tp_scratch")]
    return launch(tp_pp_fns.tp_suite, list(VARIANTS.values()) + extras, MODEL, world_size=2, timeout=300,
                  dropout_cfg=replace(CFG, strategy="tp", steps=4))


@pytest.fixture(scope="module")
def runs(suite):
    return [dict(zip(list(VARIANTS) + [f"{e}/{s}" for e in EXTRAS for s in ("tp", "tp_scratch")], rank["runs"]))
            for rank in suite]


@pytest.mark.parametrize("extra", list(EXTRAS))
def test_schedules_clipping_and_recomputation_reach_tensor_parallelism(runs, extra):
    with one_thread():
        want = train(replace(CFG, **EXTRAS[extra]), MODEL)
    for s in ("tp", "tp_scratch"):
        got = runs[0][f"{extra}/{s}"]
        assert got["activation_checkpointing"] == EXTRAS[extra].get("activation_checkpointing", "none")
        diff = np.abs(np.array(want["loss"]) - np.array(got["loss"])).max()
        assert diff < EXTRA_TOL.get(extra, LOSS_TOL), (extra, s, diff)
        assert _max_param_diff(want, got) < EXTRA_TOL.get(extra, PARAM_TOL), (extra, s)


def _max_param_diff(a, b):
    assert set(a["params"]) == set(b["params"])
    return max((a["params"][k] - b["params"][k]).abs().max().item() for k in a["params"])


@pytest.mark.parametrize("name", list(VARIANTS))
def test_tensor_parallel_matches_single_process_every_step(ref, runs, name):
    r = runs[0][name]
    diff = np.abs(np.array(ref["loss"]) - np.array(r["loss"]))
    assert len(diff) == CFG.steps >= 20 and diff.max() < LOSS_TOL, diff
    assert _max_param_diff(ref, r) < PARAM_TOL
    assert runs[1][name]["loss"] == r["loss"]  # both TP ranks report the same global-batch loss
    assert ref["loss"][-1] < ref["loss"][0] - 0.5


def test_ranks_of_a_tensor_parallel_group_draw_the_same_dropout_masks(suite):
    """Replicated activations must see one mask on every rank of the group, or the replicated weights
    (LayerNorms, embeddings) drift apart, and a checkpoint, which keeps one copy, resumes another run."""
    a, b = (rank["dropout"]["params"] for rank in suite)
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_hand_written_split_matches_dtensor(runs):
    d, s = runs[0]["dtensor"], runs[0]["scratch"]
    assert np.abs(np.array(d["loss"]) - np.array(s["loss"])).max() < 1e-6
    assert _max_param_diff(d, s) < 5e-5


@pytest.mark.parametrize("name", ["dtensor", "scratch"])
def test_four_all_reduces_of_the_activations_per_layer(runs, name):
    """Megatron's f and g: per layer 2 all-reduces in forward and 2 in backward, each b*s*h*4 bytes."""
    r = runs[0][name]
    bsh = CFG.batch_size * MODEL.block_size * MODEL.n_embd * 4
    for rank in r["ranks"]:
        fb = rank["fwd_bwd_comm_bytes_per_step"]
        assert fb == [{"allreduce": MODEL.n_layer * comm_bytes_per_layer(8, 32, 64)}] * CFG.steps
        assert fb[0]["allreduce"] == r["comm_formula_bytes_per_step"] == 4 * MODEL.n_layer * bsh
        assert rank["comm_bytes_per_step"][-1] == {"allreduce": 4 + fb[-1]["allreduce"]}  # + the norm's scalar


def test_sequence_parallel_gathers_and_scatters_the_full_activations(runs):
    """Under sequence parallelism the all-reduces become all-gathers and reduce-scatters of the full
    b x s x h activations (Korthikanti et al. 2022, 4.2.2), each counted whole. Per layer: two gathers
    and two reduce-scatters in forward (around attention and the MLP), and in backward a reduce-scatter
    for each forward gather and a gather for each forward reduce-scatter. Outside the blocks, the last
    norm's output is gathered for the tied head, and the embeddings' sequence shards are gathered back
    in backward. No all-reduce of activations is left: the ring bytes equal plain TP's plus those two."""
    sp = runs[0]["dtensor_sp"]["ranks"][0]["fwd_bwd_comm_bytes_per_step"][-1]
    tp = runs[0]["dtensor"]["ranks"][0]["fwd_bwd_comm_bytes_per_step"][-1]
    bsh = CFG.batch_size * MODEL.block_size * MODEL.n_embd * 4
    assert sp == {"allgather_base": (4 * MODEL.n_layer + 2) * bsh, "reduce_scatter_base": 4 * MODEL.n_layer * bsh}
    assert sp["allgather_base"] + sp["reduce_scatter_base"] == 2 * tp["allreduce"] + 2 * bsh


def test_memory_per_rank_is_the_split_model(runs):
    for name, r in runs[0].items():
        for rank in r["ranks"]:
            got, want = rank["model_state_bytes"], r["predicted_model_state_bytes"]
            assert got["params"] == got["grads"] == want["params"] == 4 * params_per_rank(MODEL, 2), name
            assert 0 <= got["optimizer"] - want["optimizer"] <= 4 * 64  # + Adam's 4-byte step counters
    assert params_per_rank(MODEL, 1) == GPT.count_params(MODEL)


def test_fsdp_times_tp_on_a_2x2_mesh_matches_single_process(ref):
    """2-D: FSDP2 over 2 data-parallel groups of 2 tensor-parallel ranks (4 ranks on CPU)."""
    cfg = replace(CFG, steps=6)
    r = launch(train, replace(cfg, strategy="tp", tp=2), MODEL, world_size=4, timeout=240, quiet=True)[0]
    assert (r["tp"], r["dp"]) == (2, 2)
    assert np.abs(np.array(ref["loss"][:6]) - np.array(r["loss"])).max() < LOSS_TOL
    states = r["ranks"][0]["model_state_bytes"]
    assert states["params"] == 2 * params_per_rank(MODEL, 2)  # TP halves, FSDP halves again (4 bytes/param)
    ops = r["ranks"][0]["comm_bytes_per_step"][-1]
    # TP's activations (half the rows per data-parallel group) and the norm's three scalars: one over
    # dp for tensors TP replicates, one over dp then one over tp for the tensors split both ways
    assert ops["allreduce"] == 3 * 4 + r["comm_formula_bytes_per_step"]
    assert ops["allgather_base"] > 0 and ops["reduce_scatter_base"] > 0  # FSDP's parameters and gradients


def test_f_and_g_operators_against_dtensor_and_the_whole_layer(suite):
    for r in (rank["mlp"] for rank in suite):
        for how in ("scratch", "dtensor"):
            torch.testing.assert_close(r[how]["y"], r["whole"]["y"], rtol=0, atol=1e-6)
            torch.testing.assert_close(r[how]["dx"], r["whole"]["dx"], rtol=0, atol=1e-6)
            assert r[how]["fwd"] == {"allreduce": 1} and r[how]["bwd"] == {"allreduce": 1}, how  # g, then f
            assert r[how]["fwd_bytes"] == r[how]["bwd_bytes"] == {"allreduce": 2 * 8 * 32 * 4}
        assert r["whole"]["fwd"] == r["whole"]["bwd"] == {}


def test_a_contiguous_block_of_qkv_rows_is_whole_heads():
    """The fused QKV matrix is head-major (Megatron-LM's layout): the attention of the first t-th of its
    rows (and of the output projection's columns) is exactly the first n_head/t heads' share of the output,
    so ColwiseParallel's contiguous shards need no permutation and a checkpoint stores one layout."""
    torch.manual_seed(0)
    attn = build_model(MODEL).blocks[0].attn
    x = torch.randn(2, 8, MODEL.n_embd)
    full = attn(x)
    C, half = MODEL.n_embd, MODEL.n_embd // 2
    parts = []
    for r in range(2):
        sub = build_model(MODEL).blocks[0].attn
        with torch.no_grad():
            sub.qkv.weight.copy_(attn.qkv.weight), sub.proj.weight.copy_(attn.proj.weight)
            sub.qkv.bias.copy_(attn.qkv.bias), sub.proj.bias.zero_()
        sub.qkv = torch.nn.Linear(C, 3 * half)
        with torch.no_grad():
            sub.qkv.weight.copy_(attn.qkv.weight[r * 3 * half:(r + 1) * 3 * half])
            sub.qkv.bias.copy_(attn.qkv.bias[r * 3 * half:(r + 1) * 3 * half])
        sub.proj = torch.nn.Linear(half, C, bias=False)
        with torch.no_grad():
            sub.proj.weight.copy_(attn.proj.weight[:, r * half:(r + 1) * half])
        parts.append(sub(x))
    torch.testing.assert_close(parts[0] + parts[1] + attn.proj.bias, full, rtol=0, atol=1e-6)


def test_bad_tensor_parallel_degrees_are_clear_errors():
    with pytest.raises(ValueError, match=r"tp=3 must divide n_head=4.*valid tp values: \[1, 2, 4\]"):
        check_tp(3, MODEL)
    with pytest.raises(ValueError, match=r"tp=8 must divide n_head=4"):
        train(replace(CFG, strategy="tp", tp=8), MODEL)  # before any communication
    with pytest.raises(ValueError, match=r"tp=4 must divide world_size=2"):
        check_tp(4, MODEL, world_size=2)
    with pytest.raises(ValueError, match="tp must be a positive integer"):
        check_tp(0, MODEL)
    with pytest.raises(ValueError, match=r"sequence_parallel=True has no effect with strategy='tp_scratch'; it "
                                         r"applies to strategy 'tp'"):
        TrainConfig(strategy="tp_scratch", sequence_parallel=True)
    with pytest.raises(ValueError, match="checkpoint_dir is not supported with strategy='tp_scratch'"):
        TrainConfig(strategy="tp_scratch", checkpoint_dir="ckpt")
