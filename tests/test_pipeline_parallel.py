"""Pipeline parallelism (torch.distributed.pipelining and hand-written) against single-process training,
and the instruments: timeline, bubble, activation memory per stage."""
import statistics
from dataclasses import replace

import numpy as np
import pytest
import torch

from tp_pp_fns import one_thread
from labkit.launch import launch
from labkit.core.model import GPT, GPTConfig, build_model
from labkit.parallel.layout.checks import check_layout
from labkit.parallel.layout.mesh import Degrees
from labkit.parallel.pipeline.stages import GPTStage, Split, check_pp, schedule_order, stage_bounds, stage_params
from labkit.parallel.pipeline.timeline import ActivationMeter, Event, bubble_formula, bubble_fraction
from labkit.train import TrainConfig, train, train_many

MODEL = GPTConfig(block_size=32, n_layer=4)
# lr 1e-3: at the default 3e-3 seed 0 spikes at step 15 and amplifies last-bit differences; there even
# one process accumulating 4 microbatches (the same sums as a pipeline, in another order) is 1.7e-4 off
# its grad_accum=1 run, which no pipeline can beat. At 1e-3 that deviation stays below 1e-6.
CFG = TrainConfig(steps=20, batch_size=8, lr=1e-3, return_params=True)
M = 4  # microbatches
LOSS_TOL = 1e-5
# Microbatches sum gradients in another order than one batch; Adam divides by sqrt(v), which blows
# last-bit differences up where a gradient is near zero (measured 8e-5 after 20 steps at lr 3e-3). A
# wrong pipeline (a stage without gradients, an unsynced tied copy) is off by ~lr per step.
PARAM_TOL = 3e-4
VARIANTS = {"torch_gpipe": ("pp", "gpipe"), "torch_1f1b": ("pp", "1f1b"), "scratch_gpipe": ("pp_scratch", "gpipe"),
            "scratch_1f1b": ("pp_scratch", "1f1b"), "torch_interleaved": ("pp", "interleaved"),
            # the zero-bubble schedules torch ships: B and W split, interleaved and V-shaped placements
            "torch_zb": ("pp", "zb"), "torch_zbv": ("pp", "zbv"), "torch_dualpipev": ("pp", "dualpipev")}
# Stages as torchtitan and Llama 3 cut them: any number a rank, the first and last a layer lighter
# (4 layers + the embedding + the output on 6 stages: the first stage holds only the embedding).
SPLITS = {"torch_interleaved_3_uneven": dict(pp_schedule="interleaved", pp_stages_per_rank=3,
                                             pp_first_stage_less_layers=1, pp_last_stage_less_layers=1),
          "torch_1f1b_uneven": dict(pp_schedule="1f1b", pp_first_stage_less_layers=1, pp_last_stage_less_layers=1)}
# What the one loop gives every strategy, on pipelines too: a warmed-up cosine schedule, clipping that
# bites, recomputation, bf16 autocast; each against one process doing the same.
EXTRAS = {"cosine_clip_full": dict(lr_schedule="cosine", warmup_steps=2, grad_clip=0.05,
                                   activation_checkpointing="full", steps=8),
          "every2_bf16": dict(activation_checkpointing="every:2", precision="bf16", steps=6),
          "fp16": dict(precision="fp16", steps=6)}
EXTRA_TOL = {"cosine_clip_full": LOSS_TOL, "every2_bf16": 2e-3, "fp16": 5e-3}  # 16 bits: test_sharded's bf16 bar


@pytest.fixture(scope="module")
def ref():
    with one_thread():
        return train(CFG, MODEL)


@pytest.fixture(scope="module")
def runs():
    names = list(VARIANTS) + list(SPLITS) + [f"{e}/{s}" for e in EXTRAS for s in ("pp", "pp_scratch")]
    configs = [replace(CFG, strategy=st, pp_schedule=sc, microbatches=M) for st, sc in VARIANTS.values()]
    configs += [replace(CFG, strategy="pp", microbatches=M, **kw) for kw in SPLITS.values()]
    configs += [replace(CFG, strategy=s, microbatches=M, pp_schedule="1f1b", **kw) for kw in EXTRAS.values()
                for s in ("pp", "pp_scratch")]
    out = launch(train_many, configs, MODEL, world_size=2, timeout=300)
    return [dict(zip(names, rank)) for rank in out]


@pytest.mark.parametrize("extra", list(EXTRAS))
def test_schedules_clipping_precision_and_recomputation_reach_pipelines(runs, extra):
    with one_thread():
        want = train(replace(CFG, grad_accum=M, **EXTRAS[extra]), MODEL)  # the same microbatches, one process
    for s in ("pp", "pp_scratch"):
        got = runs[0][f"{extra}/{s}"]
        diff = np.abs(np.array(want["loss"]) - np.array(got["loss"])).max()
        assert diff < EXTRA_TOL[extra], (extra, s, diff)


@pytest.mark.parametrize("name", list(VARIANTS) + list(SPLITS))
def test_pipeline_matches_single_process_every_step(ref, runs, name):
    r = runs[0][name]
    diff = np.abs(np.array(ref["loss"]) - np.array(r["loss"]))
    assert len(diff) == CFG.steps >= 20 and diff.max() < LOSS_TOL, diff
    assert set(r["params"]) == set(ref["params"])  # the stages' state dicts merge into the GPT's
    assert max((ref["params"][k] - r["params"][k]).abs().max().item() for k in ref["params"]) < PARAM_TOL
    assert torch.equal(r["params"]["head.weight"], r["params"]["wte.weight"])  # tied copies stayed equal
    assert runs[1][name]["loss"] == r["loss"]


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_hand_written_pipeline_matches_torch_pipelining(runs, schedule):
    t, s = runs[0][f"torch_{schedule}"], runs[0][f"scratch_{schedule}"]
    assert np.abs(np.array(t["loss"]) - np.array(s["loss"])).max() < 1e-6
    assert max((t["params"][k] - s["params"][k]).abs().max().item() for k in t["params"]) < 1e-6
    for rt, rs in zip(t["ranks"], s["ranks"]):  # the same schedule holds the same activations
        assert rt["peak_activation_bytes"] == rs["peak_activation_bytes"]


def test_gpipe_holds_every_microbatch_and_1f1b_at_most_p(runs):
    p = 2
    for impl in ("torch", "scratch"):
        for stage in range(p):
            g, f = runs[0][f"{impl}_gpipe"]["ranks"][stage], runs[0][f"{impl}_1f1b"]["ranks"][stage]
            per_mb = g["activation_bytes_per_microbatch"]
            assert per_mb > MODEL.n_layer // p * 2 * 32 * 64 * 4
            # + the token ids (stage 0) or targets (last stage) the loss saves: every microbatch is a
            # view of one batch tensor, counted once
            ids = CFG.batch_size * MODEL.block_size * 8
            assert set(g["peak_activation_bytes"]) == {M * per_mb + ids}, (impl, stage)
            assert set(f["peak_activation_bytes"]) == {(p - stage) * per_mb + ids}, (impl, stage)


def test_messages_between_stages_are_the_activations_and_their_gradients(runs):
    act = CFG.batch_size * MODEL.block_size * MODEL.n_embd * 4  # every microbatch crosses once each way
    tied = MODEL.vocab_size * MODEL.n_embd * 4
    for name in ("torch_gpipe", "scratch_1f1b"):
        for rank in runs[0][name]["ranks"]:
            assert rank["comm_bytes_per_step"][-1] == {"send": act, "recv": act, "allreduce": tied + 4}, name
    inter = runs[0]["torch_interleaved"]["ranks"][0]["comm_bytes_per_step"][-1]
    assert inter["send"] == inter["recv"] == 3 * act  # 4 chunks on 2 ranks: 3 boundaries


def test_memory_per_stage_is_its_layers(runs):
    r = runs[0]["torch_1f1b"]
    assert r["stage_layers"] == [(0, 2), (2, 4)]
    for rank in r["ranks"]:
        got = rank["model_state_bytes"]
        assert got["params"] == got["grads"] == 4 * stage_params(MODEL, 2, rank["rank"])
    # stage 0 keeps the embeddings, stage 1 the head's copy of the same matrix: each ~ half the model
    assert stage_params(MODEL, 2, 0) + stage_params(MODEL, 2, 1) == GPT.count_params(MODEL) + 256 * 64


def _bubble_is_what_the_timeline_says(r: dict, schedule: str, p: int, m: int, steps: int) -> None:
    """What holds of a measured bubble however long each event took on a loaded machine: each step's
    fraction is a share in [0, 1], the reported one is the median of the steps after the first (as
    labkit.train.figures reports it), the last step's is bubble_fraction of the timeline returned, and
    on every stage the events ran one at a time in the schedule's order. The stages' clocks start at
    one barrier but in different processes, so nothing across stages is compared."""
    per_step = r["bubble_fraction_per_step"]
    assert len(per_step) == steps and all(0.0 <= b <= 1.0 for b in per_step), per_step
    assert r["bubble_fraction"] == statistics.median(per_step[1:])
    events = [Event(**e) for e in r["timeline"]]
    assert per_step[-1] == pytest.approx(bubble_fraction(events), rel=1e-12, abs=1e-15)
    assert sorted((e.stage, e.kind, e.mb) for e in events) == sorted(
        (s, k, i) for s in range(p) for k in "FB" for i in range(m))
    for s in range(p):
        mine = sorted((e for e in events if e.stage == s), key=lambda e: e.start)
        assert [(e.kind, e.mb) for e in mine] == schedule_order(schedule, p, s, m), (s, mine)
        assert all(e.start <= e.end for e in mine) and all(a.end <= b.start for a, b in zip(mine, mine[1:]))


def test_bubble_is_timed_per_microbatch_on_the_schedules_timeline():
    """Measured on two ranks for m = 1 and m = 8 microbatches of 2 rows: the record, not the timing.

    That the measured bubble is at least the formula and shrinks with m are timings on shared cores
    (CI saw 0.53 -> 0.51 under load): the pipeline lab records them and labkit.labs.compare reports
    them; the formula itself is held exactly by test_bubble_of_an_ideal_timeline_is_the_formula."""
    model = GPTConfig(block_size=64, n_layer=4, n_embd=128, n_head=4)
    ms = (1, 8)
    runs = launch(train_many, [TrainConfig(strategy="pp_scratch", steps=3, batch_size=2 * m, microbatches=m,
                                           pp_schedule="gpipe") for m in ms], model, world_size=2, timeout=120)[0]
    out = dict(zip(ms, runs))
    for m, r in out.items():
        assert r["bubble_formula"] == bubble_formula(2, m) == 1 / (m + 1)
        _bubble_is_what_the_timeline_says(r, "gpipe", 2, m, steps=3)


def test_schedules_in_order():
    assert schedule_order("gpipe", 2, 0, 3) == [("F", 0), ("F", 1), ("F", 2), ("B", 0), ("B", 1), ("B", 2)]
    assert schedule_order("1f1b", 3, 0, 4) == [("F", 0), ("F", 1), ("F", 2), ("B", 0), ("F", 3), ("B", 1),
                                               ("B", 2), ("B", 3)]
    assert schedule_order("1f1b", 3, 2, 4) == [("F", 0), ("B", 0), ("F", 1), ("B", 1), ("F", 2), ("B", 2),
                                               ("F", 3), ("B", 3)]
    assert stage_bounds(5, 2) == [(0, 3), (3, 5)] and stage_bounds(4, 4) == [(0, 1), (1, 2), (2, 3), (3, 4)]
    # torchtitan's split with the embedding and the output counted a layer each: Llama 3 405B's 126
    # layers on 16 stages lose one at each end; on 128 chunks the first and last hold no layer
    sizes = [hi - lo for lo, hi in stage_bounds(126, 16, 1, 1)]
    assert sizes == [7] + [8] * 14 + [7]
    chunks = [hi - lo for lo, hi in stage_bounds(126, 128, 1, 1)]
    assert chunks[0] == chunks[-1] == 0 and set(chunks[1:-1]) == {1}


def test_bubble_of_an_ideal_timeline_is_the_formula():
    for p, m in ((2, 1), (2, 4), (4, 8)):
        ev = []
        for s in range(p):  # GPipe with unit forwards and backwards of 2 units
            ev += [Event(s, "F", i, s + i, s + i + 1) for i in range(m)]
            b0 = m + p - 1 + 2 * (p - 1 - s)
            ev += [Event(s, "B", i, b0 + 2 * i, b0 + 2 * i + 2) for i in range(m)]
        assert bubble_fraction(ev) == pytest.approx(bubble_formula(p, m))
    assert bubble_formula(4, 8, v=2) == pytest.approx(3 / 19)


def test_activation_meter_counts_what_backward_needs_and_frees_it():
    model = build_model(MODEL)
    stage = GPTStage(model, 0, 1)
    x = torch.randint(0, 256, (2, 32))
    with ActivationMeter(stage) as meter:
        loss = stage(x).logsumexp(-1).mean()
        held = meter.live
        loss.backward()
    assert held > 2 * 32 * 64 * 4 * MODEL.n_layer and meter.peak == held
    assert meter.live == 0  # backward released every saved tensor


def test_bad_pipeline_shapes_are_clear_errors():
    with pytest.raises(ValueError, match=r"pp=3 .* needs 3 stages but the model has n_layer=2"):
        check_pp(3, 2, 4, "gpipe")
    with pytest.raises(ValueError, match=r"pp=3 .* needs 3 stages"):
        train(replace(CFG, strategy="pp_scratch", pp=3), GPTConfig(n_layer=2))  # before any communication
    with pytest.raises(ValueError, match=r"pp_schedule='1f1b' needs microbatches >= pp: microbatches=2 < pp=4"):
        check_pp(4, 4, 2, "1f1b")
    with pytest.raises(ValueError, match=r"'interleaved' needs 4 stages"):
        check_pp(2, 3, 4, "interleaved")
    with pytest.raises(ValueError, match=r"pp_schedule='zb1' is unknown; valid pipeline schedules"):
        check_pp(2, 4, 4, "zb1")
    with pytest.raises(ValueError, match=r"pp_schedule='zbv' needs torch pipelining"):
        check_pp(2, 4, 4, "zbv", impl="scratch")
    with pytest.raises(ValueError, match=r"microbatches=3 must divide batch_size=8"):
        check_pp(2, 4, 3, "gpipe", batch_size=8)
    with pytest.raises(ValueError, match="grad_accum=2 is not used with strategy='pp_scratch': its microbatches"):
        replace(CFG, strategy="pp_scratch", grad_accum=2)
    with pytest.raises(ValueError, match=r"'interleaved' needs microbatches divisible by its 2 rounds .*"
                                         r"microbatches=5 with pp=2"):
        check_pp(2, 4, 5, "interleaved")
    with pytest.raises(ValueError, match=r"'interleaved' needs torch pipelining \(strategy 'pp'\)"):
        check_pp(2, 4, 4, "interleaved", impl="scratch")
    with pytest.raises(ValueError, match=r"'interleaved' needs torch pipelining \(strategy 'pp'\)"):
        TrainConfig(strategy="pp_scratch", pp_schedule="interleaved")
    check_pp(2, 4, 6, "interleaved")  # 3 rounds of 2
    # DualPipeV's V holds 2 pp stages and torch wants a microbatch for each, said only once the
    # schedule was built on every rank ('DualPipeV requires at least as many microbatches as stages')
    for pp, m in ((2, 2), (2, 3), (4, 6)):
        with pytest.raises(ValueError, match=rf"pp_schedule='dualpipev' needs at least as many microbatches as "
                                             rf"stages: --microbatches {m} < {2 * pp} \(2 x pp={pp}\); use "
                                             rf"--microbatches {2 * pp} or more"):
            check_pp(pp, 8, m, "dualpipev")
    with pytest.raises(ValueError, match=r"--microbatches 2 < 4 \(2 x pp=2\)"):  # the loop's layout check
        check_layout(Degrees(pp=2), MODEL, 8, 2, "dualpipev")
    check_pp(2, 4, 4, "dualpipev")
    check_pp(2, 4, 2, "zbv")  # ZB-V fills in the microbatches it lacks itself
    check_pp(2, 4, 1, "gpipe")  # GPipe runs with one microbatch (no pipelining, all bubble)
    # stages a rank and uneven ends
    with pytest.raises(ValueError, match=r"pp_stages_per_rank=3 applies to the schedules that hold any number"):
        check_pp(2, 8, 4, "1f1b", split=Split("1f1b", 3))
    with pytest.raises(ValueError, match=r"pp_stages_per_rank=1 must be at least 2"):
        check_pp(2, 8, 4, "interleaved", split=Split("interleaved", 1))
    with pytest.raises(ValueError, match=r"pp=2 with pp_schedule='interleaved' needs 8 stages but the model has"):
        check_pp(2, 4, 4, "interleaved", split=Split("interleaved", 4))
    with pytest.raises(ValueError, match=r"pp_first_stage_less_layers=6 and pp_last_stage_less_layers=0 must be"):
        check_pp(2, 4, 4, "1f1b", split=Split("1f1b", 0, 6, 0))
    with pytest.raises(ValueError, match=r"pp_first_stage_less_layers=-1 must be a whole number of layers"):
        check_pp(2, 4, 4, "1f1b", split=Split("1f1b", 0, -1, 0))
    check_pp(2, 4, 4, "interleaved", split=Split("interleaved", 3, 1, 1))  # 6 stages: 4 layers + the two ends


def test_one_stage_pipeline_is_plain_training(ref):
    with one_thread():
        r = train(replace(CFG, strategy="pp_scratch", steps=3, microbatches=M, pp_schedule="1f1b"), MODEL)
    assert np.abs(np.array(r["loss"]) - np.array(ref["loss"][:3])).max() < LOSS_TOL
    assert r["bubble_formula"] == 0.0


def test_train_dispatches_tp_and_pp_with_the_same_result_keys():
    """`python -m labkit.train --strategy tp|pp` goes through labkit.train.train like every strategy."""
    import numpy as np

    from labkit.core.model import GPTConfig
    from labkit.train import TrainConfig, train

    model = GPTConfig(block_size=32)
    ref = train(TrainConfig(steps=3, lr=1e-3), model)
    for strategy in ("tp", "pp_scratch"):
        r = train(TrainConfig(strategy=strategy, steps=3, lr=1e-3), model)
        assert r["strategy"] == strategy and np.abs(np.array(r["loss"]) - np.array(ref["loss"])).max() < 1e-5
        assert {"loss", "step_time_s", "ranks", "world_size", "n_params", "grad_bytes"} <= set(r)
    # one stage: nothing to wait for (the formula's (p-1)/(m+p-1) = 0; measured, only Python's gaps
    # between events, whose size is the machine's load: held to the record, not to a bound)
    assert r["pp"] == 1 and r["bubble_formula"] == 0.0
    _bubble_is_what_the_timeline_says(r, r["pp_schedule"], 1, r["microbatches"], steps=3)
    with pytest.raises(ValueError, match=r"pp_schedule='x' is unknown; valid pipeline schedules: "
                                         r"\['gpipe', '1f1b', 'interleaved', 'zb', 'zbv', 'dualpipev'\]"):
        TrainConfig(strategy="pp", pp_schedule="x")
    with pytest.raises(ValueError, match=r"strategy='pp' needs a process group"):
        train(TrainConfig(strategy="pp", steps=1), model)
