"""The lab runner: execute lab notebooks with papermill under a named profile.

Labs live in ``labs/`` as MyST-markdown notebooks (jupytext) with a papermill ``parameters`` cell.
A *profile* scales a lab to where it runs: ``cpu`` (the parameters cell's defaults: a 2-core laptop),
``ci`` (smaller still, for the regression runs) and ``gpu`` (a real cluster-size run, one GPU per
rank). ``python -m labkit run [LAB ...] --profile ci`` executes labs into ``book/labs/``, where the
book picks them up; a lab re-runs only when its source, labkit or the profile changed.
"""
from __future__ import annotations

import hashlib
import sys
import time
from pathlib import Path

from labkit.labs.resolve import resolve

ROOT = Path(__file__).resolve().parent.parent.parent
LABS_DIR = ROOT / "labs"
OUT_DIR = ROOT / "book" / "labs"


def list_labs(labs_dir: Path = LABS_DIR) -> list[str]:
    return sorted(p.stem for p in labs_dir.glob("*.md"))


def check_lab(name: str, profile: str, labs_dir: Path = LABS_DIR) -> None:
    """A ValueError naming what exists when ``name`` is not a lab or ``profile`` not one of its profiles."""
    if not (labs_dir / f"{name}.md").is_file():
        raise ValueError(f"LAB={name!r} does not exist; valid labs: {list_labs(labs_dir)}")
    resolve(name, profile)  # fail fast on a bad profile, before a kernel starts


def _fingerprint(lab_path: Path, profile: str) -> str:
    h = hashlib.sha256(profile.encode())
    for f in [lab_path, *sorted((ROOT / "labkit").rglob("*.py")), ROOT / "requirements.txt"]:
        if f.exists():
            h.update(f.read_bytes())
    return h.hexdigest()


def _kernel_name() -> str:
    from jupyter_client.kernelspec import KernelSpecManager

    return "labkit" if "labkit" in KernelSpecManager().find_kernel_specs() else "python3"


def run_lab(name: str, profile: str, out_dir: Path = OUT_DIR, force: bool = False,
            labs_dir: Path = LABS_DIR) -> Path:
    """Execute one lab; return the path of its metrics JSON. Skips the run when nothing changed."""
    import jupytext
    import papermill as pm

    check_lab(name, profile, labs_dir)
    src = labs_dir / f"{name}.md"
    out_dir.mkdir(parents=True, exist_ok=True)
    out_nb, metrics = out_dir / f"{name}.ipynb", out_dir / f"{name}.metrics.json"
    stamp = out_dir / f".{name}.fingerprint"
    key = _fingerprint(src, profile)
    if not force and out_nb.exists() and metrics.exists() and stamp.exists() and stamp.read_text() == key:
        print(f"[labs] {name}: up to date ({profile}), not re-run")
        return metrics
    stamp.unlink(missing_ok=True)
    metrics.unlink(missing_ok=True)
    print(f"[labs] {name}: executing with PROFILE={profile!r} ...", flush=True)
    t0 = time.perf_counter()
    try:
        pm.execute_notebook(
            jupytext.read(src), str(out_nb), kernel_name=_kernel_name(), cwd=str(out_dir),
            parameters={"PROFILE": profile, "METRICS_PATH": metrics.name},
            progress_bar=sys.stdout.isatty(), log_output=False, request_save_on_cell_execute=False,
        )
    except pm.PapermillExecutionError as e:
        raise RuntimeError(
            f"lab {name!r} failed in cell {e.exec_count} ({e.ename}: {e.evalue}); "
            f"the partly executed notebook is at {out_nb}"
        ) from None
    if not metrics.exists():
        raise RuntimeError(f"lab {name!r} ran but wrote no metrics file {metrics}")
    stamp.write_text(key)
    print(f"[labs] {name}: done in {time.perf_counter() - t0:.0f} s -> {out_nb}")
    return metrics
