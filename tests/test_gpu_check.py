"""The GPU side, as far as a CPU can show it: gpu profiles fitted to 1-8 GPUs, `make gpu-check` and its
items run on CPU processes, labs run as plain scripts where no Jupyter exists."""
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from labkit.labs import PROFILES, list_labs, resolve
from labkit.labs.cli import main as labs_main
from labkit.course.gpu_check import _guarded
from labkit.course.gpu_items import Setting, strategy_configs
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
    code = "import sys; sys.modules['torch'] = None\nfrom labkit.course.gpu_check import main\nsys.exit(main([]))"
    proc = subprocess.run([sys.executable, "-c", code], env=ENV, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    assert proc.stderr.count("\n") == 1 and "has no PyTorch" in proc.stderr


def test_missing_packages_skip_with_their_name(monkeypatch):
    import labkit.course.gpu_items as items

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


def test_a_lab_that_needs_a_missing_package_is_a_skip_and_a_failure_keeps_why(tmp_path):
    """Issue 27, items 2 and 8: LabSkipped (a RuntimeError) was reported as FAIL; a failure on a rank
    kept only "1 rank(s) failed: [0]"."""
    from labkit.course.gpu_check import report
    from labkit.labs.script import LabSkipped
    from labkit.launch import RankError

    def lab_needs_pandas():
        raise LabSkipped("lab 'memory' needs the package 'pandas', which is not installed (cell 1)")

    tb = ("Traceback (most recent call last):\n  File \"x.py\", line 3, in step\n    stage(...)\n"
          "TypeError: PipelineStage.__init__() got an unexpected keyword argument 'output_grads'\n")

    def rank_fails():
        raise RankError({0: tb, 1: "rank 1 was stopped 5.0 s after rank 0 failed"})

    (skip,), (fail,) = _guarded("lab memory", lab_needs_pandas), _guarded("strategies", rank_fails)
    assert skip.status == "skip" and "'pandas'" in skip.detail
    assert fail.status == "fail"
    assert fail.detail == "rank 0: TypeError: PipelineStage.__init__() got an unexpected keyword argument 'output_grads'"
    assert "output_grads" in fail.error and "Traceback" in fail.error and "RankError" in fail.error
    js, md = report([skip, fail], Setting("cpu", 2, 2), tmp_path)
    saved = json.loads(js.read_text())["items"]
    assert saved[1]["error"] == fail.error and "| strategies | FAIL | rank 0: TypeError" in md.read_text()
    env = items_environment()
    assert {"cloudpickle", "xxhash", "pandas", "matplotlib", "nbformat", "peft"} <= set(env.figures["packages"])


def items_environment():
    from labkit.course.gpu_machine import environment

    (env,) = environment(Setting("cpu", 2, 2))
    return env


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


def test_the_data_parallel_lab_reads_collective_counts_as_cuda_records_them():
    """Issue 27, item 4: on CUDA only the last step is counted (the others hold None), and the lab took
    np.median and .min() over the whole lists: a TypeError on any GPU run, which CPU runs never show."""
    import numpy as np

    from labkit.labs import LABS_DIR
    from labkit.labs.script import cells
    from labkit.train.probe import counted

    def run(calls: int, nbytes: int) -> dict:  # as a CUDA run records it: None but the last step
        return {"loss": [1.0, 0.9, 0.8], "grad_bytes": nbytes,
                "ranks": [{"allreduce_calls_per_step": [None, None, calls],
                           "allreduce_bytes_per_step": [None, None, nbytes]}]}

    sources = [c for c, _ in cells(LABS_DIR / "data_parallel.md")]
    src = next(c for c in sources if "def calls(run)" in c)
    ns = {"np": np, "counted": counted, "ref": run(0, 0), "ddp": run(1, 400),
          "hand_runs": [run(5, 400), run(2, 400)], "loss_ddp": np.array([1.0, 0.9, 0.8])}
    exec(compile(src, "data_parallel.md", "exec"), ns)  # the lab's own cell
    assert [ns["calls"](ns["runs"][s]) for s in ("ddp", "dp_naive", "dp_bucketed")] == [1, 5, 2]
    per_step = next(c for c in sources if "allreduce_bytes_per_step" in c and "per_step = " in c)
    assert 'counted(runs[s]["ranks"][0]["allreduce_bytes_per_step"])' in per_step
    with pytest.raises(ValueError, match="no step of this run was counted"):
        counted([None, None])


def _without(where: Path, *packages: str) -> dict:
    """An environment in which every Python started (the check, its items' processes, their ranks) finds
    ``packages`` missing: a sitecustomize on PYTHONPATH takes them away at start-up."""
    where.mkdir()
    (where / "sitecustomize.py").write_text("import sys\n" + "".join(f"sys.modules[{p!r}] = None\n" for p in packages))
    return {**ENV, "PYTHONPATH": str(where)}


def test_without_numpy_the_check_still_trains_and_writes_its_report(tmp_path):
    """Issue 27, item 12: the RNG capture imported numpy at module level, so a Python without it lost
    the whole check before any report. Without numpy there is no NumPy generator to save. (One process
    trains: torch's own object collectives, 2.11's as 2.13's, turn bytes back into objects through
    ``tensor.numpy()``, so ranks need numpy, which the GPU image has.)"""
    proc = subprocess.run([sys.executable, "-m", "labkit.gpu_check", "--device", "cpu", "--only",
                           "environment,speed", "--steps", "2", "--out",
                           str(tmp_path / "out")], env=_without(tmp_path / "site", "numpy"), capture_output=True,
                          text=True, timeout=300, cwd=Path(__file__).resolve().parent.parent)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads((tmp_path / "out" / "gpu_check.json").read_text())
    env = next(i for i in report["items"] if i["name"] == "environment")
    assert env["figures"]["packages"]["numpy"] is None and "not installed: numpy" in env["detail"]
    assert report["counts"] == {"pass": 3, "fail": 0, "skip": 0, "over": 0}  # the environment; speed and memory


def test_what_the_check_starts_can_import_labkit_from_an_uninstalled_checkout(tmp_path):
    """Issue 27, item 7: `python3 -m labkit.gpu_check` from a checkout finds labkit in its working
    directory, but torchrun's workers and a lab's child processes did not: PYTHONPATH now names it."""
    code = ("import os\n"
            "from labkit.course.gpu_check import main\n"
            f"main(['--device', 'cpu', '--only', 'environment', '--out', {str(tmp_path)!r}])\n"
            "print(os.environ['PYTHONPATH'].split(os.pathsep)[0])\n")
    proc = subprocess.run([sys.executable, "-c", code], env={**ENV, "PYTHONPATH": "/elsewhere"}, cwd=tmp_path,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    root = str(Path(__file__).resolve().parent.parent)
    assert proc.stdout.strip().splitlines()[-1] == root
    child = subprocess.run([sys.executable, "-c", "import labkit, sys; print(labkit.__file__)"],
                           env={"PATH": os.environ["PATH"], "PYTHONPATH": root}, cwd=tmp_path,
                           capture_output=True, text=True, timeout=60)
    assert child.returncode == 0 and child.stdout.startswith(root), child.stderr


def test_on_one_gpu_what_needs_two_is_a_skip_not_a_pass():
    """Issue 27, item 11: at world size 1, ddp, tp, cp, the hand-written strategies and the context
    item passed without a single collective: PASS lines that tested nothing."""
    from labkit.course.gpu_items_parallel import context, experts

    configs, skipped = strategy_configs(Setting("cpu", 1, 2))  # the rule is the same on CUDA
    assert not configs  # fsdp too: labkit trains one rank without FSDP2 (issue 45, item 3: the item "fsdp2")
    needs_two = {line.split(":")[0] for line in skipped if "needs >= 2 GPUs" in line}
    assert {"ddp", "dp_naive", "dp_bucketed", "zero1_scratch", "tp", "tp_scratch", "cp", "pp", "fsdp"} <= needs_two
    for item in (*context(Setting("cpu", 1, 2)), *experts(Setting("cpu", 1, 2))):
        assert item.status == "skip" and "needs >= 2 GPUs" in item.detail


def test_a_lab_that_needs_deepspeed_says_so_at_once_and_is_a_skip(tmp_path, monkeypatch):
    """Issue 27, item 3: the zero_fsdp lab launched DeepSpeed's strategies where DeepSpeed is absent and
    failed in its ranks; it now stops at its first cell naming the package, a skip as a script or in
    papermill."""
    import importlib.util

    from labkit.labs import LABS_DIR, require
    from labkit.labs.script import LabSkipped, run_script

    assert 'require("deepspeed")' in (LABS_DIR / "zero_fsdp.md").read_text()
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "deepspeed" else real(name, *a))
    with pytest.raises(ModuleNotFoundError, match="needs the package 'deepspeed'"):
        require("deepspeed")
    with pytest.raises(LabSkipped, match="'deepspeed'"):
        run_script(LABS_DIR / "zero_fsdp.md", tmp_path, {"PROFILE": "ci"}, quiet=True)

    class PapermillError(Exception):  # what papermill raises for a failed cell: ename and evalue
        ename, evalue = "ModuleNotFoundError", "this lab needs the package 'deepspeed', which is not installed"

    def lab():
        raise PapermillError("cell failed")

    (item,) = _guarded("lab zero_fsdp", lab)
    assert item.status == "skip" and item.detail == PapermillError.evalue


def test_the_packing_lab_leaves_trl_out_where_it_is_not_installed(monkeypatch):
    """Issue 27, item 6: the packing lab ran its benchmark with TRL, which the GPU image lacks."""
    import importlib.util
    import json as json_mod
    from pathlib import Path as P_

    import matplotlib
    import numpy as np

    from labkit.labs import LABS_DIR, ROOT
    from labkit.labs.script import cells

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "trl" else real(name, *a))
    src = next(c for c, _ in cells(LABS_DIR / "packing.md") if "bench_packing.py" in c)
    from labkit.labs.columns import fit

    ns = {"ROOT": ROOT, "P": {"bench_n": 3000}, "json": json_mod, "Path": P_, "plt": plt, "np": np, "fit": fit}
    exec(compile(src, "packing.md", "exec"), ns)  # the lab's own cell, TRL missing
    assert not ns["has_trl"] and "--no-trl" in ns["cmd"]
    assert "labkit bfd" in ns["bench"] and not any(k.startswith("trl") for k in ns["bench"])
    plt.close("all")


def test_each_lab_runs_in_a_process_of_its_own_and_a_failure_says_why(tmp_path):
    """Issue 27, item 9: labs ran inside the check's process and inherited its state (deterministic
    mode, the recorded values, earlier labs' GPU tensors). The bare-image rehearsal below runs every
    lab this way; here, what a lab's failure reports."""
    from labkit.course.gpu_check import LabFailed, cause, run_lab_apart

    with pytest.raises(LabFailed) as e:
        run_lab_apart("strategy_cost", "ci", tmp_path, {"stepz": 3}, True, None)
    short, whole = cause(e.value)
    assert short.startswith("LabFailed: ValueError: OVERRIDES has unknown keys ['stepz']"), short
    assert "Traceback" in whole


def test_cublas_workspaces_are_released_before_the_allocator_is_read(monkeypatch):
    """Issue 27, item 10: "memory within 5% of the calculator" counted cuBLAS's workspaces (about 64 MiB
    with two handles), which put GPT-2 small at 4.9% off: one more workspace would fail it."""
    from labkit.train import instruments

    calls = []
    monkeypatch.setattr(torch._C, "_cuda_clearCublasWorkspaces", lambda: calls.append("clear"), raising=False)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: calls.append("sync"))
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device=None: calls.append("read") or 123)
    assert instruments.allocated(torch.device("cuda", 0)) == 123
    assert calls == ["sync", "clear", "read"]
    assert instruments.allocated(torch.device("cpu")) is None


def test_the_check_keeps_to_its_budget_and_says_what_it_did_not_run(tmp_path, monkeypatch):
    """Issue 45, item 2: labs ran one after another with no timeout, the ones needing more GPUs ran their
    cpu profile on CPU processes, and a report of skips said "passed or skipped". Now a lab past its
    seconds is OVER (stopped, its ranks too), one needing more GPUs a SKIP naming how many, one the
    budget has no time for a SKIP saying so, and the summary counts the labs that ran their code."""
    from labkit.course import gpu_budget
    from labkit.course.gpu_budget import Budget
    from labkit.course.gpu_check import summary
    from labkit.course.gpu_labs import lab_items

    monkeypatch.setattr(gpu_budget, "FULL_S", 1.0)  # less than a Python with torch takes to start
    (over,) = lab_items(Setting("cpu", 2, 2), ["strategy_cost"], "ci", tmp_path, True, Budget(None))
    assert over.status == "over" and over.detail == "ran past its 1 s and was stopped"
    (fewer,) = lab_items(Setting("cuda", 1, 2), ["composing"], "gpu", tmp_path, True, Budget(None))
    assert fewer.status == "skip" and fewer.detail == "needs 2 GPUs and this machine has 1"
    (late,) = lab_items(Setting("cpu", 2, 2), ["memory"], "ci", tmp_path, True, Budget(10.0))
    assert late.status == "skip" and late.detail.startswith("not run: the check's 10 s budget is spent")
    assert summary([over, fewer, late]) == ("0 passed, 0 failed, 1 over their time budget, 2 skipped; 0 of 3 labs "
                                            "ran their code")


def _bare_environment(where: Path) -> Path:
    """A Python that has what the GPU image has (NOTES.md): torch with what it requires, and numpy;
    nothing else from requirements.txt, and no labkit installed. Its site-packages links to this
    environment's copies of those distributions, so it takes seconds, not a torch install."""
    import importlib.metadata as md
    import re
    import venv

    venv.create(where, with_pip=False)
    site = next(where.glob("lib/python*/site-packages"))
    wanted, seen = ["torch", "numpy"], set()
    while wanted:
        name = wanted.pop()
        if name.lower() in seen:
            continue
        seen.add(name.lower())
        dist = md.distribution(name)
        wanted += [re.split(r"[ ;<>=!~\[]", r)[0] for r in dist.requires or [] if "extra ==" not in r]
        for top in {Path(str(f)).parts[0] for f in dist.files or [] if not str(f).startswith("..")}:
            src = Path(str(dist.locate_file(top)))
            if src.exists() and not (site / top).exists():
                (site / top).symlink_to(src)
    return where / "bin" / "python"


# The labs the CPU rehearsal runs as scripts: two that draw figures, one that needs pandas. All 16 ran
# their ci profiles again, 8 of the suite's 30 minutes of worker time, which the book's build already
# spends on them; a GPU's `make gpu-check` runs every lab.
BARE_LABS = ("memory", "activation_checkpointing", "strategy_cost")


def _the_items_check_what_they_name(report: dict, markdown: str) -> None:
    """The same items a GPU node runs, on two gloo ranks: a check of the check. Every strategy trains
    as one process does and carries its speed keys (the strategies item fails a run that lacks one);
    what the chapter "Inside one device" measures is there without a plotting library: roofs, block
    ops, the FP8 GEMM, FlashAttention, then the compiles (the slow part) last."""
    items = {i["name"]: i for i in report["items"]}
    assert {n[9:] for n in items if n.startswith("strategy ")} == set(STRATEGIES) - {"single"}
    deepspeed = {s for s in STRATEGIES
                 if items.get(f"strategy {s}", {}).get("detail") == "needs the package 'deepspeed'"}
    assert deepspeed == {"zero1", "zero2", "zero3"}  # the image has no DeepSpeed: tests/test_train.py runs them
    strategies = [s for s in STRATEGIES if s not in ("single", "ep", *deepspeed)]  # ep: the experts item
    assert items["strategy ep"]["status"] == "skip" and items["experts: ep against one process"]["status"] == "pass"
    assert all(items[f"strategy {s}"]["status"] == "pass" for s in strategies)
    assert all(items[f"strategy {s}"]["figures"]["max_loss_dev"] < 1e-5 for s in strategies)
    assert all(items[f"strategy {s}"]["figures"]["tokens_per_s"] > 0 for s in strategies)
    assert items["determinism"]["figures"]["rerun_equal"] and items["determinism"]["figures"]["resume_equal"]
    assert "| strategy tp | PASS |" in markdown
    device = [n for n in items if n.startswith("device: ")]
    assert device == ["device: roofs", "device: block ops", "device: FP8 GEMM", "device: FlashAttention",
                      "device: fusion, chain", "device: fusion, block"]
    assert all(items[n]["status"] == "pass" for n in device), [items[n] for n in device]
    chain = items["device: fusion, chain"]["figures"]
    assert chain["compiled_kernels"] == 1 and chain["eager_kernels"] == 8 and chain["graph_s"] is None
    assert items["device: FP8 GEMM"]["figures"]["fp8_units"] is False
    flash = items["device: FlashAttention"]["figures"]
    assert flash["saved_bytes"] == flash["sdpa_saved_bytes"] and flash["max_err"] < 1e-4


def test_the_check_on_a_bare_image_runs_every_item_and_lab_within_its_budget(tmp_path):
    """Issues 27 and 45: torch and numpy only, labkit from the checkout (not installed), `python3 -m
    labkit.gpu_check` as the GPU image runs it: every item PASS, or SKIP naming the missing package or
    what it needs; each lab's cells run as a script and record their measurements with the figures
    not drawn (and say so), or the lab is a SKIP naming the package its measurements need (pandas,
    DeepSpeed); nothing over a time budget, and the whole within the budget the check states. Before,
    without matplotlib every lab was a SKIP and the report said "passed or skipped". (CPU processes
    stand in for the GPUs: its speeds mean nothing.)"""
    from labkit.labs import LABS_DIR

    python = _bare_environment(tmp_path / "bare")
    probe = subprocess.run([str(python), "-c", "import torch, numpy\ntry:\n import matplotlib\nexcept ImportError:\n"
                            " print('bare')"], capture_output=True, text=True, cwd=tmp_path)
    assert probe.stdout.strip() == "bare", probe.stderr  # the environment really lacks what the image lacks
    env = {k: v for k, v in ENV.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    root = Path(__file__).resolve().parent.parent
    proc = subprocess.run([str(python), "-m", "labkit.gpu_check", "--device", "cpu", "--steps", "2", "--as-script",
                           "--labs", ",".join(BARE_LABS), "--out", str(tmp_path / "out")], env=env, cwd=root,
                          capture_output=True, text=True, timeout=1500)
    report = json.loads((tmp_path / "out" / "gpu_check.json").read_text())
    bad = [(i["name"], i["status"], i["detail"]) for i in report["items"] if i["status"] in ("fail", "over")]
    assert proc.returncode == 0 and not bad, (bad, proc.stderr[-3000:])
    from labkit.course.gpu_budget import TOTAL_S

    assert report["seconds"] <= report["budget"] == TOTAL_S["cpu"], (report["seconds"], report["budget"])
    allowed = ("needs the package", "needs CUDA", "needs >= 2 GPUs", "see the item")
    for item in report["items"]:
        if item["status"] == "skip":
            assert any(a in item["detail"] for a in allowed), item
    names = {i["name"] for i in report["items"]}
    assert {"environment", "strategy ddp", "strategy fsdp", "strategy pp", "fsdp2 alone", "speed",
            "determinism", "device: fusion, chain"} <= names
    _the_items_check_what_they_name(report, (tmp_path / "out" / "gpu_check.md").read_text())
    labs = {i["name"][4:]: i for i in report["items"] if i["name"].startswith("lab ")}
    assert set(labs) == set(BARE_LABS)
    # a lab skips only for a package its measurements compute with: pandas' tables, DeepSpeed's engines
    needs = {n for n in labs if re.search(r"^import pandas|require\(\"deepspeed\"\)",
                                          (LABS_DIR / f"{n}.md").read_text(), re.M)}
    assert {n for n, i in labs.items() if i["status"] == "skip"} == needs, labs
    for name in set(labs) - needs:
        metrics = json.loads((tmp_path / "out" / "labs" / f"{name}.metrics.json").read_text())
        assert "figures: not drawn: matplotlib is not installed" in metrics["environment"]["left_out"], name
        assert "left out: figures: not drawn" in labs[name]["detail"] and metrics["recorded"], name
    assert f"; {len(labs) - len(needs)} of {len(labs)} labs ran their code" in report["summary"]
    # A lab run as a script (no Jupyter on the machine) records what papermill records: every exact
    # metric is its baseline's, which papermill recorded (timings may move, figures are left out).
    from labkit.labs.compare import compare

    def held(path: Path) -> dict:
        return {k: v for k, v in json.loads(path.read_text()).items() if k != "environment"}

    for name in set(labs) - needs:
        ran = compare({name: held(LABS_DIR / "baseline" / "ci" / f"{name}.metrics.json")},
                      {name: held(tmp_path / "out" / "labs" / f"{name}.metrics.json")})
        assert ran.held[name] > 50 and not ran.regressed, [c for c in ran.changes if c.regression]
        assert f"wrote {name}.metrics.json" in (tmp_path / "out" / "labs" / f"{name}.log").read_text()


def test_pipelines_build_their_stages_where_torch_has_no_output_grads_argument():
    """Issue 27, item 1: torch 2.11's PipelineStage takes no output_grads / input_grads; the stages are
    built by asking its signature, not the version string."""
    from tp_pp_fns import pp_on_torch_2_11_stages

    from labkit.core.model import GPTConfig
    from labkit.launch import launch
    from labkit.train import TrainConfig, train

    model = GPTConfig(n_layer=2, n_head=2, n_embd=32, block_size=16)
    cfg = TrainConfig(steps=2, batch_size=8, seed=0, count_comm="none")
    ref = train(cfg, model)
    run = launch(pp_on_torch_2_11_stages, TrainConfig(steps=2, batch_size=8, seed=0, count_comm="none",
                                                      strategy="pp", pp=2, microbatches=2), model, world_size=2,
                 quiet=True)[0]
    assert max(abs(a - b) for a, b in zip(run["loss"], ref["loss"])) < 1e-5


def test_the_comm_bench_falls_back_to_the_collective_names_torch_2_11_has():
    from rank_fns import bench_without_2_13_collective_names

    from labkit.launch import launch

    assert launch(bench_without_2_13_collective_names, world_size=2, quiet=True) == [["all_gather", "reduce_scatter"]] * 2
