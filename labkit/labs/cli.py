"""``python -m labkit``: run labs with papermill, list them, print their profiles or their training flags,
compare their metrics with a baseline."""
from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

from labkit.core.checks import brief_path, output_dir, positive_int
from labkit.core.cli import ArgumentParser
from labkit.labs.compare import BASELINE_DIR
from labkit.labs.profiles import PROFILES
from labkit.labs.parameters import profile_world_size, resolve, train_flags
from labkit.labs.runner import OUT_DIR, check_lab, list_labs, run_labs


def parse_value(text: str) -> Any:
    """A ``-p`` value as papermill reads one: JSON where it parses (``5``, ``1e-3``, ``true``, ``[2, 4]``),
    Python's ``True``/``False``/``None`` too, otherwise the text itself."""
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return {"True": True, "False": False, "None": None}.get(text, text)


def _split_key_values(argv: list[str]) -> list[str]:
    """``-p KEY=VALUE`` as ``-p KEY VALUE`` (papermill's form, which argparse reads); an empty key is
    left for the check of keys to name."""
    out, i = [], 0
    while i < len(argv):
        out.append(argv[i])
        if argv[i] in ("-p", "--parameter") and i + 1 < len(argv) and "=" in argv[i + 1] \
                and not argv[i + 1].startswith("-"):
            out += argv[i + 1].split("=", 1)
            i += 1
        i += 1
    return out


def check_gpus_here(lab: str, profile: str, gpus: int | None, overrides: dict) -> None:
    """A ValueError when a run would put ``lab`` on more GPUs than this machine has (``--gpus`` plans
    for GPUs; ``resolve --gpus`` shows such a plan without running it)."""
    if gpus is None or resolve(lab, profile, gpus=gpus, **overrides).get("device") != "cuda":
        return
    from labkit.labs.parameters import _gpu_count

    have = _gpu_count()
    if have < gpus:
        raise ValueError(f"--gpus {gpus}: this machine has {have} GPU(s); run on a machine that has them, or "
                         f"print the plan without running it: python -m labkit resolve {lab} {profile} --gpus {gpus}")


def _baseline_to(path: Any) -> Path:
    """``--to`` as a folder, checked but not made: made only once the run is found to be a baseline."""
    if str(path) == "":
        raise ValueError("--to='' is empty (an unset variable?): give the baseline's folder, or leave it out")
    try:
        there = Path(path).exists() and not Path(path).is_dir()
    except OSError as e:  # a name too long for the filesystem
        raise ValueError(f"--to={brief_path(path)} cannot be looked at ({e.strerror or e})") from None
    if there:
        raise ValueError(f"--to={brief_path(path)} is not a folder: pass the baseline's folder")
    return Path(path)


def _compare_or_baseline(ap: ArgumentParser, args: Any) -> int:
    from labkit.labs import compare as cmp
    from labkit.labs.compare_report import check_report_dir, write_report

    try:
        if args.cmd == "baseline":
            to = _baseline_to(args.to if args.to is not None else cmp.BASELINE_DIR / args.profile)
            written = cmp.make_baseline(args.run, args.profile, to)
            print(f"baseline: {len(written)} labs' metrics from {args.run} -> {to} (review the diff, then commit)")
            return 0
        if args.timings is not None and not args.timings >= 0:
            raise ValueError(f"--timings {args.timings}: give a relative tolerance >= 0, such as 0.1")
        base, run = cmp.load_metrics(args.baseline, "--baseline"), cmp.load_metrics(args.run, "RUN")
        report_dir = check_report_dir("--report", args.run if args.report is None else args.report)
    except ValueError as e:
        ap.error(str(e))
    result = cmp.compare(base, run, args.timings)
    print("\n".join(cmp.summary(result, args.verbose)))
    md = write_report(result, args.baseline, args.run, report_dir)
    print(f"{'REGRESSED' if result.regressed else 'no regression'}; report: {md}")
    return 1 if result.regressed else 0


def _parser() -> ArgumentParser:
    # Folders are taken as text and checked (output_dir, load_metrics): Path("") is ".", and an unset
    # variable (--out "$OUT") would write into the working directory.
    ap = ArgumentParser(prog="python -m labkit", description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run", help="execute labs with papermill")
    r.add_argument("labs", nargs="*", help="lab names (default: all)")
    r.add_argument("--profile", default="ci", help="cpu, ci or gpu")
    r.add_argument("--out", default=OUT_DIR, help=f"where the executed labs go (default: {OUT_DIR})")
    r.add_argument("--force", action="store_true", help="re-run even when nothing changed")
    r.add_argument("--gpus", type=int, default=None, help="GPUs to fit a gpu profile to (default: those found)")
    r.add_argument("--jobs", type=int, default=1, help="labs run side by side, each in its own process "
                   "(CPU profiles; their timings then share the cores)")
    r.add_argument("--as-script", action="store_true", help="run the lab's cells in order without Jupyter "
                   "(for machines without papermill or a kernel); writes the metrics JSON only")
    r.add_argument("-p", "--parameter", nargs=2, action="append", default=[], metavar=("KEY", "VALUE"),
                   help="override one of the profile's parameters, as papermill's -p does: -p steps 5 -p lr 1e-3 "
                   "(or -p steps=5; VALUE read as JSON: numbers, true/false, lists; otherwise a string); checked "
                   "before any lab runs")
    rs = sub.add_parser("resolve", help="print, as JSON, the parameters a lab runs with under a profile "
                        "(a gpu profile fitted to --gpus N; nothing looks for GPUs)")
    rs.add_argument("lab")
    rs.add_argument("profile")
    rs.add_argument("--gpus", type=int, default=None, help="GPUs to plan a gpu profile for (default: those found)")
    sub.add_parser("list", help="list the labs")
    sub.add_parser("port", help="print a TCP port that is free on this host now (for a rendezvous)")
    pr = sub.add_parser("profiles", help="print a lab's profiles as a table (every lab's without LAB)")
    pr.add_argument("lab", nargs="?", default=None)
    pr.add_argument("--json", action="store_true", help="the profiles as JSON, as labkit.labs.profiles has them")
    f = sub.add_parser("flags", help="print the labkit.train flags of a lab's profile (for batch scripts)")
    f.add_argument("lab")
    f.add_argument("profile")
    f.add_argument("--world-size", type=int, default=None, help="ranks in all, for per-rank batch sizes "
                   "(default: the profile's own, where it names one; a gpu profile's is every GPU: give it)")
    c = sub.add_parser("compare", help="hold a run's lab metrics against a baseline: what changed, exit 1 "
                       "when something regressed (labkit.labs.compare)")
    c.add_argument("run", help="a folder of <lab>.metrics.json: book/labs, a gpu-check's labs/")
    c.add_argument("--baseline", default=BASELINE_DIR / "ci",
                   help="the folder to hold it against (default: the committed ci baseline)")
    c.add_argument("--timings", type=float, default=None, metavar="REL",
                   help="hold timings to this relative tolerance too (a quiet GPU node; default: report them)")
    c.add_argument("--report", default=None,
                   help="where compare.md and its plots go (default: the run folder)")
    c.add_argument("--verbose", action="store_true", help="a line for every timing that moved too")
    b = sub.add_parser("baseline", help="make a run's lab metrics the committed baseline (a reviewed change)")
    b.add_argument("run", nargs="?", default=OUT_DIR, help=f"the run folder (default: {OUT_DIR})")
    b.add_argument("--profile", default="ci", help="the profile every lab in it ran (default: ci)")
    b.add_argument("--to", default=None, help="the baseline folder (default: labs/baseline/PROFILE)")
    return ap


def profile_table(lab: str) -> str:
    """``lab``'s profiles side by side, a row per parameter (what ``-p`` may change), in markdown."""
    from labkit.labs.param_choices import shown

    profiles = PROFILES[lab]
    keys = sorted({k for p in profiles.values() for k in p})
    rows = [[k, *(shown(p[k]) if k in p else "" for p in profiles.values())] for k in keys]
    head = ["parameter", *profiles]
    widths = [max(len(r[i]) for r in [head, *rows]) for i in range(len(head))]
    line = lambda r: "| " + " | ".join(c.ljust(w) for c, w in zip(r, widths)) + " |"  # noqa: E731
    return "\n".join([f"{lab}:", line(head), "|" + "|".join("-" * (w + 2) for w in widths) + "|",
                      *map(line, rows)])


def main(argv: list[str] | None = None) -> int:
    ap = _parser()
    args = ap.parse_args(_split_key_values(sys.argv[1:] if argv is None else list(argv)))
    if args.cmd in ("compare", "baseline"):
        return _compare_or_baseline(ap, args)
    if args.cmd == "flags":
        try:
            world = args.world_size if args.world_size is not None else profile_world_size(args.lab, args.profile)
            positive_int("--world-size", world)
            print(" ".join(train_flags(args.lab, args.profile, world)))
        except ValueError as e:
            ap.error(str(e))
        return 0
    if args.cmd == "resolve":
        try:
            if args.gpus is not None:
                positive_int("--gpus", args.gpus)
            print(json.dumps(resolve(args.lab, args.profile, gpus=args.gpus), indent=1))
        except ValueError as e:
            ap.error(str(e))
        return 0
    if args.cmd == "port":
        from labkit.core.ports import listen_port

        try:
            print(listen_port(""))  # free on every address now; the caller binds it moments later
        except ValueError as e:
            ap.error(str(e))
        return 0
    if args.cmd == "list":
        try:
            print(" ".join(list_labs()))
        except ValueError as e:
            print(f"error: {e}", file=sys.stderr)
            return 1
        return 0
    if args.cmd == "profiles":
        try:
            labs = [args.lab] if args.lab is not None else list(PROFILES)
            check_lab(labs[0], "cpu")
        except ValueError as e:
            ap.error(str(e))
        print(json.dumps({lab: PROFILES[lab] for lab in labs}, indent=1) if args.json
              else "\n\n".join(profile_table(lab) for lab in labs))
        return 0
    try:
        overrides = {key: parse_value(value) for key, value in args.parameter}
        names = args.labs or list_labs()
        out = output_dir("--out", args.out)
        if args.gpus is not None:
            positive_int("--gpus", args.gpus)
        positive_int("--jobs", args.jobs)
        if args.jobs > 1 and args.profile == "gpu":
            raise ValueError(f"--jobs {args.jobs}: the gpu profile runs one lab at a time (each lab uses every GPU)")
        for name in names:  # a bad lab, profile or value is an argument error, before any lab runs
            check_lab(name, args.profile, gpus=args.gpus, overrides=overrides)
            check_gpus_here(name, args.profile, args.gpus, overrides)
    except ValueError as e:
        ap.error(str(e))
    try:
        run_labs(names, args.profile, out, args.jobs, args.force, overrides=overrides or None,
                 as_script=args.as_script, gpus=args.gpus)
    except RuntimeError as e:  # a lab failed, or needs a missing package: not the caller's argument
        print(f"error: {e}", file=sys.stderr)
        return 1
    return 0
