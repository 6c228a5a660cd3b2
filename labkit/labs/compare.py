"""Regression runs: what moved between two sets of lab metrics.

``python -m labkit compare RUN`` holds every ``<lab>.metrics.json`` in ``RUN`` (``book/labs`` after
``make labs``, a GPU check's ``labs/`` folder) against a baseline (the committed ``labs/baseline/ci``
unless ``--baseline`` names another, such as the folder a GPU site keeps). Each metric is held by
its kind (:mod:`labkit.labs.metric_kinds`): an exact one that changed, a close one outside its
tolerance, a metric or a lab the baseline has and the run lacks, and with ``--timings REL`` a timing
that moved by more than REL, are regressions (exit status 1). Added metrics and timings are
reported. A markdown report, and a plot of every per-step series that moved, go next to the run
(:mod:`labkit.labs.compare_report`). What a folder holds is data: a file that is not a JSON object
of metrics (a list, a FIFO, a link loop, JSON nested too deeply) is one line naming it.
``python -m labkit baseline`` makes a run the committed baseline: a reviewed, one-line change.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from labkit.core.checks import brief_path
from labkit.core.files import read_regular, write_whole
from labkit.labs.metric_kinds import FROM_FLOATS, MACHINE_KEYS, Kind, close, kind_of

BASELINE_DIR = Path(__file__).resolve().parent.parent.parent / "labs" / "baseline"
Scalar = float | int | str | bool | None


# Deeper than this is not a lab's metrics (theirs nest a few levels): refused before flatten recurses.
MAX_DEPTH = 100


def _depth_over(value: Any, limit: int) -> bool:
    """Whether ``value`` nests lists and objects deeper than ``limit`` (a loop, not recursion)."""
    todo = [(value, 1)]
    while todo:
        v, depth = todo.pop()
        if isinstance(v, (dict, list)):
            if depth > limit:
                return True
            todo += [(item, depth + 1) for item in (v.values() if isinstance(v, dict) else v)]
    return False


def _metrics(f: Path, name: str) -> dict:
    """One ``<lab>.metrics.json``, or a ValueError in one line saying what it is instead."""
    try:
        text = read_regular(f)  # not a FIFO's reader for ever, nor a device's
    except ValueError as e:
        raise ValueError(f"{name}: {e}; a run folder holds <lab>.metrics.json files") from None
    try:
        data = json.loads(text)
        deep = _depth_over(data, MAX_DEPTH)
    except RecursionError:  # deeper than the parser goes
        deep = True
    except ValueError as e:  # JSONDecodeError, not UTF-8, an integer of 5,000 digits
        where = f", line {e.lineno}" if isinstance(e, json.JSONDecodeError) else ""
        raise ValueError(f"{name}: {brief_path(f)} is not JSON ({getattr(e, 'msg', e)}{where})") from None
    if deep:
        raise ValueError(f"{name}: {brief_path(f)} is nested too deeply to be a lab's metrics "
                         f"(more than {MAX_DEPTH} levels)")
    if not isinstance(data, dict):
        raise ValueError(f"{name}: {brief_path(f)} holds {_json_kind(data)}, not a JSON object: a lab's "
                         "metrics are an object of named values")
    return data


def _json_kind(v: Any) -> str:
    return {list: "a list", str: "a string", type(None): "null", bool: "a boolean"}.get(type(v), "a number")


def load_metrics(folder: Path | str, name: str = "RUN") -> dict[str, dict]:
    """Every lab's metrics in ``folder``, by lab; a ValueError naming ``name`` (the parameter) when it
    has none or a file is not a JSON object (not a regular file, not JSON, nested too deeply)."""
    if str(folder) == "":
        raise ValueError(f"{name}='' is empty (an unset variable?): give a folder of <lab>.metrics.json")
    files = sorted(Path(folder).glob("*.metrics.json"))
    if not files:
        raise ValueError(f"{name}: {brief_path(folder)} holds no <lab>.metrics.json (a run folder such as "
                         "book/labs, or a baseline)")
    return {f.name.removesuffix(".metrics.json"): _metrics(f, name) for f in files}


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


def _nan(v: Any) -> bool:
    return isinstance(v, float) and math.isnan(v)


def _same(old: Any, new: Any) -> bool:
    """``old == new``, where a NaN equals a NaN: a loss that was NaN and still is has not changed."""
    if isinstance(old, list) and isinstance(new, list):
        return len(old) == len(new) and all(_same(a, b) for a, b in zip(old, new))
    return old == new or _nan(old) and _nan(new)


def _within(old: Any, new: Any, kind: Kind) -> bool:
    """Whether ``new`` is ``old`` up to ``kind``'s tolerance (element by element for a series)."""
    if isinstance(old, list) or isinstance(new, list):
        return (isinstance(old, list) and isinstance(new, list) and len(old) == len(new)
                and all(_within(a, b, kind) for a, b in zip(old, new)))
    if _is_number(old) and _is_number(new) and not _same(old, new):
        try:
            return math.isclose(old, new, rel_tol=kind.rel, abs_tol=kind.abs)
        except OverflowError:  # an integer past float's range: only the same integer is within
            return False
    return _same(old, new)


def _machine(metrics: dict) -> dict:
    env = metrics.get("environment")
    env = env if isinstance(env, dict) else {}  # a hand-edited file: its environment is data, compared as such
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
            if _same(a, b):
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
    """A value, or a metric's path, in one short line: control characters (a NUL, a newline in a
    key) escaped as JSON escapes them."""
    text = json.dumps(v) if not isinstance(v, str) or not v.isprintable() else v
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
                lines.append(f"  {ch.what} {ch.kind} {_short(ch.path, 120) or '(the whole lab)'}: "
                             f"{_short(ch.old)} -> {_short(ch.new)}")
    return lines


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
    for lab in metrics:  # written whole, and a link at the name replaced, not written through
        write_whole(to / f"{lab}.metrics.json", read_regular(Path(run) / f"{lab}.metrics.json"))
    return [to / f"{lab}.metrics.json" for lab in metrics]
