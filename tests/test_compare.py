"""`python -m labkit compare`: a planted change in an exact metric is a regression (exit 1); a timing
that moved is reported, and a regression only past a stated tolerance; the report and its plots are
written; a bad folder or flag is one line with exit status 2. `python -m labkit baseline` refuses a
run of another profile. (tests/test_labs.py holds every CI run's labs against the committed baseline.)"""
from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from labkit.labs.compare import BASELINE_DIR, compare, flatten, load_metrics, make_baseline, summary
from labkit.labs.metric_kinds import kind_of

ROOT = Path(__file__).resolve().parent.parent
BASE = {"lab": {"profile": "ci", "environment": {"torch": "2.13.0", "cpu_capability": "AVX2", "threads": 1},
                "params": {"steps": 3}, "loss": [4.0, 3.5, 3.25], "bytes_per_step": 1024,
                "runs": [{"name": "ddp", "median_step_ms": 10.0}], "recorded": {"lab_loss": 3.25}}}


def _write(folder: Path, metrics: dict) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    for lab, m in metrics.items():
        (folder / f"{lab}.metrics.json").write_text(json.dumps(m))
    return folder


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "labkit", *args], capture_output=True, text=True, cwd=ROOT,
                          timeout=120)


def _planted(**changes) -> dict:
    run = json.loads(json.dumps(BASE))
    for path, value in changes.items():
        node = run["lab"]
        *keys, last = path.split("__")
        for k in keys:
            node = node[int(k)] if k.isdigit() else node[k]
        node[int(last) if last.isdigit() else last] = value
    return run


def test_paths_and_kinds():
    flat = flatten(BASE["lab"])
    assert flat["loss"] == [4.0, 3.5, 3.25] and flat["runs/0/median_step_ms"] == 10.0  # a series stays whole
    assert [kind_of("lab", p).name for p in ("loss", "bytes_per_step", "runs/0/median_step_ms", "environment/torch")] \
        == ["exact", "exact", "timing", "context"]


def test_a_planted_change_in_an_exact_metric_is_reported_and_exits_1(tmp_path):
    base = _write(tmp_path / "base", BASE)
    run = _write(tmp_path / "run", _planted(bytes_per_step=1032, loss=[4.0, 3.5, 3.2500001]))
    proc = _cli("compare", str(run), "--baseline", str(base))
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "changed exact bytes_per_step: 1024 -> 1032" in proc.stdout and "changed exact loss" in proc.stdout
    md = (run / "compare.md").read_text()
    assert "REGRESSED" in md and "`bytes_per_step`" in md
    plots = list((run / "compare").glob("*.png"))  # the per-step series that moved, drawn
    assert [p.name for p in plots] == ["lab--loss.png"] and "lab--loss.png" in md


def test_a_timing_is_reported_and_fails_only_past_a_stated_tolerance(tmp_path):
    base = _write(tmp_path / "base", BASE)
    run = _write(tmp_path / "run", _planted(runs__0__median_step_ms=10.8))
    quiet = _cli("compare", str(run), "--baseline", str(base))
    assert quiet.returncode == 0 and "1 timing(s) moved" in quiet.stdout, quiet.stdout + quiet.stderr
    assert _cli("compare", str(run), "--baseline", str(base), "--timings", "0.1").returncode == 0  # 8% < 10%
    strict = _cli("compare", str(run), "--baseline", str(base), "--timings", "0.05")
    assert strict.returncode == 1 and "moved timing runs/0/median_step_ms: 10.0 -> 10.8" in strict.stdout


def test_removed_metrics_and_labs_regress_added_ones_are_reported():
    removed = _planted()
    del removed["lab"]["bytes_per_step"]
    c = compare(BASE, removed)
    assert c.regressed and [(ch.path, ch.what) for ch in c.changes] == [("bytes_per_step", "removed")]
    added = _planted(new_metric=7)
    c = compare(BASE, added)
    assert not c.regressed and [(ch.path, ch.what) for ch in c.changes] == [("new_metric", "added")]
    assert compare(BASE, {}).regressed and not compare({}, BASE).regressed  # a lab missing / a new lab


def test_floats_from_another_machine_are_reported_and_counts_held_exactly():
    c = compare(BASE, _planted(environment__threads=8, loss=[4.0, 3.5, 3.3]))
    assert not c.regressed and ("loss", "other machine", "moved") in [(ch.path, ch.kind, ch.what) for ch in c.changes]
    assert "1 float(s) moved, reported, not held" in "\n".join(summary(c))
    assert compare(BASE, _planted(environment__threads=8, bytes_per_step=1025)).regressed
    assert compare(BASE, _planted(loss=[4.0, 3.5, 3.2500001])).regressed  # on the same machine: exactly
    # a torch upgrade alone is context: it is reported, and what moved with it is judged as usual
    c = compare(BASE, _planted(environment__torch="2.14.0"))
    assert not c.regressed and [(ch.kind, ch.what) for ch in c.changes] == [("context", "moved")]


@pytest.mark.parametrize("args, words", [
    (["compare", "/nonexistent/run"], "no <lab>.metrics.json"),
    (["compare", "tests", "--baseline", "tests"], "no <lab>.metrics.json"),
    (["compare", str(BASELINE_DIR / "ci"), "--timings", "-1"], "--timings -1.0"),
    (["baseline", str(BASELINE_DIR / "ci"), "--profile", "gpu", "--to", "/tmp/x"], "not run with --profile gpu"),
])
def test_bad_input_is_one_line_and_exit_2(args, words):
    proc = _cli(*args)
    assert proc.returncode == 2 and words in proc.stderr and "Traceback" not in proc.stderr, proc.stderr
    assert len(proc.stderr.strip().splitlines()) <= 2  # argparse's usage line and the error


def test_a_baseline_is_made_from_a_run_of_its_profile(tmp_path):
    run = _write(tmp_path / "run", BASE)
    to = tmp_path / "baseline" / "ci"
    assert [p.name for p in make_baseline(run, "ci", to)] == ["lab.metrics.json"]
    assert load_metrics(to) == BASE
    shutil.copy(to / "lab.metrics.json", to / "other.metrics.json")  # the baseline has a lab the run lacks
    with pytest.raises(ValueError, match="no metrics for \\['other'\\]"):
        make_baseline(run, "ci", to)


def test_the_committed_baseline_is_the_ci_profile_of_every_lab():
    from labkit.labs import list_labs

    base = load_metrics(BASELINE_DIR / "ci")
    assert sorted(base) == list_labs() and {m["profile"] for m in base.values()} == {"ci"}
    assert all("environment" in m for m in base.values())
