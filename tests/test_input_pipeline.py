"""The stall profiler against loaders whose costs are known, and the lab's workloads."""
import threading
import time
import types

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader

import labkit.feeding.stalls as stalls
import labkit.feeding.workloads as workloads
from labkit.feeding.stalls import StallReport, StepRecord, analytic_wait_fraction, classify, count_tokens, measure_stalls
from labkit.feeding.workloads import (IGNORE, PAD_ID, MemmapSamples, SleepBatches, TextSamples, epochs,
                                  pretokenize, speeches)
from labkit.feeding.prefetch import BackgroundPrefetcher

LOAD_S, COMPUTE_S = 0.08, 0.05


class Clock:
    """Seconds that pass only when something sleeps: every phase the profiler times is then exact,
    whatever else the machine's two cores are running."""

    def __init__(self) -> None:
        self.now = 0.0

    def perf_counter(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.now += seconds


@pytest.fixture
def clock(monkeypatch) -> Clock:
    """The profiler's clock and the workloads' sleeps, both on one :class:`Clock`."""
    c = Clock()
    monkeypatch.setattr(stalls, "time", types.SimpleNamespace(perf_counter=c.perf_counter))
    monkeypatch.setattr(workloads, "time", types.SimpleNamespace(sleep=c.sleep))
    return c


class WorkerPipeline:
    """What ``DataLoader(num_workers=w, prefetch_factor=p)`` does with batches of ``load_s`` each, on a
    :class:`Clock`: batch k goes to worker ``k % w``, is sent to it once batch ``k - w p`` has been
    handed over (p batches in flight per worker), and is ready ``load_s`` after its worker has it and
    is done with the one before; ``next()`` blocks until then."""

    def __init__(self, n: int, load_s: float, workers: int, prefetch: int, clock: Clock) -> None:
        self.n, self.load_s, self.w, self.p, self.clock = n, load_s, workers, prefetch, clock

    def __iter__(self):
        start, handed, ready = self.clock.now, [], []
        for k in range(self.n):
            sent = start if k < self.w * self.p else handed[k - self.w * self.p]
            free = ready[k - self.w] if k >= self.w else start
            ready.append(max(sent, free) + self.load_s)
            self.clock.now = max(self.clock.now, ready[k])
            handed.append(self.clock.now)
            yield torch.tensor([k])


@pytest.mark.parametrize("workers", [0, 1, 2])
def test_measured_wait_fraction_matches_the_analytic_steady_state(clock, workers):
    """0 workers: L/(L+C) = 0.615; 1 worker: (L-C)/L = 0.375; 2 workers: L/2 < C, so 0.

    On a :class:`Clock`, so exactly: no worker is descheduled by another process. With no workers the
    loader is a real DataLoader over :class:`SleepBatches` (its sleeps on the clock); with workers, the
    DataLoader's pipeline as :class:`WorkerPipeline` models it (worker processes cannot share the
    clock: test_a_real_loader_with_workers_is_timed_step_by_step times real ones). The first
    ``workers + 1`` steps are warm-up, left out: until every worker has delivered once the pipeline
    is still filling.
    """
    if workers:
        loader = WorkerPipeline(16, LOAD_S, workers, 2, clock)
    else:
        loader = DataLoader(SleepBatches(16, LOAD_S), batch_size=None, num_workers=0)
    rep = measure_stalls(loader, lambda b: clock.sleep(COMPUTE_S), warmup=workers + 1)
    expected = analytic_wait_fraction(LOAD_S, COMPUTE_S, workers)
    assert expected == pytest.approx({0: 8 / 13, 1: 3 / 8, 2: 0.0}[workers])
    assert rep.median_wait_fraction == pytest.approx(expected, abs=1e-9), (rep.median_wait_fraction, expected)
    assert rep.wait_fraction == pytest.approx(expected, abs=1e-9)  # every steady step alike: the mean too
    assert rep.step_s == pytest.approx(max(COMPUTE_S, LOAD_S / workers) if workers else LOAD_S + COMPUTE_S)
    assert len(rep.steps) == 16 and len(rep.steady) == 16 - workers - 1
    assert rep.steps[0].wait == pytest.approx(LOAD_S)  # the first batch, loaded while the step waits
    assert rep.copy_fraction == 0.0  # CPU: nothing is copied, and 0 is reported, not a guess
    assert rep.classification == {0: "highly input-bound", 1: "highly input-bound", 2: "not input-bound"}[workers]


@pytest.mark.parametrize("workers", [0, 1, 2])
def test_a_real_loader_with_workers_is_timed_step_by_step(workers):
    """Real worker processes on the real clock: what holds however long anything took. A sleep lasts
    at least its length, so each step computes for at least C, and the first waits at least L (its
    batch loaded, and the workers started, after the measurement began); the phases partition each
    step; steps follow one another."""
    n = 6
    loader = DataLoader(SleepBatches(n, LOAD_S), batch_size=None, num_workers=workers,
                        prefetch_factor=2 if workers else None)
    rep = measure_stalls(loader, lambda b: time.sleep(COMPUTE_S), warmup=workers + 1)
    assert len(rep.steps) == n and len(rep.steady) == n - workers - 1
    assert rep.copy_fraction == 0.0
    assert rep.steps[0].start == 0.0 and rep.steps[0].wait >= LOAD_S - 1e-6
    end = 0.0
    for r in rep.steps:
        assert r.wait + r.copy + r.compute == pytest.approx(r.end - r.start, abs=1e-9)
        assert r.start >= end and r.wait >= 0 and r.compute >= COMPUTE_S - 1e-6
        end = r.end
    assert 0.0 <= rep.median_wait_fraction <= 1.0 and 0.0 <= rep.wait_fraction <= 1.0


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


def test_phases_tokens_and_busy_share(clock):
    """Padding counts as busy; useful tokens do not include it. On a :class:`Clock`: 10 ms of load and
    20 ms of step, exactly."""
    def slow(batches):
        for b in batches:
            clock.sleep(0.01)
            yield b

    rep = measure_stalls(slow(_padded_batches(6)), lambda b: clock.sleep(0.02), warmup=1, pad_id=PAD_ID)
    assert len(rep.steps) == 6 and rep.pinned is None
    for r in rep.steps:
        assert (r.wait, r.copy, r.compute) == pytest.approx((0.01, 0.0, 0.02))
        assert r.end - r.start == pytest.approx(0.03)
        assert r.tokens == 32 and r.useful_tokens == 8
    assert rep.pad_fraction == pytest.approx(0.75)
    assert rep.elapsed_s == pytest.approx(5 * 0.03) and rep.step_s == pytest.approx(0.03)
    assert rep.wait_fraction == pytest.approx(1 / 3) and rep.busy_fraction == pytest.approx(2 / 3)  # 10 ms of 30
    assert rep.useful_busy_fraction == pytest.approx(rep.busy_fraction * 0.25)
    assert rep.tokens_per_s == pytest.approx(5 * 32 / 0.15)
    assert rep.useful_tokens_per_s == pytest.approx(5 * 8 / 0.15)
    s = rep.summary()
    assert s["n_steps"] == 6 and len(s["steps"]) == 6 and s["classification"] == rep.classification
    assert count_tokens(_padded_batches(1)[0]) == (32, 32)  # no pad_id: every token counts


def test_diagnosis_names_padding_when_the_input_is_not_the_problem(clock):
    rep = measure_stalls(_padded_batches(4), lambda b: clock.sleep(0.01), warmup=1, pad_id=PAD_ID)
    assert rep.input_fraction == 0.0 and rep.classification == "not input-bound"  # a list waits for nothing
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


def test_background_prefetcher_overlaps_loading_with_the_step_and_keeps_order():
    """While the training loop runs step i, the prefetcher's thread already asks the loader for item
    i + 1 (a loader pulled only between steps never would: the step waits for that, so a prefetcher
    that does not overlap fails on the timeout instead of hanging), and never more than ``depth + 1``
    items ahead of the step (its queue holds ``depth``, and one more is in its hands)."""
    n, depth = 8, 2
    asked = [threading.Event() for _ in range(n)]

    def loader():
        for i in range(n):
            asked[i].set()
            yield torch.tensor([i])

    seen = []
    for b in BackgroundPrefetcher(loader(), depth=depth):
        i = int(b)
        seen.append(i)
        if i + depth + 2 < n:
            assert not asked[i + depth + 2].is_set(), f"step {i}: item {i + depth + 2} read ahead of the queue"
        if i + 1 < n:
            assert asked[i + 1].wait(timeout=60), f"step {i} ran and the loader was never asked for item {i + 1}"
    assert seen == list(range(n))

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
