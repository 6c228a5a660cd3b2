"""The wire: the collective benchmark, the alpha-beta fit, the trace parser, HSDP, accumulation
without a sync per micro-batch, and the emulated slow link, each held to what it claims."""
import json
import os
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from labkit.comm import alpha_beta, trace
from labkit.comm.bench import OPS, bench_on_rank, busbw_factor, message_sizes, parse_size
from labkit.core.model import GPTConfig
from labkit.fault_tolerance.injection import torchrun_command
from labkit.launch import RankError, launch
from labkit.train import TrainConfig, train, train_many
from labkit.parallel.fsdp import hsdp_formula

ENV = {**os.environ, "PYTHONWARNINGS": "ignore"}
MODEL = GPTConfig(block_size=16)


def test_the_benchmark_command_runs_under_torchrun_and_writes_its_rows(tmp_path):
    """The exact command the chapter gives, with --json: one row per size, nccl-tests' columns."""
    out = tmp_path / "rows.json"
    cmd = torchrun_command([], max_restarts=0)[:-1] + ["labkit.comm.bench", "--op", "all_reduce", "--min-bytes",
                                                       "1K", "--max-bytes", "16M", "--json", str(out)]
    proc = subprocess.run(cmd, env=ENV, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = json.loads(out.read_text())
    assert [r["bytes"] for r in rows] == [1024 << k for k in range(15)]  # 1K, 2K, ... 16M
    for r in rows:
        assert {"op", "bytes", "time_us", "algbw_gbps", "busbw_gbps"} <= set(r) and r["op"] == "all_reduce"
        assert r["algbw_gbps"] == pytest.approx(r["bytes"] / (r["time_us"] / 1e6) / 1e9, rel=1e-12)
        assert r["busbw_gbps"] == r["algbw_gbps"] * busbw_factor("all_reduce", 2)
    assert "busbw (GB/s)" in proc.stdout and proc.stdout.count("all_reduce") == 15


@pytest.mark.parametrize("argv, message", [
    (["--op", "all_sum"], "--op='all_sum' is unknown; valid ops: ['all_reduce'"),
    (["--min-bytes", "1X"], "size '1X' is not a byte count; write e.g. 8, 1K, 16M or 1G"),
    (["--min-bytes", "2M", "--max-bytes", "1M"], "--max-bytes 1M is below --min-bytes 2M"),
    (["--device", "tpu"], "--device='tpu' is unknown; valid devices: ['cpu', 'cuda']"),
    (["--target-ms", "0"], "--target-ms must be a positive finite number, got 0.0"),
    ([], "run it under torchrun, one process per rank"),
])
def test_bad_benchmark_arguments_are_one_line(argv, message):
    env = {k: v for k, v in ENV.items() if k not in ("RANK", "WORLD_SIZE")}
    proc = subprocess.run([sys.executable, "-m", "labkit.comm.bench", *argv], env=env, capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr and proc.stderr.count("\n") == 1
    assert message in proc.stderr, proc.stderr


def test_every_collective_runs_and_bus_bandwidth_is_algbw_times_the_factor():
    sizes = message_sizes(64, 4096, 4, ranks=3)
    assert sizes == [72, 264, 1032, 4104] and all(s % 12 == 0 for s in sizes)
    rows = launch(bench_on_rank, list(OPS), sizes, "cpu", 1, 2.0, world_size=3, quiet=True)[0]
    assert [(r["op"], r["bytes"]) for r in rows] == [(op, s) for op in OPS for s in sizes]
    for r in rows:
        assert r["ranks"] == 3 and r["time_us"] > 0 and r["iters"] >= 15
        assert r["busbw_gbps"] == r["algbw_gbps"] * busbw_factor(r["op"], 3)
    factors = {op: busbw_factor(op, 4) for op in OPS}
    assert factors == {"all_reduce": 1.5, "all_gather": 0.75, "reduce_scatter": 0.75, "broadcast": 1.0,
                       "reduce": 1.0, "all_to_all": 0.75, "sendrecv": 1.0}
    assert parse_size("16M") == 16 << 20 and parse_size("1k") == 1024 and parse_size(8) == 8


def test_the_fit_recovers_alpha_and_beta_and_measures_its_own_error():
    s = np.geomspace(256, 64 << 20, 19)
    exact = alpha_beta.fit(s, 25e-6 + s / 8e9)
    assert exact.alpha_s == pytest.approx(25e-6, rel=1e-9) and exact.bandwidth_gbps == pytest.approx(8.0, rel=1e-9)
    assert exact.crossover_bytes == pytest.approx(25e-6 * 8e9, rel=1e-9)
    noisy_t = (25e-6 + s / 8e9) * np.random.default_rng(0).uniform(0.8, 1.25, s.size)
    noisy = alpha_beta.fit(s, noisy_t)
    # The stated error: within the noise put in (+-25%) at every size, when the model holds
    assert alpha_beta.relative_errors(noisy, s, noisy_t).max() < 0.25
    flat = alpha_beta.fit([1e3, 1e6], [1e-3, 1e-3]).beta_s_per_byte  # latency alone, never negative
    assert 0.0 <= flat < 1e-20  # (LAPACK leaves 0 or a last-bit residue such as 2e-26, by machine)
    assert alpha_beta.fit([1e3, 1e6], [1e-6, 1e-3]).alpha_s == pytest.approx(0.0, abs=1e-12)
    with pytest.raises(ValueError, match="need at least two"):
        alpha_beta.fit([1], [1])


def test_exposed_communication_is_the_part_no_compute_covers():
    events = [  # a step on a GPU: two kernels of compute, two all-reduces partly under them
        {"ph": "X", "cat": "kernel", "name": "ampere_sgemm", "ts": 0, "dur": 100},
        {"ph": "X", "cat": "kernel", "name": "ncclDevKernel_AllReduce_Sum_f32", "ts": 50, "dur": 100},
        {"ph": "X", "cat": "kernel", "name": "elementwise_kernel", "ts": 160, "dur": 40},
        {"ph": "X", "cat": "kernel", "name": "ncclDevKernel_AllReduce_Sum_f32", "ts": 190, "dur": 30},
        {"ph": "X", "cat": "cpu_op", "name": "aten::mm", "ts": 0, "dur": 500},  # CPU side: ignored on GPU
    ]
    lanes = trace.lanes(events)
    assert lanes.device == "cuda" and lanes.compute == [(0, 100), (160, 200)]
    e = trace.exposed(lanes)
    # exposed: 100-150 (after the first kernel) and 200-220 (after the second)
    assert e["communication_s"] == pytest.approx(130e-6) and e["exposed_s"] == pytest.approx(70e-6)
    assert e["hidden_s"] == pytest.approx(60e-6) and e["window_s"] == pytest.approx(220e-6)
    assert trace.subtract([(0, 10)], [(2, 3), (5, 12)]) == [(0, 2), (3, 5)]


def test_the_parser_reads_a_trace_the_training_loop_records(tmp_path):
    """DDP on two gloo ranks, one bucket per parameter tensor: every all-reduce DDP issues in the
    profiled step is a communication event, and hidden + exposed make up all of it."""
    cfg = TrainConfig(strategy="ddp", steps=3, bucket_cap_mb=0.001, profile_steps="2:3", count_comm="none",
                      profile_dir=str(tmp_path))
    counted, profiled = launch(train_many, [replace(cfg, profile_steps="", count_comm="every"), cfg], MODEL,
                               world_size=2, quiet=True)[0]
    calls = counted["ranks"][0]["allreduce_calls_per_step"][-1]
    lanes = trace.lanes(trace.load(tmp_path / "trace_rank0.json"))
    assert lanes.device == "cpu" and lanes.compute
    assert [n for _, _, n in lanes.communication] == ["gloo:all_reduce"] * calls
    e = trace.exposed(lanes)
    assert 0 < e["exposed_s"] <= e["communication_s"] < e["window_s"]
    assert e["hidden_s"] + e["exposed_s"] == pytest.approx(e["communication_s"])


def test_hsdp_equals_one_process_and_moves_the_formula_on_each_mesh_dimension():
    base = TrainConfig(steps=4, batch_size=8, lr=1e-3)
    ref = train(base, MODEL)
    hsdp = replace(base, strategy="hsdp", dp_replicate=2)
    runs = launch(train_many,
                  [hsdp, replace(hsdp, grad_accum=2), replace(hsdp, grad_accum=2, sync_each_microbatch=True)],
                  MODEL, world_size=4, quiet=True)[0]
    plain, accum, each = runs
    for r in runs:
        assert max(abs(a - b) for a, b in zip(r["loss"], ref["loss"])) < 1e-5
    f = hsdp_formula(plain["grad_bytes"], 4, 2)
    for rank in plain["ranks"]:
        dims = rank["comm_bytes_by_mesh_dim_per_step"][-1]
        shard = dims["shard"]  # all-gathers 2 Psi + reduce-scatter Psi; clipping's 4-byte norm all-reduce too
        assert shard["allgather_base"] + shard["reduce_scatter_base"] == f["shard"]["payload"]
        assert shard.get("allreduce", 0) == 4
        assert dims["replicate"] == {"allreduce": f["replicate"]["payload"]}  # Psi / S across the replicas
        assert rank["model_state_bytes"]["params"] == plain["predicted_model_state_bytes"]["params"]
    # Accumulating two micro-batches: gathers for each, gradients reduced once; or twice when asked
    a, e = (r["ranks"][0]["comm_bytes_by_mesh_dim_per_step"][-1] for r in (accum, each))
    assert a["shard"]["reduce_scatter_base"] * 2 == e["shard"]["reduce_scatter_base"]
    assert a["replicate"]["allreduce"] * 2 == e["replicate"]["allreduce"]
    with pytest.raises(RankError, match=r"dp_replicate=3 must divide world_size=4"):
        launch(train, replace(hsdp, dp_replicate=3), MODEL, world_size=4, quiet=True)
    with pytest.raises(ValueError, match=r"dp_replicate=4 has no effect with strategy='ddp'"):
        TrainConfig(strategy="ddp", dp_replicate=4)
    # one name for one dimension: hsdp's replicas are the mesh's dp_replicate, and one replica is FSDP
    from labkit.train.validate import validate

    with pytest.raises(ValueError, match=r"dp_replicate=1 is too few for strategy='hsdp': give 2 or more"):
        validate(TrainConfig(strategy="hsdp"), MODEL, 4)


def test_a_slow_link_costs_time_not_correctness():
    base = TrainConfig(strategy="ddp", steps=3, batch_size=4, lr=1e-3, count_comm="none")
    slow_cfg = replace(base, link_gbps=0.002)
    fast, slow, late = launch(train_many, [base, slow_cfg, replace(slow_cfg, link_latency_ms=30.0)], MODEL,
                              world_size=2, quiet=True)[0]
    assert slow["loss"] == fast["loss"] == late["loss"]
    # Lower bounds that load cannot break: the hook sleeps each bucket's wire time (exactly so:
    # test_the_slow_link_holds_each_bucket_back_for_its_wire_time), one bucket after the other, a sleep
    # lasts at least its length, and the timed step ends after backward has waited for every bucket.
    # A busy machine only lengthens a step; no upper bound is asserted.
    wire_s = 2 * (2 - 1) / 2 * fast["grad_bytes"] / 0.002e9  # the ring bytes of one step over the link
    assert min(slow["step_time_s"]) >= wire_s
    assert min(late["step_time_s"]) >= wire_s + 0.030  # and alpha, once per bucket (one bucket at least)
    with pytest.raises(ValueError, match="link_latency_ms=5 needs link_gbps > 0"):
        TrainConfig(strategy="ddp", link_latency_ms=5.0)
    with pytest.raises(ValueError, match="link_gbps=1.0 has no effect with strategy='fsdp'"):
        TrainConfig(strategy="fsdp", link_gbps=1.0)


def test_the_slow_link_holds_each_bucket_back_for_its_wire_time(monkeypatch):
    """The emulated link's hook on a fake clock and a fake two-rank all-reduce: the delay it applies is
    read off the sleeps it asks for, not timed. Each bucket is held back alpha + 2(n-1)/n S / B, the
    buckets queue on one link (the second waits for the first), time the link sat idle is not charged,
    and the result is the mean over the ranks."""
    import types

    import torch

    from labkit.comm import slow_link

    now, slept, reduced = [0.0], [], []

    def sleep(seconds):
        slept.append(seconds)
        now[0] += seconds

    class Work:
        def wait(self):
            return True

    def all_reduce(buf, async_op=False):
        assert async_op  # started at once; the hook's thread waits for it
        reduced.append(buf.numel())
        buf.mul_(2)  # the sum over two ranks that hold the same gradient
        return Work()

    class Bucket:
        def __init__(self, t):
            self.t = t

        def buffer(self):
            return self.t

    monkeypatch.setattr(slow_link, "time", types.SimpleNamespace(perf_counter=lambda: now[0], sleep=sleep))
    monkeypatch.setattr(slow_link, "dist", types.SimpleNamespace(get_world_size=lambda: 2, all_reduce=all_reduce,
                                                                 GradBucket=Bucket))
    hook = slow_link.slow_link_hook(0.002, latency_ms=30.0)
    grads = [torch.arange(1000, dtype=torch.float32), torch.ones(250)]
    futures = [hook(None, Bucket(g.clone())) for g in grads]  # back to back, as backward hands them over
    assert all(torch.equal(f.wait(), g) for f, g in zip(futures, grads))  # the mean of two equal gradients
    wire = [0.030 + 2 * (2 - 1) / 2 * g.numel() * 4 / 0.002e9 for g in grads]
    assert reduced == [1000, 250] and slept == pytest.approx(wire) and now[0] == pytest.approx(sum(wire))
    now[0] += 1.0  # a second of compute with the link idle: the next bucket pays its own wire time only
    hook(None, Bucket(torch.ones(250))).wait()
    assert slept[2:] == pytest.approx(wire[1:]) and now[0] == pytest.approx(sum(wire) + 1.0 + wire[1])
