"""The report of a regression run (:mod:`labkit.labs.compare`): ``compare.md`` and, in ``compare/``,
a plot of every per-step series that moved.

The report goes into a folder others may write to (a run folder, a shared one): every file is
written whole through a new file and one rename (:func:`labkit.core.files.write_whole`), so a
symbolic link planted at ``compare.md`` or at a plot's name is replaced, never written through. A
``compare.md`` that is a folder, or a ``compare`` that is a file or a link, is refused in one line
before the comparison's output starts. A metric's path (any JSON key: a NUL, 300 characters) names
its plot only as far as a file name can carry it.
"""
from __future__ import annotations

import hashlib
import io
import re
from pathlib import Path

from labkit.core.checks import brief_path, output_dir
from labkit.core.files import write_whole
from labkit.labs.compare import Comparison, _is_number, _short

REPORT, PLOTS = "compare.md", "compare"


def check_report_dir(name: str, path: Path | str) -> Path:
    """``path`` as the folder the report goes to, made if missing; a ValueError naming ``name`` when it
    cannot be, or when ``compare.md`` there is a folder or ``compare`` a file or a link."""
    folder = output_dir(name, path)
    md, plots = folder / REPORT, folder / PLOTS
    try:
        if md.is_dir() and not md.is_symlink():
            raise ValueError(f"{name}: {brief_path(md)} is a folder, where the report goes: remove it or "
                             f"pass another {name}")
        if plots.is_symlink() or plots.exists() and not plots.is_dir():
            what = "a symbolic link (the plots are not written through one)" if plots.is_symlink() else "not a folder"
            raise ValueError(f"{name}: {brief_path(plots)} is {what}, where the plots go: remove it or pass "
                             f"another {name}")
    except OSError as e:
        raise ValueError(f"{name}: {brief_path(folder)} cannot be looked at ({e.strerror or e})") from None
    return folder


def _cell(text: str) -> str:
    """Text in a markdown table's cell: a ``|`` would end the cell."""
    return text.replace("|", "\\|")


def markdown(c: Comparison, base_name: str, run_name: str, plots: dict[tuple[str, str], Path]) -> str:
    """The report: a table of every lab, then each lab's changes with both values."""
    head = [f"# Lab metrics: `{run_name}` against `{base_name}`", "",
            f"**{'REGRESSED' if c.regressed else 'No regression'}**: "
            f"{sum(ch.regression for ch in c.changes)} regression(s), "
            f"{sum(ch.kind == 'timing' for ch in c.changes)} timing(s) moved.", "",
            "| lab | metrics held | regressions | timings moved | added |", "|---|---:|---:|---:|---:|"]
    for lab in sorted({ch.lab for ch in c.changes} | set(c.held)):
        mine = [ch for ch in c.changes if ch.lab == lab]
        head.append(f"| {_cell(_short(lab))} | {c.held.get(lab, 0)} | {sum(ch.regression for ch in mine)} | "
                    f"{sum(ch.kind == 'timing' for ch in mine)} | {sum(ch.what == 'added' for ch in mine)} |")
    body = []
    for lab in sorted({ch.lab for ch in c.changes}):
        body += ["", f"## {_short(lab)}", "", "| | kind | metric | baseline | this run |", "|---|---|---|---|---|"]
        for ch in sorted((ch for ch in c.changes if ch.lab == lab), key=lambda ch: (not ch.regression, ch.path)):
            mark = "**regression**" if ch.regression else ch.what
            body.append(f"| {mark} | {ch.kind} | `{_cell(_short(ch.path, 200))}` | {_cell(_short(ch.old, 40))} | "
                        f"{_cell(_short(ch.new, 40))} |")
        body += [f"\n![{p.stem}]({p.as_posix()})" for (lb, path), p in plots.items() if lb == lab]
    return "\n".join(head + body) + "\n"


def plot_name(lab: str, path: str) -> str:
    """A plot's file name: the lab and the metric's path where they make a short, plain name
    (``lab--runs.0.loss.png``), otherwise their plain characters and a hash of the whole, which
    keeps two such paths apart."""
    raw = f"{lab}--{path.replace('/', '.')}"
    name = re.sub(r"[^A-Za-z0-9._-]", "_", raw)[:100]
    if name != raw:
        name += "-" + hashlib.sha256(raw.encode("utf-8", "surrogatepass")).hexdigest()[:12]
    return name + ".png"


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
        title = f"{_short(ch.lab)}: {_short(ch.path)}".replace("$", r"\$")  # a $ in a key is not TeX
        ax.set_title(title, fontsize=8)
        ax.set_xlabel("index (step)")
        ax.legend(fontsize=7)
        fig.tight_layout()
        png = io.BytesIO()
        fig.savefig(png, format="png", dpi=90)
        plt.close(fig)
        path = folder / plot_name(ch.lab, ch.path)
        write_whole(path, png.getvalue())
        out[(ch.lab, ch.path)] = path
    return out


def write_report(c: Comparison, base: Path | str, run: Path | str, report_dir: Path) -> Path:
    """``compare.md`` and its plots (in ``compare/``) in ``report_dir``; the markdown's path."""
    report_dir = check_report_dir("--report", report_dir)
    plots = plot_series(c, report_dir / PLOTS)
    md = report_dir / REPORT
    write_whole(md, markdown(c, str(base), str(run), {k: p.relative_to(report_dir) for k, p in plots.items()}))
    return md
