"""The GPU side, as far as a CPU can show it: gpu profiles fitted to 1-8 GPUs, `make gpu-check` and its
items run on CPU processes, labs run as plain scripts where no Jupyter exists."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

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


def test_gpu_check_on_a_python_without_torch_is_one_sentence_and_exit_2():
    code = "import sys; sys.modules['torch'] = None\nfrom labkit.labs.gpu_check import main\nsys.exit(main([]))"
    proc = subprocess.run([sys.executable, "-c", code], env=ENV, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    assert proc.stderr.count("\n") == 1 and "has no PyTorch" in proc.stderr


def test_missing_packages_skip_with_their_name(monkeypatch):
    import labkit.labs.gpu_items as items

    monkeypatch.setattr(items, "has", lambda package: package != "deepspeed")
    configs, skipped = strategy_configs(Setting("cpu", 2, 2))
    assert not {"zero1", "zero2", "zero3"} & set(configs)
    assert sorted(s for s in skipped if "deepspeed" in s) == [f"zero{k}: needs the package 'deepspeed'"
                                                              for k in (1, 2, 3)]
    assert [s for s in skipped if "deepspeed" not in s] == ["ep: trains a mixture-of-experts model; see the item "
                                                             "'experts'"]
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
                           "--only", "environment,strategies,context,experts,speed,determinism", "--out",
                           str(tmp_path)],
                          env=ENV, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    lines = [ln for ln in proc.stdout.splitlines() if ln[:5] in ("PASS ", "FAIL ", "SKIP ")]
    names = [ln.split(":")[0][5:] for ln in lines]
    strategies = [s for s in STRATEGIES if s not in ("single", "ep")]  # ep: the experts item
    assert names == ["environment", *(f"strategy {s}" for s in strategies), "strategy ep",
                     "context parallel", "context parallel", "experts", "speed", "memory vs calculator", "determinism"]
    report = json.loads((tmp_path / "gpu_check.json").read_text())
    # skipped: ep among the dense strategies (the experts item trains it), and torch's context_parallel,
    # which has no CPU sharding rule for its attention kernel
    assert report["counts"] == {"pass": len(lines) - 2, "fail": 0, "skip": 2}
    figures = {i["name"]: i["figures"] for i in report["items"]}
    assert all(figures[f"strategy {s}"]["max_loss_dev"] < 1e-5 for s in strategies)
    assert all(figures[f"strategy {s}"]["tokens_per_s"] > 0 for s in strategies)
    assert figures["determinism"]["rerun_equal"] and figures["determinism"]["resume_equal"]
    assert "| strategy tp | PASS |" in (tmp_path / "gpu_check.md").read_text()


def test_a_lab_run_as_a_script_records_what_papermill_records(tmp_path):
    """No Jupyter on the machine: the lab's cells in order, its parameters injected, the same metrics.
    (The same lab through papermill, into a folder of its own: not the shared executed labs, which
    another test worker may be writing.)"""
    from labkit.labs import run_lab

    papermill = json.loads(run_lab("strategy_cost", "ci", tmp_path / "papermill", force=True).read_text())
    proc = subprocess.run([sys.executable, "-m", "labkit", "run", "strategy_cost", "--profile", "ci", "--as-script",
                           "--out", str(tmp_path)], env=ENV, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert json.loads((tmp_path / "strategy_cost.metrics.json").read_text()) == papermill
    assert "wrote strategy_cost.metrics.json" in (tmp_path / "strategy_cost.log").read_text()


# The failures a reading of the code predicted for the first GPU user, as far as a CPU can show them
# (the paired point-to-point posts are tests/test_p2p.py; fp16 on zero1_scratch, tests/test_sharded.py).
def test_cuda_groups_carry_host_tensors_over_gloo():
    """CPU-offloaded FSDP shards and object collectives live in host memory: a CUDA group needs gloo too."""
    from labkit.core.devices import backend_for

    assert backend_for("cuda") == "cpu:gloo,cuda:nccl" and backend_for("cpu") == "gloo"


def test_deepspeed_computes_where_the_run_asks_not_where_cuda_is(monkeypatch):
    import deepspeed.accelerator as acc

    from labkit.parallel.deepspeed_zero import use_accelerator

    monkeypatch.delenv("DS_ACCELERATOR", raising=False)
    use_accelerator(torch.device("cpu"))
    assert os.environ["DS_ACCELERATOR"] == "cpu"

    class CudaAccelerator:
        def device_name(self):
            return "cuda"

    monkeypatch.setattr(acc, "get_accelerator", lambda: CudaAccelerator())
    with pytest.raises(RuntimeError, match="DeepSpeed already runs on 'cuda' in this process, and this run asks "
                                           "for device='cpu'"):
        use_accelerator(torch.device("cpu"))


def test_the_kernel_gives_its_cached_gpu_memory_back_before_ranks_start(monkeypatch, capsys):
    import labkit.launch.local as local

    reserved = iter([3 << 30, 1 << 30])
    emptied = []
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda: next(reserved))
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: emptied.append(True))
    local._free_cached_gpu_memory("cpu")
    assert not emptied  # CPU ranks: nothing to give back
    local._free_cached_gpu_memory("cuda")
    assert emptied and "released 2,048 MiB of this process's cached GPU memory" in capsys.readouterr().out


def test_on_cuda_the_counter_runs_on_the_last_step_only():
    """The counter is a Python dispatch mode over every op: on a GPU it would slow each step it wraps."""
    from labkit.train.probe import counted_steps

    assert counted_steps("auto", torch.device("cuda"), 5) == [False] * 4 + [True]
    assert counted_steps("auto", torch.device("cpu"), 5) == [True] * 5


def test_the_gpu_model_is_named_by_what_it_has():
    from labkit.core.model import GPT, GPTConfig

    p = PROFILES["data_parallel"]["gpu"]
    n = GPT.count_params(GPTConfig(n_layer=p["n_layer"], n_head=p["n_head"], n_embd=p["n_embd"],
                                   block_size=p["block_size"]))
    assert 85.5e6 < n < 86.5e6  # GPT-2 small's shape with a 256-byte vocabulary, not its 124 M
    assert "85.9 M parameters, not GPT-2's 124 M" in " ".join(sys.modules["labkit.labs.profiles"].__doc__.split())


def test_training_needs_no_tqdm_on_a_bare_gpu_image():
    """A GPU image with CUDA torch and little else: without tqdm the loop trains, with no bar."""
    code = ("import sys; sys.modules['tqdm'] = None\n"
            "from labkit.core.model import GPTConfig\nfrom labkit.train import TrainConfig, train\n"
            "r = train(TrainConfig(steps=2, progress=True), GPTConfig(block_size=16))\nprint(len(r['loss']))")
    proc = subprocess.run([sys.executable, "-c", code], env=ENV, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and proc.stdout.strip() == "2", proc.stderr[-2000:]


def test_make_gpu_check_is_the_same_command():
    proc = subprocess.run(["make", "-s", "gpu-check"], capture_output=True, text=True, timeout=120,
                          env={**ENV, "MAKEFLAGS": ""}, cwd=Path(__file__).resolve().parent.parent)
    assert proc.returncode != 0 and "no CUDA GPU is visible" in proc.stderr and "Traceback" not in proc.stderr
