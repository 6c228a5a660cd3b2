"""Regression runs: what moved between two sets of lab metrics.

``python -m labkit compare RUN`` holds every ``<lab>.metrics.json`` in ``RUN`` (``book/labs`` after
``make labs``, a GPU check's ``labs/`` folder) against a baseline (the committed ``labs/baseline/ci``
unless ``--baseline`` names another, such as the folder a GPU site keeps). Each metric is held by
its kind (:mod:`labkit.labs.metric_kinds`): an exact one that changed, a close one outside its
tolerance, a metric or a lab the baseline has and the run lacks, and with ``--timings REL`` a timing
that moved by more than REL, are regressions (exit status 1). Added metrics and timings are
reported. A markdown report, and a plot of every per-step series that moved, go next to the run.
``python -m labkit baseline`` makes a run the committed baseline: a reviewed, one-line change.
"""
from __future__ import annotations

import json
import math
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from labkit.labs.metric_kinds import FROM_FLOATS, MACHINE_KEYS, Kind, close, kind_of

BASELINE_DIR = Path(__file__).resolve().parent.parent.parent / "labs" / "baseline"
Scalar = float | int | str | bool | None


def load_metrics(folder: Path) -> dict[str, dict]:
    """Every lab's metrics in ``folder``, by lab; a ValueError naming the folder when it has none or
    a file is not JSON."""
    files = sorted(Path(folder).glob("*.metrics.json"))
    if not files:
        raise ValueError(f"{folder}: no <lab>.metrics.json here (a run folder such as book/labs, or a baseline)")
    out = {}
    for f in files:
        try:
            out[f.name.removesuffix(".metrics.json")] = json.loads(f.read_text())
        except json.JSONDecodeError as e:
            raise ValueError(f"{f}: not JSON ({e.msg}, line {e.lineno})") from None
    return out


def flatten(metrics: Any, prefix: str = "") -> dict[str, Scalar | list]:
    """Each metric by path (keys joined by ``/``, list items by index); a list of plain values (a
    per-step series) stays one metric."""
    if isinstance(metrics, dict):
        return {k: v for key, value in metrics.items()
                for k, v in flatten(value, f"{prefix}/{key}" if prefix else str(key)).items()}
    if isinstance(metrics, list) and any(isinstance(v, (dict, list)) for v in metrics):
        return {k: v for i, value in enumerate(metrics) for k, v in flatten(value, f"{prefix}/{i}").items()}
    return {prefix: metrics}


@dataclass
class Change:
    lab: str
    path: str
    kind: str  # the metric's kind, or "lab" for a whole lab
    what: str  # "changed", "moved", "added", "removed"
    old: Any = None
    new: Any = None
    regression: bool = False


@dataclass
class Comparison:
    changes: list[Change] = field(default_factory=list)
    held: dict[str, int] = field(default_factory=dict)  # lab -> metrics compared
    other_machine: list[str] = field(default_factory=list)  # labs whose baseline came from another machine

    @property
    def regressed(self) -> bool:
        return any(c.regression for c in self.changes)


def _is_number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _has_float(*values: Any) -> bool:
    return any(isinstance(v, float) or isinstance(v, list) and _has_float(*v) for v in values)


def _within(old: Any, new: Any, kind: Kind) -> bool:
    """Whether ``new`` is ``old`` up to ``kind``'s tolerance (element by element for a series)."""
    if isinstance(old, list) or isinstance(new, list):
        return (isinstance(old, list) and isinstance(new, list) and len(old) == len(new)
                and all(_within(a, b, kind) for a, b in zip(old, new)))
    if _is_number(old) and _is_number(new):
        return math.isclose(old, new, rel_tol=kind.rel, abs_tol=kind.abs)
    return old == new


def _machine(metrics: dict) -> dict:
    env = metrics.get("environment") or {}
    return {k: env.get(k) for k in MACHINE_KEYS}


def compare(base: dict[str, dict], run: dict[str, dict], timings: float | None = None) -> Comparison:
    """Hold ``run`` (lab -> metrics) against ``base``; ``timings`` a relative tolerance that makes a
    timing that moved further a regression (None: timings are only reported)."""
    out = Comparison()
    for lab in sorted(set(base) | set(run)):
        if lab not in run or lab not in base:
            gone = lab not in run
            out.changes.append(Change(lab, "", "lab", "removed" if gone else "added", regression=gone))
            continue
        other = _machine(base[lab]) != _machine(run[lab])
        if other:
            out.other_machine.append(lab)
        old, new = flatten(base[lab]), flatten(run[lab])
        out.held[lab] = len(set(old) & set(new))
        for path in sorted(set(old) | set(new)):
            kind = kind_of(lab, path)
            if path not in new or path not in old:
                gone = path not in new
                out.changes.append(Change(lab, path, kind.name, "removed" if gone else "added",
                                          old.get(path), new.get(path), regression=gone))
                continue
            a, b = old[path], new[path]
            if a == b:
                continue
            if kind.name in ("timing", "context"):
                held = kind.name == "timing" and timings is not None and not isinstance(a, str)
                bad = held and not _within(a, b, close(rel=timings))
                out.changes.append(Change(lab, path, kind.name, "moved", a, b, regression=bad))
                continue
            if other and (_has_float(a, b) or kind == FROM_FLOATS):  # metric_kinds' docstring says why
                out.changes.append(Change(lab, path, "other machine", "moved", a, b))
                continue
            out.changes.append(Change(lab, path, kind.name, "changed", a, b, regression=not _within(a, b, kind)))
    return out


def _short(v: Any, width: int = 60) -> str:
    text = json.dumps(v) if not isinstance(v, str) else v
    return text if len(text) <= width else text[:width - 3] + "..."


def summary(c: Comparison, timing_lines: bool = False) -> list[str]:
    """One line per lab, then one per regression (and per moved timing when ``timing_lines``)."""
    lines = []
    for lab in sorted({ch.lab for ch in c.changes} | set(c.held)):
        mine = [ch for ch in c.changes if ch.lab == lab]
        bad = [ch for ch in mine if ch.regression]
        moved = sum(ch.kind == "timing" and not ch.regression for ch in mine)
        added = sum(ch.what == "added" for ch in mine)
        state = f"{len(bad)} regression(s)" if bad else "as the baseline"
        floats = sum(ch.kind == "other machine" for ch in mine)
        note = (f" (baseline from another machine: {floats} float(s) moved, reported, not held; "
                "`make baseline` here holds them)") if lab in c.other_machine else ""
        lines.append(f"{lab}: {state}; {c.held.get(lab, 0)} metrics held, {moved} timing(s) moved, "
                     f"{added} added{note}")
        for ch in mine:
            if ch.regression or (timing_lines and ch.kind == "timing"):
                lines.append(f"  {ch.what} {ch.kind} {ch.path or '(the whole lab)'}: "
                             f"{_short(ch.old)} -> {_short(ch.new)}")
    return lines


def markdown(c: Comparison, base_name: str, run_name: str, plots: dict[tuple[str, str], Path]) -> str:
    """The report: a table of every lab, then each lab's changes with both values."""
    head = [f"# Lab metrics: `{run_name}` against `{base_name}`", "",
            f"**{'REGRESSED' if c.regressed else 'No regression'}**: "
            f"{sum(ch.regression for ch in c.changes)} regression(s), "
            f"{sum(ch.kind == 'timing' for ch in c.changes)} timing(s) moved.", "",
            "| lab | metrics held | regressions | timings moved | added |", "|---|---:|---:|---:|---:|"]
    for lab in sorted({ch.lab for ch in c.changes} | set(c.held)):
        mine = [ch for ch in c.changes if ch.lab == lab]
        head.append(f"| {lab} | {c.held.get(lab, 0)} | {sum(ch.regression for ch in mine)} | "
                    f"{sum(ch.kind == 'timing' for ch in mine)} | {sum(ch.what == 'added' for ch in mine)} |")
    body = []
    for lab in sorted({ch.lab for ch in c.changes}):
        body += ["", f"## {lab}", "", "| | kind | metric | baseline | this run |", "|---|---|---|---|---|"]
        for ch in sorted((ch for ch in c.changes if ch.lab == lab), key=lambda ch: (not ch.regression, ch.path)):
            mark = "**regression**" if ch.regression else ch.what
            body.append(f"| {mark} | {ch.kind} | `{ch.path}` | {_short(ch.old, 40)} | {_short(ch.new, 40)} |")
        body += [f"\n![{lab} {path}]({p.as_posix()})" for (lb, path), p in plots.items() if lb == lab]
    return "\n".join(head + body) + "\n"


def plot_series(c: Comparison, folder: Path, most: int = 24) -> dict[tuple[str, str], Path]:
    """A plot of each numeric per-step series that changed (regressions first), baseline and run on
    the same axes, in ``folder``; at most ``most`` of them."""
    series = [ch for ch in sorted(c.changes, key=lambda ch: not ch.regression)
              if ch.what in ("changed", "moved") and isinstance(ch.old, list) and isinstance(ch.new, list)
              and len(ch.old) > 1 and all(_is_number(v) for v in ch.old + ch.new)][:most]
    if not series:
        return {}
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    folder.mkdir(parents=True, exist_ok=True)
    out = {}
    for ch in series:
        fig, ax = plt.subplots(figsize=(5, 3))
        ax.plot(ch.old, label="baseline", marker=".")
        ax.plot(ch.new, label="this run", marker=".", linestyle="--")
        ax.set_title(f"{ch.lab}: {ch.path}", fontsize=8)
        ax.set_xlabel("index (step)")
        ax.legend(fontsize=7)
        fig.tight_layout()
        path = folder / f"{ch.lab}--{ch.path.replace('/', '.')}.png"
        fig.savefig(path, dpi=90)
        plt.close(fig)
        out[(ch.lab, ch.path)] = path
    return out


def write_report(c: Comparison, base: Path, run: Path, report_dir: Path) -> Path:
    """``compare.md`` and its plots (in ``compare/``) in ``report_dir``; the markdown's path."""
    report_dir.mkdir(parents=True, exist_ok=True)
    plots = plot_series(c, report_dir / "compare")
    md = report_dir / "compare.md"
    md.write_text(markdown(c, str(base), str(run), {k: p.relative_to(report_dir) for k, p in plots.items()}))
    return md


def make_baseline(run: Path, profile: str, to: Path) -> list[Path]:
    """Copy every lab's metrics in ``run`` into ``to``, after checking that each was run under
    ``profile``; a ValueError when one was not, or not every lab in ``to`` is in the run."""
    metrics = load_metrics(run)
    wrong = {lab: m.get("profile") for lab, m in metrics.items() if m.get("profile") != profile}
    if wrong:
        raise ValueError(f"{run}: not run with --profile {profile}: {wrong}")
    missing = sorted({p.name.removesuffix(".metrics.json") for p in to.glob("*.metrics.json")} - set(metrics))
    if missing:
        raise ValueError(f"{run}: no metrics for {missing}, which the baseline {to} has; run them first")
    to.mkdir(parents=True, exist_ok=True)
    return [Path(shutil.copyfile(run / f"{lab}.metrics.json", to / f"{lab}.metrics.json")) for lab in metrics]
