"""The GPU side, as far as a CPU can show it: gpu profiles fitted to 1-8 GPUs, `make gpu-check` and its
items run on CPU processes, labs run as plain scripts where no Jupyter exists."""
import json
import os
import subprocess
import sys

import pytest

from labkit.labs import PROFILES, list_labs, resolve
from labkit.labs.cli import main as labs_main
from labkit.labs.gpu_check import _guarded
from labkit.labs.gpu_items import Setting, strategy_configs
from labkit.labs.profiles import GPU_CHECK
from labkit.train import STRATEGIES

ENV = {**os.environ, "PYTHONWARNINGS": "ignore"}
# Parameters that say how many ranks a part of a lab starts (or which degrees it splits over)
RANK_KEYS = ("world_size", "ring_world_sizes", "sweep_world_sizes", "degrees", "mem_pp", "gpus", "bw_tp")


@pytest.mark.parametrize("gpus", [1, 2, 4, 8])
@pytest.mark.parametrize("lab", sorted(PROFILES))
def test_resolve_fits_every_gpu_profile_to_the_gpus_there_are(capsys, lab, gpus):
    assert labs_main(["resolve", lab, "gpu", "--gpus", str(gpus)]) == 0
    p = json.loads(capsys.readouterr().out)
    assert p == resolve(lab, "gpu", gpus=gpus)
    for key in RANK_KEYS:
        if key == "bw_tp":  # the bandwidth model's 70B layout on 8 GPUs: arithmetic, no ranks started
            continue
        values = p.get(key)
        for v in values if isinstance(values, list) else [values]:
            assert not isinstance(v, int) or v <= gpus or p.get("device") == "cpu", (lab, key, v)
    if p.get("device") == "cpu":  # a lab about splitting a model, on one GPU: said, and run on CPU processes
        assert gpus == 1 and "needs 2 GPUs" in p["note"]
    elif "world_size" in p and isinstance(p["world_size"], int):
        assert p["multi_rank"] == (p["world_size"] >= 2)
    if p.get("device") == "cuda" and lab == "tensor_parallel":
        assert all(12 % d == 0 for d in p["degrees"])
    resolve(lab, "gpu", gpus=gpus, **GPU_CHECK.get(lab, {}))  # the check's trims name real parameters


def test_the_gpu_check_trims_every_lab_that_trains():
    assert set(GPU_CHECK) == set(list_labs()) - {"strategy_cost"}


def test_gpu_check_without_cuda_is_one_sentence_and_exit_2():
    proc = subprocess.run([sys.executable, "-m", "labkit.gpu_check"], env=ENV, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 2
    assert proc.stderr.count("\n") == 1 and "Traceback" not in proc.stderr
    assert "no CUDA GPU is visible" in proc.stderr and "--device cpu" in proc.stderr


def test_missing_packages_skip_with_their_name(monkeypatch):
    import labkit.labs.gpu_items as items

    monkeypatch.setattr(items, "has", lambda package: package != "deepspeed")
    configs, skipped = strategy_configs(Setting("cpu", 2, 2))
    assert not {"zero1", "zero2", "zero3"} & set(configs)
    assert sorted(skipped) == [f"zero{k}: needs the package 'deepspeed'" for k in (1, 2, 3)]
    assert configs["tp"].tp == 2 and configs["pp"].pp == 2 and configs["pp"].microbatches == 4

    def needs_it():
        import labkit_no_such_package  # noqa: F401

    def breaks():
        raise RuntimeError("NCCL error: unhandled system error\nmore detail")

    (skip,), (fail,) = _guarded("x", needs_it), _guarded("y", breaks)
    assert skip.status == "skip" and "'labkit_no_such_package'" in skip.detail
    assert fail.status == "fail" and fail.detail == "RuntimeError: NCCL error: unhandled system error"


def test_gpu_check_items_run_on_cpu_processes(tmp_path):
    """The same items a GPU node runs, on two gloo ranks: a check of the check. Every strategy's
    metrics carry the speed and memory keys (the strategies item fails a run that lacks one)."""
    proc = subprocess.run([sys.executable, "-m", "labkit.gpu_check", "--device", "cpu", "--steps", "2",
                           "--only", "environment,strategies,speed,determinism", "--out", str(tmp_path)],
                          env=ENV, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    lines = [ln for ln in proc.stdout.splitlines() if ln[:5] in ("PASS ", "FAIL ", "SKIP ")]
    names = [ln.split(":")[0][5:] for ln in lines]
    strategies = [s for s in STRATEGIES if s != "single"]
    assert names == ["environment", *(f"strategy {s}" for s in strategies), "speed", "memory vs calculator",
                     "determinism"]
    report = json.loads((tmp_path / "gpu_check.json").read_text())
    assert report["counts"] == {"pass": len(lines), "fail": 0, "skip": 0}
    figures = {i["name"]: i["figures"] for i in report["items"]}
    assert all(figures[f"strategy {s}"]["max_loss_dev"] < 1e-5 for s in strategies)
    assert all(figures[f"strategy {s}"]["tokens_per_s"] > 0 for s in strategies)
    assert figures["determinism"]["rerun_equal"] and figures["determinism"]["resume_equal"]
    assert "| strategy tp | PASS |" in (tmp_path / "gpu_check.md").read_text()


def test_a_lab_run_as_a_script_records_what_papermill_records(tmp_path, lab_metrics):
    """No Jupyter on the machine: the lab's cells in order, its parameters injected, the same metrics."""
    proc = subprocess.run([sys.executable, "-m", "labkit", "run", "strategy_cost", "--profile", "ci", "--as-script",
                           "--out", str(tmp_path)], env=ENV, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert json.loads((tmp_path / "strategy_cost.metrics.json").read_text()) == lab_metrics["strategy_cost"]
    assert "wrote strategy_cost.metrics.json" in (tmp_path / "strategy_cost.log").read_text()
