"""What machine ``make gpu-check`` runs on, as its first lines say it in one screen (and its item
``environment``).

torch, CUDA, NCCL and Python; each GPU's name, SMs, memory, compute capability and MIG mode, and the
datasheet peaks labkit reads for it (:func:`labkit.planning.accelerators.datasheet`, scaled to a MIG
slice's share); what ``torch.compile`` needs (Triton, a C compiler, Python.h); which optional
packages are absent and what that leaves out. A GPU lent for minutes is worth knowing before any
item spends them.
"""
from __future__ import annotations

import platform
import shutil
import subprocess
from typing import Any

from labkit.course.gpu_items import OPTIONAL, Item, Setting, _version


def _mig_modes() -> list[str]:
    """``nvidia-smi``'s MIG mode per GPU (its PCI order), or [] where it cannot say."""
    if not shutil.which("nvidia-smi"):
        return []
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=mig.mode.current", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.TimeoutExpired):
        return []
    return [line.strip() for line in out.stdout.splitlines() if line.strip()] if out.returncode == 0 else []


def gpus() -> list[dict[str, Any]]:
    """Every visible GPU: name, SMs, memory, compute capability, MIG, and labkit's datasheet for it."""
    import torch

    from labkit.planning.accelerators import datasheet

    if not torch.cuda.is_available():
        return []
    modes = _mig_modes()
    out = []
    for i in range(torch.cuda.device_count()):
        p = torch.cuda.get_device_properties(i)
        name = torch.cuda.get_device_name(i)
        # a MIG slice's name carries its profile; nvidia-smi's mode names the parent's (its order is PCI's)
        whole = modes[i] if len(modes) == torch.cuda.device_count() else None
        mig = "a MIG slice" if "MIG" in name.upper() else whole
        out.append({"name": name, "memory_gib": round(p.total_memory / 2**30, 1), "sms": p.multi_processor_count,
                    "capability": f"{p.major}.{p.minor}", "mig": mig,
                    "datasheet": datasheet(name, p.multi_processor_count, p.total_memory / 1e9)})
    return out


def facts() -> dict[str, Any]:
    """Everything the header says, as the environment item's figures."""
    import torch

    from labkit.device.fusion import toolchain

    cuda = torch.cuda.is_available()
    nccl = ".".join(map(str, torch.cuda.nccl.version())) if cuda and hasattr(torch.cuda, "nccl") else None
    return {"python": platform.python_version(), "torch": torch.__version__, "cuda": torch.version.cuda,
            "nccl": nccl, "cudnn": torch.backends.cudnn.version() if cuda else None, "gpus": gpus(),
            "packages": {p: _version(p) for p in OPTIONAL}, "platform": platform.platform(),
            "triton_version": _version("triton"), **toolchain()}


def header(f: dict[str, Any]) -> list[str]:
    """The machine in a few lines (a screen at most: identical GPUs are one line)."""
    lines = [f"torch {f['torch']}, CUDA {f['cuda'] or 'none (a CPU build)'}, NCCL {f['nccl'] or '-'}, "
             f"cuDNN {f['cudnn'] or '-'}, Python {f['python']}"]
    seen: dict[str, list[int]] = {}
    for i, g in enumerate(f["gpus"]):
        seen.setdefault(repr(g), []).append(i)
    for idx in seen.values():
        g = f["gpus"][idx[0]]
        where = f"GPU {idx[0]}" if len(idx) == 1 else f"GPUs {idx[0]}-{idx[-1]} ({len(idx)} x)"
        line = (f"{where}: {g['name']}, {g['sms']} SMs, {g['memory_gib']} GiB, compute {g['capability']}, MIG "
                f"{g['mig'] or 'unknown'}")
        d = g["datasheet"]
        if d:
            p, share = d["peak_tflops"], (f", {d['share']:.0%} of the card" if d["share"] < 1 else "")
            line += (f"; datasheet ({d['key']}{share}): dense bf16 {p['bf16']:,.0f}, tf32 {p['tf32']:,.0f}, fp32 "
                     f"{p['fp32']:,.0f} TFLOP/s, HBM {d['hbm_tb_per_s']:.2f} TB/s")
        else:
            line += "; not in labkit's datasheet table: no MFU (pass --peak-tflops to train)"
        lines.append(line)
    if not f["gpus"]:
        lines.append("no CUDA GPU visible: CPU processes stand in (the speeds mean nothing)")
    have = {"triton": f["triton_version"] or "absent", "C compiler": f["c_compiler"] or "absent",
            "Python.h": "present" if f["python_headers"] else "absent"}
    lines.append("torch.compile needs: " + ", ".join(f"{k} {v}" for k, v in have.items()))
    absent = [p for p, v in f["packages"].items() if v is None]
    if absent:
        lines.append(f"absent: {', '.join(absent)}" + ("; labs run as scripts" if "papermill" in absent else "")
                     + ("; figures not drawn" if "matplotlib" in absent else ""))
    return lines


def environment(s: Setting) -> list[Item]:
    """The check's item ``environment``: the machine, a failure only where the check asks for CUDA and
    there is none; what torch.compile or a lab lacks is said here and skipped by the item that needs it."""
    import torch

    from labkit.device.fusion import compiler_missing

    figs = facts()
    gpus, cuda = figs["gpus"], torch.cuda.is_available()
    missing = [p for p, v in figs["packages"].items() if v is None]
    where = (f"{len(gpus)} x {gpus[0]['name']}" if gpus else "no GPU") + f", torch {torch.__version__}"
    where += f", CUDA {torch.version.cuda}, NCCL {figs['nccl']}" if cuda else f" ({s.device} check)"
    lacks = compiler_missing(s.device)
    return [Item("environment", "pass" if cuda or s.device == "cpu" else "fail",
                 where + (f"; not installed: {', '.join(missing)}" if missing else "")
                 + (f"; torch.compile lacks {', '.join(lacks)} (the fusion parts skip)" if lacks else ""), figs)]
