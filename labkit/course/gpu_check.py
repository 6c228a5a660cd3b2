"""``python3 -m labkit.gpu_check`` (``make gpu-check``): does this GPU node or hub image run the course?

One command for an instructor on a fresh GPU machine, sized for the minutes a GPU is lent: its first
lines say what the machine is (:mod:`labkit.course.gpu_machine`); then it checks every strategy on the
node's GPUs against one process, FSDP2 itself on one rank, the precision paths, the speed (MFU) of the
GPT at GPT-2 small's shape in bf16 with its memory against the calculator, what one device does (its
roofs, fusion, FP8 GEMMs, FlashAttention: :mod:`labkit.course.gpu_items_device`), and every lab's
``gpu`` profile trimmed to a few steps (:data:`labkit.labs.profiles.GPU_CHECK`); it prints one
PASS/FAIL/SKIP/OVER line per item and writes ``gpu_check.json`` and ``gpu_check.md`` into ``--out``.

Each item and lab runs in a process of its own within a time budget (:mod:`labkit.course.gpu_budget`):
the default run ends within 10 minutes (``--budget``), a part that runs past its own seconds is
stopped and reported OVER, and what the budget left no time for says so; ``--full`` runs
everything. A lab that needs more GPUs than the machine has is a SKIP naming how many.

It runs on any torch from 2.11 on, without ``.venv``: a package an item needs and the machine lacks
(DeepSpeed, papermill, ...) skips that item with the package's name; labs run through papermill
where it exists and as plain scripts (:mod:`labkit.labs.script`) where it does not, their figures
not drawn where matplotlib is missing (:mod:`labkit.labs.no_plots`). On a machine without CUDA it says
so in one sentence and exits 2; ``--device cpu`` runs the same items on CPU processes over gloo, to
check the check itself (its speeds mean nothing).
"""
from __future__ import annotations

import json
import sys
import time
from dataclasses import asdict
from pathlib import Path

from labkit.core.checks import at_most, one_of, output_dir, positive_int
from labkit.core.cli import ArgumentParser
from labkit.course import gpu_items, gpu_items_device, gpu_items_parallel, gpu_machine
from labkit.course.gpu_budget import ITEM_S, TOTAL_S, Budget, run_apart
from labkit.course.gpu_guard import STATUS, _guarded, cause  # noqa: F401 - the check's own names
from labkit.course.gpu_items import Item, Setting, log
from labkit.course.gpu_labs import LabFailed, lab_items, run_lab_apart  # noqa: F401 - the check's own names
from labkit.labs.runner import ROOT, list_labs

ITEMS = ("environment", "strategies", "fsdp2", "context", "experts", "precision", "speed", "device", "determinism",
         "labs")
ITEM_MARK = "\0labkit-item "  # a finished Item, as a child prints it for the check


# An item in a process of its own (gpu_budget): each Item it finishes goes to stdout as one marked line.
_ITEM_CHILD = "import sys\nfrom labkit.course.gpu_check import item_here\nitem_here(sys.argv[1], sys.argv[2])\n"


def item_here(name: str, setting: str) -> None:
    """In the item's own process: run it, printing each finished Item as a marked JSON line."""
    kw = json.loads(setting)
    s = Setting(**{**kw, "strategies": tuple(kw["strategies"]) if kw["strategies"] else None})
    gpu_items.SINK = lambda it: print(ITEM_MARK + json.dumps(asdict(it), default=str), flush=True)
    module = next(m for m in (gpu_machine, gpu_items_device, gpu_items_parallel, gpu_items) if hasattr(m, name))
    _guarded(name, lambda: getattr(module, name)(s))


def run_item(name: str, s: Setting, seconds: float, cut: bool = False) -> list[Item]:
    """Item ``name`` in a new process, stopped after ``seconds``: its Items, and OVER if it was stopped
    (``cut``: those seconds were what the check's budget had left, less than the item's own)."""
    t0 = time.perf_counter()
    code, out, err = run_apart([sys.executable, "-c", _ITEM_CHILD, name, json.dumps(asdict(s))], seconds)
    items = [Item(**json.loads(line[len(ITEM_MARK):])) for line in out.splitlines() if line.startswith(ITEM_MARK)]
    lines = [ln for ln in err.strip().splitlines() if ln.strip()]
    if code is None:
        done = f" ({len(items)} part(s) finished before)" if items else ""
        cut_by = "; that was what the check's budget had left" if cut else ""
        items.append(Item(name, "over", f"ran past its {seconds:.0f} s and was stopped{done}{cut_by}",
                          seconds=time.perf_counter() - t0, error=err[-20000:]))
    elif code:  # (exit 0 with no items: none applied, as --strategies that are all skipped)
        items.append(Item(name, "fail", (lines[-1] if lines else f"exit status {code}")[:400],
                          seconds=time.perf_counter() - t0, error=err[-20000:]))
    for it in items:  # parts sent as they finished carry no time of their own: a share of the item's
        it.seconds = it.seconds or (time.perf_counter() - t0) / len(items)
        log(f"{STATUS[it.status]} {it.name}: {it.detail}")
    return items


def report(items: list[Item], s: Setting, out: Path, seconds: float | None = None,
           budget: float | None = None) -> tuple[Path, Path]:
    """``gpu_check.json`` (every figure) and ``gpu_check.md`` (a table a person reads)."""
    out.mkdir(parents=True, exist_ok=True)
    counts = {k: sum(i.status == k for i in items) for k in STATUS}
    data = {"setting": asdict(s), "counts": counts, "items": [asdict(i) for i in items], "summary": summary(items),
            "seconds": seconds, "budget": budget}
    js = out / "gpu_check.json"
    js.write_text(json.dumps(data, indent=1, default=str))
    env = next((i.figures for i in items if i.name == "environment"), {})
    lines = ["# GPU check", "", f"{summary(items)}, on {s.world} {s.device} rank(s).", ""]
    if env:
        lines += [*(f"    {line}" for line in gpu_machine.header(env)), ""]
    lines += ["| item | result | detail | s |", "|---|---|---|---:|"]
    lines += [f"| {i.name} | {STATUS[i.status]} | {i.detail.replace('|', '/')} | {i.seconds:.0f} |" for i in items]
    md = out / "gpu_check.md"
    md.write_text("\n".join(lines) + "\n")
    return js, md


def summary(items: list[Item]) -> str:
    """The counts, and how many labs ran their code: a lab that skipped ran none of it."""
    counts = {k: sum(i.status == k for i in items) for k in STATUS}
    labs = [i for i in items if i.name.startswith("lab ")]
    ran = sum(i.status == "pass" for i in labs)
    return (f"{counts['pass']} passed, {counts['fail']} failed, {counts['over']} over their time budget, "
            f"{counts['skip']} skipped" + (f"; {ran} of {len(labs)} labs ran their code" if labs else ""))


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
    ap.add_argument("--out", default=str(ROOT / "_build" / "gpu_check"), help="where the reports go")
    ap.add_argument("--budget", type=float, default=None, help=f"seconds for the whole check (default "
                    f"{TOTAL_S['cuda']:.0f}, {TOTAL_S['cpu']:.0f} with --device cpu); each item and lab has its own "
                    "as well, and is stopped when it runs past it")
    ap.add_argument("--full", action="store_true", help="every item and lab, no total budget (each still stopped "
                    "after an hour)")
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
        for name, top, why in (("gpus", 4096, "more ranks than a check should start"),
                               ("steps", 10**6, "a check of a million steps a strategy")):
            if getattr(args, name) is not None:
                at_most(f"--{name}", positive_int(f"--{name}", getattr(args, name)), top, why)
        if args.profile:
            one_of("--profile", args.profile, ("cpu", "ci", "gpu"), "profiles")
        if args.budget is not None and not 60 <= args.budget <= 86400:
            raise ValueError(f"--budget {args.budget:g}: give 60 to 86400 seconds for the whole check")
        args.out = output_dir("--out", args.out)  # before the items run, not after
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
    budget = Budget(None if args.full else args.budget or TOTAL_S[s.device])
    within = "no total budget (--full)" if args.full else f"within {budget.total:.0f} s"
    log(f"gpu-check: {', '.join(only)} on {s.world} {s.device} rank(s), {within}; reports in {args.out}")
    # The machine first, in one screen; the environment item is the process that looks (this one never
    # touches CUDA: a context here would hold a GPU's memory for the whole check)
    env = run_item("environment", s, budget.grant(ITEM_S["environment"]) or ITEM_S["environment"])
    for line in gpu_machine.header(env[0].figures) if env and env[0].figures else []:
        log(f"  {line}")
    items: list[Item] = env if "environment" in only else []
    for name in only:
        if name == "labs":
            items += lab_items(s, labs, profile, args.out / "labs", args.as_script, budget)
        elif name != "environment":
            seconds = budget.grant(ITEM_S[name])
            if seconds is None:
                items.append(Item(name, "skip", budget.spent()))
                log(f"SKIP {name}: {items[-1].detail}")
                continue
            items += run_item(name, s, seconds, cut=bool(budget.total) and seconds < ITEM_S[name])
    js, md = report(items, s, args.out, budget.used(), budget.total)
    bad = [i.name for i in items if i.status in ("fail", "over")]
    log(f"gpu-check: {summary(items)}, in {budget.used():.0f} s" + (f"; not proven: {', '.join(bad)}" if bad else "")
        + f"; report: {md}, figures: {js}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
