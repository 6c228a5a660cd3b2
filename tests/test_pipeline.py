"""The stall profiler against loaders whose costs are known, and the lab's workloads."""
import time

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader

from labkit.feeding.stalls import StallReport, StepRecord, analytic_wait_fraction, classify, count_tokens, measure_stalls
from labkit.feeding.workloads import (IGNORE, PAD_ID, MemmapSamples, SleepBatches, TextSamples, epochs,
                                  pretokenize, speeches)
from labkit.feeding.prefetch import BackgroundPrefetcher

# Sleeps, not CPU work: a sleep's length does not depend on what else the 2 cores are running.
LOAD_S, COMPUTE_S = 0.08, 0.05


@pytest.mark.parametrize("workers", [0, 1, 2])
def test_measured_wait_fraction_matches_the_analytic_steady_state(workers):
    """0 workers: L/(L+C) = 0.615; 1 worker: (L-C)/L = 0.375; 2 workers: L/2 < C, so 0.

    The first ``workers + 1`` steps are warm-up and left out: the first batch pays the workers'
    start-up (a fork each) and, until every worker has delivered once, the pipeline is still filling.
    The median over steps of each step's share is compared: a step delayed by another process on
    the machine moves the mean, not the typical step. L/w stays 10 ms short of C at 2 workers, so
    the ~1 ms the DataLoader needs to hand a ready batch over is not mistaken for starvation.
    """
    loader = DataLoader(SleepBatches(16, LOAD_S), batch_size=None, num_workers=workers,
                        prefetch_factor=2 if workers else None)
    rep = measure_stalls(loader, lambda b: time.sleep(COMPUTE_S), warmup=workers + 1)
    expected = analytic_wait_fraction(LOAD_S, COMPUTE_S, workers)
    assert expected == pytest.approx({0: 8 / 13, 1: 3 / 8, 2: 0.0}[workers])
    assert abs(rep.median_wait_fraction - expected) < 0.05, (rep.median_wait_fraction, expected)
    assert len(rep.steps) == 16 and len(rep.steady) == 16 - workers - 1
    assert rep.copy_fraction == 0.0  # CPU: nothing is copied, and 0 is reported, not a guess
    if workers == 0:
        assert rep.classification == "highly input-bound"


def test_analytic_formula():
    assert analytic_wait_fraction(0.04, 0.02, 0) == pytest.approx(2 / 3)
    assert analytic_wait_fraction(0.04, 0.02, 1) == pytest.approx(0.5)
    assert analytic_wait_fraction(0.04, 0.02, 2) == 0.0  # balanced: L/w == C
    assert analytic_wait_fraction(0.04, 0.01, 2) == pytest.approx(0.5)  # period L/w = 20 ms, C = 10
    assert analytic_wait_fraction(0.0, 0.02, 0) == 0.0


def test_tensorflow_thresholds():
    assert classify(0.0) == classify(0.049) == "not input-bound"
    assert classify(0.05) == classify(0.199) == "moderately input-bound"
    assert classify(0.20) == classify(1.0) == "highly input-bound"


def _padded_batches(n, rows=4, cols=8, real=2):
    x = torch.full((rows, cols), PAD_ID, dtype=torch.long)
    x[:, :real] = 7
    return [(x, x.clone()) for _ in range(n)]


def test_phases_tokens_and_busy_share():
    """Padding counts as busy; useful tokens do not include it."""
    def slow(batches):
        for b in batches:
            time.sleep(0.01)
            yield b

    rep = measure_stalls(slow(_padded_batches(6)), lambda b: time.sleep(0.02), warmup=1, pad_id=PAD_ID)
    assert len(rep.steps) == 6 and rep.pinned is None
    for r in rep.steps:
        assert r.wait + r.copy + r.compute <= r.end - r.start + 1e-9
        assert r.tokens == 32 and r.useful_tokens == 8
    assert rep.pad_fraction == pytest.approx(0.75)
    assert rep.busy_fraction + rep.wait_fraction == pytest.approx(1.0, abs=0.01)
    assert rep.useful_busy_fraction == pytest.approx(rep.busy_fraction * 0.25)
    assert rep.useful_tokens_per_s == pytest.approx(rep.tokens_per_s / 4)
    assert rep.useful_tokens_per_s == pytest.approx(5 * 8 / rep.elapsed_s)
    assert 0.2 < rep.wait_fraction < 0.5  # 10 ms of 30
    s = rep.summary()
    assert s["n_steps"] == 6 and len(s["steps"]) == 6 and s["classification"] == rep.classification
    assert count_tokens(_padded_batches(1)[0]) == (32, 32)  # no pad_id: every token counts


def test_diagnosis_names_padding_when_the_input_is_not_the_problem():
    rep = measure_stalls(_padded_batches(4), lambda b: time.sleep(0.01), warmup=1, pad_id=PAD_ID)
    assert rep.classification == "not input-bound"
    assert "75% of the tokens computed are padding" in rep.diagnosis


def test_diagnosis_of_a_starved_step():
    recs = [StepRecord(0.1 * i, 0.06, 0.0, 0.04, 0.1 * i + 0.1, 4, 4) for i in range(3)]
    rep = StallReport(recs, warmup=0, device="cpu", pinned=None)
    assert rep.wait_fraction == pytest.approx(0.6)
    assert rep.diagnosis.startswith("60% of step time waiting for input: highly input-bound; add DataLoader workers")
    copy_bound = StallReport([StepRecord(0, 0.0, 0.3, 0.7, 1.0, 1, 1)], 0, "cuda", pinned=False)
    assert "pin host memory" in copy_bound.diagnosis


def test_text_samples_are_padded_next_byte_rows_at_a_controlled_cost():
    ds = TextSamples(block_size=64, n=6, io_ms=20, cpu_ms=15)
    assert len(speeches()) == 7222
    t, c = time.perf_counter(), time.thread_time()
    x, y = ds[3]
    wall, cpu = time.perf_counter() - t, time.thread_time() - c
    assert cpu >= 0.015 and wall >= 0.035  # 15 ms of real tokenizer work plus a 20 ms wait
    assert x.shape == y.shape == (64,) and x.dtype == torch.long
    real = x != PAD_ID
    assert torch.equal(y[:-1][real[1:]], x[1:][real[1:]])  # next-byte targets where there is text
    assert (y[~real] == IGNORE).all()  # no loss on padding
    assert torch.equal(TextSamples(64, n=6)[3][0], x)  # a pure function of the index
    lengths = [int((TextSamples(64, n=50)[i][0] != PAD_ID).sum()) for i in range(50)]
    assert min(lengths) < 64 and max(lengths) == 64  # speeches vary: some rows are padded


def test_setup_cost_is_paid_once_per_process(monkeypatch):
    import types

    import labkit.feeding.workloads as workloads

    slept = []  # what each read sleeps, recorded: a time measured on a loaded machine would be a guess
    monkeypatch.setattr(workloads, "time", types.SimpleNamespace(sleep=slept.append))  # this module's only
    ds = TextSamples(block_size=16, n=4, io_ms=2, setup_ms=50)
    ds[0]
    ds[1]
    assert slept == [0.05, 0.002, 0.002]
    ds._ready_pid = None  # as in a fresh worker process (a copy made before its first read): it pays again
    ds[2]
    assert slept[3:] == [0.05, 0.002]


def test_one_sample_in_slow_every_is_a_cold_read():
    ds = TextSamples(block_size=16, n=64, io_ms=1, slow_every=32, slow_ms=100)
    io = [ds.io_seconds(i) for i in range(64)]
    assert io.count(0.1) == 2 and io[31] == io[63] == 0.1 and sum(io) == pytest.approx(0.062 + 0.2)


def test_pretokenized_memmap_holds_the_same_rows(tmp_path):
    ds = TextSamples(block_size=32, n=40, io_ms=5)
    path = pretokenize(ds, tmp_path / "rows.npy")
    assert isinstance(np.load(path, mmap_mode="r"), np.memmap)
    mm = MemmapSamples(path)
    assert len(mm) == 40
    for i in (0, 17, 39):
        assert all(torch.equal(a, b) for a, b in zip(mm[i], ds[i]))
    # Worker processes map the file themselves and deliver the same batches.
    a = torch.cat([b[0] for b in DataLoader(mm, batch_size=8, num_workers=2)])
    assert torch.equal(a, torch.stack([ds[i][0] for i in range(40)]))


def test_background_prefetcher_overlaps_waits_and_keeps_order():
    def slow():
        for i in range(8):
            time.sleep(0.03)
            yield torch.tensor([i])

    seen = []
    plain = measure_stalls(slow(), lambda b: time.sleep(0.03), warmup=2)
    pre = measure_stalls(BackgroundPrefetcher(slow(), depth=2), lambda b: (seen.append(int(b)), time.sleep(0.04)),
                         warmup=2)
    assert seen == list(range(8))
    assert plain.median_wait_fraction > 0.4 and pre.median_wait_fraction < 0.15

    def broken():
        yield torch.tensor([0])
        raise OSError("disk gone")

    with pytest.raises(OSError, match="disk gone"):
        list(BackgroundPrefetcher(broken()))


def test_epochs_restart_the_loader():
    assert [int(b) for b in epochs(DataLoader(list(range(3)), batch_size=None), 2)] == [0, 1, 2, 0, 1, 2]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="host-to-device copies need a CUDA device")
def test_cuda_copy_is_timed_pinned_and_pageable():
    big = torch.zeros(64, 1 << 18)  # 64 MiB
    for pin in (False, True):
        batch = big.pin_memory() if pin else big
        rep = measure_stalls([batch] * 4, lambda b: b.sum(), device="cuda", warmup=1)
        assert rep.pinned is pin and all(r.copy > 0 for r in rep.steps)


def test_bad_input_is_named():
    with pytest.raises(ValueError, match="steps must be a positive integer, got 0"):
        measure_stalls([1], print, steps=0)
    with pytest.raises(ValueError, match="warmup=2 leaves no steady steps out of steps=2"):
        measure_stalls([1, 2], print, steps=2, warmup=2)
    with pytest.raises(ValueError, match="warmup must be a non-negative integer, got -1"):
        measure_stalls([1, 2], print, warmup=-1)
    with pytest.raises(ValueError, match="loader must be iterable"):
        measure_stalls(3, print)
    with pytest.raises(ValueError, match="step_fn must be callable"):
        measure_stalls([1], "step")
    with pytest.raises(ValueError, match=r"device='tpu' is unknown; valid devices: \['cpu', 'cuda'\]"):
        measure_stalls([1], print, device="tpu")
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="CUDA is not available"):
            measure_stalls([1], print, device="cuda")
    with pytest.raises(ValueError, match=r"the loader yielded 2 batches but steps=5; pass steps<=2"):
        measure_stalls([1, 2], lambda b: None, steps=5, warmup=0)
    with pytest.raises(ValueError, match="not more than warmup=1"):
        measure_stalls([1], lambda b: None)
    with pytest.raises(ValueError, match="load_s must be a finite number of seconds >= 0"):
        analytic_wait_fraction(-1, 0.02, 0)
    with pytest.raises(ValueError, match="num_workers must be a non-negative integer, got -1"):
        analytic_wait_fraction(0.04, 0.02, -1)
    with pytest.raises(ValueError, match="cannot both be 0"):
        analytic_wait_fraction(0, 0, 1)
    with pytest.raises(ValueError, match=r"input_fraction must be in \[0, 1\]"):
        classify(1.5)
    with pytest.raises(ValueError, match="block_size must be an integer > 0"):
        TextSamples(block_size=0)
    with pytest.raises(ValueError, match="io_ms must be a finite number >= 0"):
        TextSamples(io_ms=-1)
    with pytest.raises(ValueError, match="load_s must be a finite number >= 0"):
        SleepBatches(4, float("nan"))
    with pytest.raises(ValueError, match="path='.*nope.npy' is not a file; write one with pretokenize"):
        MemmapSamples("/nonexistent/nope.npy")
    with pytest.raises(ValueError, match="depth must be a positive integer"):
        BackgroundPrefetcher([1], depth=0)
    with pytest.raises(ValueError, match="n must be an integer > 0"):
        list(epochs([1], 0))
