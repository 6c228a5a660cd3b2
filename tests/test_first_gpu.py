"""What a reading of the GPU paths against torch 2.11 predicted for the first GPU user (issue 45), as far as
a CPU can show it: each item's cause, held here, so that the 15 minutes a GPU is lent find none of them.
The combinations of layouts and numerics (item 6) are tests/test_combinations.py; the check's time budget
and the bare-image rehearsal (item 2), tests/test_gpu_check.py."""
from __future__ import annotations

import ast
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from labkit.core.model import GPTConfig
from labkit.course.gpu_items import Setting

ROOT = Path(__file__).resolve().parent.parent


# Item 1: Inductor on CUDA needs Triton, a C compiler and Python.h; without one, the fusion parts and the
# inside_device lab are a skip naming what is missing, not a failure deep in a compile.
def test_torch_compile_without_its_tools_is_a_skip_that_names_them(monkeypatch, tmp_path):
    from labkit.device import fusion
    from labkit.course.gpu_items_device import device
    from labkit.labs.script import LabSkipped, run_script

    monkeypatch.setattr(fusion, "toolchain", lambda: {"c_compiler": "/usr/bin/gcc", "python_headers": True,
                                                       "triton": False})
    assert fusion.compiler_missing("cuda") == ["triton"] and fusion.compiler_missing("cpu") == []
    monkeypatch.setattr(fusion, "toolchain", lambda: {"c_compiler": None, "python_headers": False, "triton": True})
    assert fusion.compiler_missing("cpu") == ["a C compiler (set CC)", "Python.h (the Python development headers)"]
    items = {i.name: i for i in device(Setting("cpu", 2, 2))}
    assert items["device: fusion"].status == "skip", items
    assert items["device: fusion"].detail.startswith("needs a C compiler (set CC), Python.h")
    assert all(i.status == "pass" for n, i in items.items() if n != "device: fusion"), items
    lab = tmp_path / "fuses.md"
    lab.write_text("```{code-cell} ipython3\nfrom labkit.device import fusion\nimport torch\n"
                   "fusion.eager_and_compiled(torch.relu, torch.ones(4))\n```\n")
    with pytest.raises(LabSkipped, match=r"lab 'fuses' needs a C compiler \(set CC\), Python.h .* for torch.compile "
                                         r"on cpu \(cell 0\)"):
        run_script(lab, tmp_path, {}, quiet=True)


# Item 3: on one GPU the FSDP items trained one process without FSDP2 and passed.
def test_on_one_gpu_fsdp2_itself_is_checked_and_nothing_passes_as_fsdp_that_is_not():
    from labkit.course.gpu_items import strategy_configs
    from labkit.course.gpu_items_parallel import fsdp2
    from labkit.train import TrainConfig
    from labkit.train.validate import validate

    configs, skipped = strategy_configs(Setting("cpu", 1, 2))
    assert not configs and "fsdp: needs >= 2 GPUs (on one it runs without a single collective; see the item " \
                              "'fsdp2 alone')" in skipped
    with pytest.raises(ValueError, match=r"fsdp_bf16=True has no effect with one rank: FSDP2 wraps"):
        validate(TrainConfig(strategy="fsdp", fsdp_bf16=True), GPTConfig(), 1)
    (item,) = fsdp2(Setting("cpu", 1, 3))
    f = item.figures
    assert item.status == "pass", item.detail
    assert f["compute_dtype"] == "bfloat16" and f["shard_dtype"] == "float32" and f["dtensors"] and f["dcp_equal"]


# Item 4: the datasheet of the card that is there, scaled to a MIG slice, bandwidth included.
def test_the_datasheet_is_the_variant_s_and_a_mig_slice_is_its_share(monkeypatch):
    from labkit.planning.accelerators import datasheet, from_device_name
    from labkit.train import TrainConfig, instruments

    assert from_device_name("NVIDIA H100 PCIe") == "h100-pcie" and from_device_name("NVIDIA H100 NVL") == "h100-nvl"
    assert from_device_name("NVIDIA H100 80GB HBM3") == "h100-80gb"
    whole = datasheet("NVIDIA H100 80GB HBM3", 132, 85.0)
    assert whole["share"] == 1 and whole["peak_tflops"]["bf16"] == 989 and whole["hbm_tb_per_s"] == 3.35
    mig = datasheet("NVIDIA H100 80GB HBM3 MIG 1g.10gb", 16, 10.0)
    assert mig["peak_tflops"]["bf16"] == pytest.approx(989 * 16 / 132)
    assert mig["hbm_tb_per_s"] == pytest.approx(3.35 / 8)

    class Props:
        multi_processor_count = 114

    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA H100 PCIe")
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device=None: Props())
    peak = instruments._peak_tflops(TrainConfig(precision="bf16"), torch.device("cuda", 0))
    assert peak == 756  # was the SXM's 989: every MFU on a PCIe card read 24% low


# Item 5: torch 2.11's get_backend() returns "cpu:gloo,cuda:nccl" whole for labkit's CUDA groups.
def test_nccl_is_found_in_a_mixed_backend_and_nothing_compares_the_whole_string(monkeypatch):
    import torch.distributed as dist

    from labkit.core.devices import comm_device

    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_backend", lambda group=None: "cpu:gloo,cuda:nccl")
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    assert comm_device() == torch.device("cuda", 0)
    compared = []
    for path in (ROOT / "labkit").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Compare) and isinstance(node.left, ast.Call) and \
                    getattr(node.left.func, "attr", "") == "get_backend":
                compared.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    assert not compared, compared  # the straggler trained on the CPU, preemption polled on gloo


# Item 7: each view of the mesh was a new unflattening of the world: every dimension split three times.
def test_the_mesh_splits_the_world_once_and_cuts_its_views_from_it():
    from combination_fns import groups_made

    from labkit.launch import launch

    # groups a rank joins: one per dimension of fewer ranks than the world, one per view flattened from
    # several (the world's own group serves a view of every rank), HSDP's kept shard of 1. Before: 6, 2,
    # 4, 8, 6, 0, 4, 5.
    want = {"pp2 dp_shard2": (dict(pp=2, dp_shard=2), 2), "dp_shard2 cp2": (dict(dp_shard=2, cp=2), 2),
            "hsdp 2x2": (dict(dp_replicate=2, dp_shard=2), 2), "hsdp 2x1 tp2": (dict(dp_replicate=2, tp=2), 3),
            "tp2 dp_shard2": (dict(tp=2, dp_shard=2), 2), "dp_shard4": (dict(dp_shard=4), 0),
            "pp2 tp2": (dict(pp=2, tp=2), 2), "hsdp 2x1 cp2": (dict(dp_replicate=2, cp=2), 3)}
    made, warned = launch(groups_made, [d for d, _ in want.values()], world_size=4, quiet=True)[0]
    assert dict(zip(want, made)) == {k: n for k, (_, n) in want.items()}
    assert not warned, warned


# Item 8: --gpus all on a MIG GPU, under a scheduler's allocation, in nvidia-smi's order.
def test_the_hub_pool_is_the_allocation_or_the_uuids_mig_slices_included(tmp_path, monkeypatch, capsys):
    from labkit.course.hub import _gpu_pool

    smi = tmp_path / "nvidia-smi"
    smi.write_text("#!/bin/sh\ncat <<'X'\nGPU 0: NVIDIA A100-SXM4-80GB (UUID: GPU-aa-0)\n"
                   "  MIG 1g.10gb     Device  0: (UUID: MIG-aa-1)\n  MIG 1g.10gb     Device  1: (UUID: MIG-aa-2)\n"
                   "GPU 1: NVIDIA A100-SXM4-80GB (UUID: GPU-bb-0)\nX\n")
    smi.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    assert _gpu_pool("all") == ["MIG-aa-1", "MIG-aa-2", "GPU-bb-0"]  # was ["0", "1"]: two whole GPUs
    assert "MIG slices of 10 GB" in capsys.readouterr().err
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2,3")  # Slurm's or Kubernetes' allocation of this node
    assert _gpu_pool("all") == ["2", "3"]


# Item 9: an A100 has no FP8 units and torch._scaled_mm raises there.
def test_without_fp8_units_the_fp8_gemm_is_emulated_and_the_item_skips(monkeypatch):
    from labkit.device import fp8
    from labkit.course.gpu_items_device import _fp8_gemm

    def no_kernel(*args, **kwargs):
        raise RuntimeError("torch._scaled_mm is only supported on CUDA devices with compute capability >= 9.0")

    monkeypatch.setattr(fp8, "scaled_mm_runs", lambda device: False)
    monkeypatch.setattr(torch, "_scaled_mm", no_kernel)
    speed = fp8.gemm_speed(64, "cpu", torch.float32, repeats=1)
    assert speed["fp8_gemm"].startswith("emulated") and speed["fp8_flops_per_s"] > 0
    (item,) = _fp8_gemm("cpu", {"gemm": 64, "dtype": torch.float32})
    assert item.status == "skip" and item.detail.startswith("needs FP8 units (compute capability 8.9 or later")


# Item 2's mechanism: an item or a lab past its seconds is stopped with everything it started.
def test_a_child_past_its_budget_is_stopped_with_what_it_started():
    from labkit.course.gpu_budget import run_apart

    code = ("import subprocess, sys, time\n"
            "p = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(120)'])\n"
            "print(p.pid, flush=True)\ntime.sleep(120)\n")
    t0 = time.monotonic()
    status, out, _ = run_apart([sys.executable, "-c", code], 3)
    assert status is None and time.monotonic() - t0 < 60
    grandchild = int(out.split()[0])
    time.sleep(0.5)
    state = Path(f"/proc/{grandchild}/stat")
    assert not state.exists() or state.read_text().split()[2] == "Z", "the launched rank outlived its item"
    assert subprocess.run([sys.executable, "-c", "print(1)"], capture_output=True).returncode == 0


def test_the_first_gpu_script_is_in_the_runbook_in_under_2000_characters():
    """Issue 45: one prepared script for the first GPU (the machine, a one-rank FSDP2 step with bf16
    parameters, a DCP save and load, _scaled_mm against its emulation, then the check within a budget),
    short enough to paste; its Python parses (on a CPU, with cuda and nccl swapped for cpu and gloo, it ran)."""
    import re

    text = (ROOT / "book" / "clusters_runbook.md").read_text()
    (block,) = [b for b in re.findall(r"```bash\n(.*?)```", text, re.S) if "fully_shard" in b]
    assert len(block) < 2000, len(block)
    ast.parse(block.split("<<'PY'\n", 1)[1].split("\nPY\n", 1)[0])
    for part in ("torch.cuda.nccl.version()", "multi_processor_count", "MixedPrecisionPolicy(torch.bfloat16",
                 "dcp.save", "dcp.load", "torch._scaled_mm", "get_device_capability() >= (8, 9)"):
        assert part in block, part
    assert re.search(r"^python3 -m labkit\.gpu_check --gpus 1 --budget (\d+)$", block, re.M)
