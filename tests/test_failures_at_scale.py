"""Failures at scale (labkit.fault_tolerance: goodput, sdc, stragglers, peer_checkpoint, quorum, elastic),
each technique against a reference: published optima and a simulation for the goodput model, the rank
and step for detection, bit-exactness for the in-memory restore, a single process on the same rows for
the replicas that train through a lost one."""
import math
import random

import pytest
import torch

from labkit.fault_tolerance import goodput as gp
from labkit.fault_tolerance.elastic import shares_of
from labkit.fault_tolerance.elastic_launch import peer_reference, replay, run_elastic
from labkit.fault_tolerance.peer_checkpoint import bench_paths, holder
from labkit.fault_tolerance.replicas import replica_phases
from labkit.fault_tolerance.sdc import fingerprint, flip_bit, vote
from labkit.fault_tolerance.stragglers import find_stragglers, medians
from labkit.launch import launch

CFG = dict(n_layer=2, n_head=2, n_embd=32, block_size=32, batch_size=12, lr=1e-3, seed=0)
ELASTIC = dict(CFG, timeout_s=120.0, stale_s=2.0)


@pytest.mark.parametrize("mtbf_min, optimum", [(24 * 60, 117), (6 * 60, 57), (15, 9.1)])
def test_daly_interval_reproduces_dalys_figures(mtbf_min, optimum):
    """Daly 2006, Figs. 3-5: C = 5 min, R = 10 min; the optimum he prints, to his digits."""
    got = gp.daly_interval(5, mtbf_min)
    assert round(got, 1 if optimum < 10 else 0) == optimum
    assert gp.young_interval(5, mtbf_min) == pytest.approx(math.sqrt(2 * 5 * mtbf_min))
    assert gp.daly_interval(90, 30) == 30  # a checkpoint longer than 2M: checkpoint every M


def test_goodput_model_matches_a_simulation_of_poisson_failures():
    """Segments of tau work + C checkpoint; an exponential failure inside one loses it; a restart of R
    can itself fail. The mean wall time per segment against Daly's M exp(R/M) (exp((tau+C)/M) - 1)."""
    m, c, r = 1.0, 0.05, 0.2
    tau = gp.daly_interval(c, m)
    rng, wall, segments = random.Random(0), 0.0, 40_000
    for _ in range(segments):
        while True:
            t = rng.expovariate(1 / m)
            if t >= tau + c:
                wall += tau + c
                break
            wall += t
            while True:  # restart until one restart survives
                t = rng.expovariate(1 / m)
                if t >= r:
                    wall += r
                    break
                wall += t
    assert wall / segments == pytest.approx(gp.wall_per_segment(tau, m, c, r), rel=0.02)
    assert gp.goodput(m, c, r) == pytest.approx(tau / gp.wall_per_segment(tau, m, c, r))
    # the first-order form, near the optimum and for small C/M, R/M
    assert gp.goodput(1e4, 1, 10) == pytest.approx(1 - math.sqrt(2 / 1e4) - 10 / 1e4, abs=2e-4)


def test_llama3_rate_and_bad_inputs():
    lam = gp.failures_per_gpu_day(419, 16384, 54)
    assert gp.interruptions_per_day(16384, lam) == pytest.approx(419 / 54)
    assert gp.mtbf_hours(16384, lam) == pytest.approx(24 * 54 / 419)
    rows = gp.goodput_table([1024, 16384], lam, [gp.Path("disk", 60, 600)])
    assert rows[0]["goodput"] > rows[1]["goodput"] > 0
    for call, words in ((lambda: gp.mtbf_hours(0, lam), "n_gpus must be a positive integer"),
                        (lambda: gp.goodput(-1, 1, 1), "mtbf must be a positive finite number"),
                        (lambda: gp.Path("disk", 0, 1), "disk: checkpoint_s must be a positive")):
        with pytest.raises(ValueError, match=words):
            call()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fingerprint_sees_every_single_bit_flip(dtype):
    t = torch.randn(64, generator=torch.Generator().manual_seed(0)).to(dtype)
    base = fingerprint([t])
    for bit in range(8 * t.element_size()):
        for index in (0, 17, 63):
            flip_bit(t, index, bit)
            assert not torch.equal(fingerprint([t]), base), (bit, index)
            flip_bit(t, index, bit)
            assert torch.equal(fingerprint([t]), base)
    with pytest.raises(ValueError, match=r"bit=32 does not exist in a torch.float32 element \(32 bits\)"):
        flip_bit(torch.zeros(2), 0, 32)
    with pytest.raises(ValueError, match="index=9 is past the tensor's 2 elements"):
        flip_bit(torch.zeros(2), 9, 1)


def test_vote_names_the_outvoted_rank_and_refuses_to_blame_in_a_tie():
    assert vote([[1, 2], [1, 2], [1, 3]])["suspects"] == [2]
    assert vote([[9, 2], [1, 2], [1, 2]])["suspects"] == [0]
    tie = vote([[1, 2], [1, 3]])
    assert not tie["agree"] and tie["tie"] and tie["suspects"] == []
    assert vote([[4, 5]] * 3) == {"agree": True, "suspects": [], "tensors": [], "tie": False}
    with pytest.raises(ValueError, match="one fingerprint per tensor"):
        vote([[1, 2], [1]])


def test_find_stragglers():
    found = find_stragglers([0.010, 0.031, 0.011], [0.020, 0.001, 0.019])
    assert found["stragglers"] == [1] and found["least_wait"] == 1
    assert find_stragglers([0.01, 0.011, 0.0105], [0.0, 0.0, 0.0])["stragglers"] == []
    with pytest.raises(ValueError, match="two or more ranks"):
        find_stragglers([1.0], [1.0])


def test_replicas_catch_repair_miss_and_find_the_straggler():
    """Three data-parallel ranks: a flip after the all-reduce caught at its step, on its rank, and
    repaired to the clean run's bits; one before it never caught; a slowed rank found by rank."""
    cfg = dict(CFG, replicas=3)
    flip = dict(tensor="blocks.1.attn.qkv.weight", index=77, bit=30, step=2, rank=0)
    phases = [dict(steps=5), dict(steps=5, flip={**flip, "where": "adam"}, repair=True),
              dict(steps=5, flip={**flip, "where": "grad_local"}),
              dict(steps=6, check=False, delay={"rank": 2, "ms": 250})]  # stands out of 2-core noise
    runs = launch(replica_phases, cfg, phases, world_size=3, quiet=True)
    clean, after, before, slow = ([r[i] for r in runs] for i in range(4))
    bad = [c for c in after[0]["checks"] if not c["agree"]]
    assert [(c["step"], c["suspects"], c["repaired_from"]) for c in bad] == [(2, [0], 1)]
    assert bad[0]["tensors"] == ["adam.exp_avg.blocks.1.attn.qkv.weight"]  # rank 0 outvoted; repaired from 1
    for r in range(3):  # every rank ends bit-identical to the clean run
        assert all(torch.equal(after[r]["state"][k], clean[r]["state"][k]) for k in clean[r]["state"])
    assert all(c["agree"] for c in before[0]["checks"])
    assert any(not torch.equal(before[0]["state"][k], clean[0]["state"][k]) for k in clean[0]["state"])
    t = medians([r["timings"] for r in slow])
    found = find_stragglers(t["compute"], t["wait"])
    assert found["stragglers"] == [2] and found["least_wait"] == 2


def test_peer_snapshot_restores_what_was_saved_both_ways(tmp_path):
    assert [holder(r, 4) for r in range(4)] == [1, 2, 3, 0]
    out = launch(bench_paths, 1 << 12, str(tmp_path), 1, world_size=3, quiet=True)
    assert all(o["restored_identical"] and o["bytes"] == 4 << 12 for o in out)


def test_shares_of_each_policy():
    assert shares_of("shrink", [0, 2], 0, 3) == [0]
    assert shares_of("cover", [0, 2], 0, 3) == [0, 1] and shares_of("cover", [0, 2], 2, 3) == [2]
    assert shares_of("cover", [3], 3, 4) == [3, 0, 1, 2]


def test_a_killed_rank_restored_from_its_peer_ends_bit_exact(tmp_path):
    cfg = dict(ELASTIC, replicas=2, steps=6)
    run = run_elastic(cfg, "peer", {"replica": 1, "step": 2}, tmp_path, timeout_s=180)
    ref = launch(peer_reference, cfg, world_size=2, quiet=True)
    for r in range(2):
        assert ref[r]["state"].keys() == run["states"][r].keys()
        assert all(torch.equal(run["states"][r][k], ref[r]["state"][k]) for k in ref[r]["state"]), r
    assert run["loss"] == ref[0]["loss"]
    joiner = run["logs"][1]
    assert joiner["restart"] == 1 and joiner["disk_equals_peer"] and run["rejoined_after_step"] == 2
    assert run["detect_s"] < run["rejoin_s"]


@pytest.mark.parametrize("policy", ["shrink", "cover"])
def test_replicas_train_through_a_lost_one_as_their_batches_say(tmp_path, policy):
    """Under "cover", survivor 0 also stalls when the failure hits, its heartbeat with it: survivor 1
    goes on alone, and 0 comes back as a replacement does."""
    cfg = dict(ELASTIC, replicas=3, steps=24, min_step_s=0.1)
    if policy == "cover":
        cfg["stall"] = {"replica": 0, "s": 2 * cfg["stale_s"]}
    run = run_elastic(cfg, policy, {"replica": 2, "step": 3}, tmp_path, timeout_s=180)
    assert run["left_out"] == ([0] if policy == "cover" else [])
    full = replay(cfg, [[0, 1, 2]] * cfg["steps"])
    should = replay(cfg, run["shares"])
    assert max(abs(a - b) for a, b in zip(run["loss"], should["loss"])) < 1e-5
    assert run["logs"][2]["restart"] == 1 and run["shares"][:3] == [[0, 1, 2]] * 3
    if policy == "shrink":
        assert run["degraded_steps"] >= 1 and run["shares"][3] == [0, 1]
        assert max(abs(a - b) for a, b in zip(run["loss"], full["loss"])) > 1e-5
    else:  # the lost share computed by a survivor: the uninterrupted run's arithmetic
        assert run["degraded_steps"] == 0 and run["shares"] == [[0, 1, 2]] * cfg["steps"]
        assert max(abs(a - b) for a, b in zip(run["loss"], full["loss"])) < 1e-5
    for r in range(3):  # every replica, the replacement included, ends with the same weights
        assert all(torch.equal(run["states"][r][k], run["states"][0][k]) for k in run["states"][0])


def test_bad_elastic_inputs_are_one_line(tmp_path):
    cfg = dict(ELASTIC, replicas=2, steps=4)
    with pytest.raises(ValueError, match=r"policy='grow' is unknown; valid policies: \['shrink', 'cover', 'peer'\]"):
        run_elastic(cfg, "grow", {"replica": 1, "step": 1}, tmp_path)
    with pytest.raises(ValueError, match="must name a replica below 2 and a step below 4"):
        run_elastic(cfg, "shrink", {"replica": 5, "step": 1}, tmp_path)


def test_schematic_is_what_labkit_draws_and_the_chapter_shows_it():
    from pathlib import Path

    from labkit.labs import schematics, schematics_failures

    book = Path(__file__).resolve().parent.parent / "book"
    for name, draw in schematics_failures.FIGURES.items():  # tests/test_schematics.py holds its bytes
        assert schematics.FIGURES[name] is draw
        assert f"```{{figure}} images/{name}\n:name: fig-" in (book / "failures_at_scale.md").read_text()
