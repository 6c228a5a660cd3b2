"""``python3 -m labkit.gpu_check`` (``make gpu-check``): does this GPU node or hub image run the course?

One command for an instructor on a fresh GPU machine. It checks the environment, runs every strategy
on the node's GPUs against one process, the precision paths, the speed (MFU) of the GPT at GPT-2
small's shape in bf16 with its memory against the calculator, what one device does (its roofs,
fusion, FP8 GEMMs, FlashAttention: :mod:`labkit.labs.gpu_items_device`), and every lab's ``gpu`` profile
trimmed to a few steps (:data:`labkit.labs.profiles.GPU_CHECK`); it prints one pass/fail/skip line
per item and writes ``gpu_check.json`` and ``gpu_check.md`` into ``--out``.

It runs on any torch from 2.11 on, without ``.venv``: a package an item needs and the machine
lacks (DeepSpeed, papermill, ...) skips that item with the package's name; labs run through
papermill where it exists and as plain scripts (:mod:`labkit.labs.script`) where it does not. On a
machine without CUDA it says so in one sentence and exits 2; ``--device cpu`` runs the same items
on CPU processes over gloo, to check the check itself (its speeds mean nothing).
"""
from __future__ import annotations

import json
import subprocess
import sys
import time
import traceback
from dataclasses import asdict
from pathlib import Path
from typing import Callable

from labkit.core.checks import output_dir, positive_int
from labkit.core.cli import ArgumentParser
from labkit.labs import gpu_items, gpu_items_device, gpu_items_parallel
from labkit.labs.gpu_items import Item, Setting, has, log
from labkit.labs.profiles import GPU_CHECK
from labkit.labs.runner import ROOT, list_labs
from labkit.labs.script import LabSkipped

ITEMS = ("environment", "strategies", "context", "experts", "precision", "speed", "device", "determinism", "labs")
STATUS = {"pass": "PASS", "fail": "FAIL", "skip": "SKIP"}


def cause(e: BaseException) -> tuple[str, str]:
    """A failure's short cause (one line, for the markdown) and its whole error (for the JSON): for ranks
    that failed, the first failing rank's last traceback line, not "1 rank(s) failed"."""
    from labkit.launch import RankError

    whole = "".join(traceback.format_exception(type(e), e, e.__traceback__))
    if isinstance(e, RankError) and e.failures:
        rank, tb = min(e.failures.items())
        lines = [ln.strip() for ln in tb.strip().splitlines() if ln.strip()]
        short = f"rank {rank}: {lines[-1] if lines else 'no traceback'}"
        whole = f"{whole}\n--- rank {rank}, last lines ---\n" + "\n".join(tb.strip().splitlines()[-15:])
    elif getattr(e, "ename", None):  # papermill's error from a lab's cell
        value = str(getattr(e, "evalue", "") or "").strip().splitlines()
        short = f"{e.ename}: {value[0] if value else ''}"
    else:
        lines = [ln for ln in str(e).strip().splitlines() if ln.strip()]
        short = f"{type(e).__name__}: {lines[0] if lines else ''}"
    return short[:400], whole[-20000:]


def _guarded(name: str, fn: Callable[[], list[Item]]) -> list[Item]:
    """Run one item; a missing package is a skip naming it, any other error a failure with its cause
    in one line and the whole error kept for the JSON report."""
    t0 = time.perf_counter()
    try:
        items = fn()
    except ModuleNotFoundError as e:
        items = [Item(name, "skip", f"needs the package {e.name!r}, which is not installed")]
    except LabSkipped as e:
        items = [Item(name, "skip", str(e))]
    except Exception as e:  # noqa: BLE001 - the report says what failed and goes on to the next item
        short, whole = cause(e)
        if getattr(e, "ename", None) == "ModuleNotFoundError":  # papermill's: a lab's cell lacked a package
            items = [Item(name, "skip", short.split(": ", 1)[-1])]
        else:
            items = [Item(name, "fail", short, error=whole)]
    seconds = time.perf_counter() - t0
    for it in items:
        it.seconds = it.seconds or seconds / len(items)
        log(f"{STATUS[it.status]} {it.name}: {it.detail}")
    return items


# A lab in a process of its own: nothing it leaves (deterministic mode, recorded values, GPU tensors
# until the next collection) reaches the next lab. Exit status 3: it needs a package that is missing.
_CHILD = """
import json, pathlib, sys
from labkit.labs.runner import run_lab
from labkit.labs.script import LabSkipped
kw = json.loads(sys.argv[1])
kw["out_dir"] = pathlib.Path(kw["out_dir"])
try:
    print(run_lab(**kw))
except LabSkipped as e:
    sys.exit(print(e, file=sys.stderr) or 3)
except ModuleNotFoundError as e:
    sys.exit(print(f"needs the package {e.name!r}, which is not installed", file=sys.stderr) or 3)
except Exception as e:
    if getattr(e, "ename", None) != "ModuleNotFoundError":
        raise
    sys.exit(print(getattr(e, "evalue", e), file=sys.stderr) or 3)
"""


class LabFailed(RuntimeError):
    """A lab's process failed: the message's first line is its error, then the end of what it printed."""


def run_lab_apart(name: str, profile: str, out: Path, overrides: dict, as_script: bool, gpus: int | None) -> Path:
    """:func:`labkit.labs.runner.run_lab` in a new Python process; the path of the metrics it wrote."""
    kw = dict(name=name, profile=profile, out_dir=str(out), force=True, overrides=overrides, as_script=as_script,
              gpus=gpus, quiet=True)
    proc = subprocess.run([sys.executable, "-c", _CHILD, json.dumps(kw)], capture_output=True, text=True)
    err = [ln for ln in proc.stderr.strip().splitlines() if ln.strip()]
    if proc.returncode == 3:
        raise LabSkipped(err[-1] if err else f"lab {name!r} needs a package that is not installed")
    if proc.returncode:
        tail = "\n".join(err[-40:])
        raise LabFailed(f"{err[-1] if err else f'exit status {proc.returncode}'}\n{tail}")
    return Path(proc.stdout.strip().splitlines()[-1])


def lab_items(s: Setting, labs: list[str], profile: str, out: Path, as_script: bool = False) -> list[Item]:
    """Every lab under ``profile`` (trimmed for the check when it is ``gpu``), one item each."""
    notebook = not as_script and has("papermill") and has("jupytext") and has("ipykernel")
    items = []
    for name in labs:
        overrides = GPU_CHECK.get(name, {}) if profile == "gpu" else {}
        how = "papermill" if notebook else "as a script"

        def run(name=name, overrides=overrides) -> list[Item]:
            path = run_lab_apart(name, profile, out, overrides, not notebook, s.world if profile == "gpu" else None)
            return [Item(f"lab {name}", "pass", f"{profile} profile{' (trimmed)' if overrides else ''}, {how}: "
                         f"metrics in {path}")]

        items += _guarded(f"lab {name}", run)
    return items


def report(items: list[Item], s: Setting, out: Path) -> tuple[Path, Path]:
    """``gpu_check.json`` (every figure) and ``gpu_check.md`` (a table a person reads)."""
    out.mkdir(parents=True, exist_ok=True)
    counts = {k: sum(i.status == k for i in items) for k in STATUS}
    data = {"setting": asdict(s), "counts": counts, "items": [asdict(i) for i in items]}
    js = out / "gpu_check.json"
    js.write_text(json.dumps(data, indent=1, default=str))
    env = next((i.figures for i in items if i.name == "environment"), {})
    lines = ["# GPU check", "", f"{counts['pass']} passed, {counts['fail']} failed, {counts['skip']} skipped "
             f"on {s.world} {s.device} rank(s).", ""]
    if env:
        gpus = ", ".join(g["name"] for g in env.get("gpus", [])) or "none"
        lines += [f"torch {env.get('torch')}, CUDA {env.get('cuda')}, NCCL {env.get('nccl')}, Python "
                  f"{env.get('python')}; GPUs: {gpus}", ""]
    lines += ["| item | result | detail | s |", "|---|---|---|---:|"]
    lines += [f"| {i.name} | {STATUS[i.status]} | {i.detail.replace('|', '/')} | {i.seconds:.0f} |" for i in items]
    md = out / "gpu_check.md"
    md.write_text("\n".join(lines) + "\n")
    return js, md


def _parser() -> ArgumentParser:
    ap = ArgumentParser(prog="python -m labkit.gpu_check", description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda", choices=("cuda", "cpu"),
                    help="cuda (the check); cpu: the same items on CPU processes, to test the check itself")
    ap.add_argument("--gpus", type=int, default=None, help="ranks to use (default: every GPU; 2 with --device cpu)")
    ap.add_argument("--only", default=",".join(ITEMS), help=f"comma-separated items to run, of {list(ITEMS)}")
    ap.add_argument("--strategies", default=None, help="comma-separated strategies (default: every strategy)")
    ap.add_argument("--labs", default=None, help="comma-separated labs (default: every lab)")
    ap.add_argument("--profile", default=None, help="lab profile (default: gpu, trimmed; ci with --device cpu)")
    ap.add_argument("--steps", type=int, default=None, help="steps per strategy run (default: 6 on GPU, 4 on CPU)")
    ap.add_argument("--as-script", action="store_true", help="run the labs as plain scripts even where papermill "
                    "exists (what a machine without Jupyter does)")
    ap.add_argument("--out", type=Path, default=ROOT / "_build" / "gpu_check", help="where the reports go")
    return ap


def _setting(ap: ArgumentParser, args) -> tuple[Setting, list[str], list[str]]:
    try:
        import torch
    except ImportError:
        ap.exit(2, f"gpu-check: this Python ({sys.executable}) has no PyTorch; run it with the Python that has "
                   "CUDA torch (GPU_PYTHON=... make gpu-check, or that python3 -m labkit.gpu_check)\n")

    from labkit.train import STRATEGIES

    try:
        only = [x for x in args.only.split(",") if x]
        bad = sorted(set(only) - set(ITEMS))
        if bad:
            raise ValueError(f"--only has unknown items {bad}; valid items: {list(ITEMS)}")
        wanted = not only or "labs" in only  # a missing labs/ folder is an error only where labs are run
        labs = args.labs.split(",") if args.labs else (list_labs() if wanted else [])
        if args.labs and set(labs) - set(list_labs()):
            raise ValueError(f"--labs has unknown labs {sorted(set(labs) - set(list_labs()))}; valid: {list_labs()}")
        strategies = tuple(args.strategies.split(",")) if args.strategies else None
        if strategies and set(strategies) - set(STRATEGIES):
            raise ValueError(f"--strategies has unknown names {sorted(set(strategies) - set(STRATEGIES))}; valid: "
                             f"{list(STRATEGIES)}")
        for name in ("gpus", "steps"):
            if getattr(args, name) is not None:
                positive_int(f"--{name}", getattr(args, name))
        output_dir("--out", args.out)  # before the items run, not after
    except ValueError as e:
        ap.error(str(e))
    found = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if args.device == "cuda" and not found:
        build = f"CUDA {torch.version.cuda}" if torch.version.cuda else "a CPU-only build"
        ap.exit(2, f"gpu-check: no CUDA GPU is visible here (torch {torch.__version__}, {build}); run it on a GPU "
                   "node or hub image, or pass --device cpu to check the check itself on CPU processes\n")
    if args.device == "cuda" and args.gpus and args.gpus > found:
        ap.error(f"--gpus {args.gpus} but this machine has {found} GPU(s); use --gpus <= {found}")
    world = args.gpus or (found if args.device == "cuda" else 2)
    steps = args.steps or (6 if args.device == "cuda" else 4)
    return Setting(args.device, world, steps, strategies), only, labs


def main(argv: list[str] | None = None) -> int:
    import os

    # cuBLAS sizes its workspace once, at its first use in the process: before any item runs
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    # Started as `python3 -m labkit.gpu_check` from a checkout that no pip installed, this process finds
    # labkit in its working directory; the processes it starts (torchrun's workers, a lab's children,
    # the grader's) look on PYTHONPATH.
    here = str(Path(__file__).resolve().parents[2])
    paths = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    if here not in paths:
        os.environ["PYTHONPATH"] = os.pathsep.join([here, *paths])
    ap = _parser()
    args = ap.parse_args(argv)
    s, only, labs = _setting(ap, args)
    profile = args.profile or ("gpu" if s.device == "cuda" else "ci")
    log(f"gpu-check: {', '.join(only)} on {s.world} {s.device} rank(s); reports in {args.out}")
    t0 = time.perf_counter()
    items: list[Item] = []
    for name in only:
        if name == "labs":
            items += lab_items(s, labs, profile, args.out / "labs", args.as_script)
        else:
            module = next(m for m in (gpu_items_device, gpu_items_parallel, gpu_items) if hasattr(m, name))
            items += _guarded(name, lambda name=name, module=module: getattr(module, name)(s))
    js, md = report(items, s, args.out)
    failed = [i.name for i in items if i.status == "fail"]
    log(f"gpu-check: {len(items) - len(failed)} of {len(items)} items passed or skipped in "
        f"{time.perf_counter() - t0:.0f} s" + (f"; failed: {', '.join(failed)}" if failed else "") +
        f"; report: {md}, figures: {js}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
