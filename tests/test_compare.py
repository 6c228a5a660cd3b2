"""`python -m labkit compare`: a planted change in an exact metric is a regression (exit 1); a timing
that moved is reported, and a regression only past a stated tolerance; the report and its plots are
written; a bad folder or flag is one line with exit status 2. `python -m labkit baseline` refuses a
run of another profile. (tests/test_labs.py holds every CI run's labs against the committed baseline.)"""
from __future__ import annotations

import json
import os
import signal
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from labkit.labs.compare import BASELINE_DIR, compare, flatten, load_metrics, make_baseline, summary
from labkit.labs.compare_report import plot_name
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


# What a folder may hold besides a lab's metrics (issue 43, item 9): each is one line naming the
# parameter (RUN or --baseline) and the file, exit status 2; never a traceback, never a hang.
def _file(data: str | bytes):
    return lambda f: f.write_bytes(data if isinstance(data, bytes) else data.encode())


DEEP = "[" * 100_000 + "]" * 100_000  # past the JSON parser's recursion
NOT_METRICS = [
    ("a list", _file("[]"), "holds a list, not a JSON object"),
    ("a string", _file('"x"'), "holds a string, not a JSON object"),
    ("null", _file("null"), "holds null, not a JSON object"),
    ("a number", _file("5"), "holds a number, not a JSON object"),
    ("deep JSON", _file(DEEP), "nested too deeply"),
    ("JSON parsed but deeper than metrics", _file('{"a":' * 500 + "1" + "}" * 500), "nested too deeply"),
    ("not UTF-8", _file(b"\xff\xfe{}"), "is not JSON"),
    ("empty", _file(""), "is not JSON"),
    ("an integer of 5,000 digits", _file('{"n": ' + "9" * 5000 + "}"), "is not JSON"),
    ("a link loop", lambda f: f.symlink_to(f.name), "cannot be read (Too many levels of symbolic links)"),
    ("a dangling link", lambda f: f.symlink_to("nowhere"), "cannot be read (No such file or directory)"),
    ("a folder", lambda f: f.mkdir(), "is a folder, not a regular file"),
    ("a FIFO", lambda f: os.mkfifo(f), "is a FIFO, not a regular file"),  # opened, it blocks for ever
]


@pytest.fixture
def no_hang():
    """A test that hangs fails instead (an open() of a FIFO blocks in the kernel: the alarm's handler
    raises once the call is interrupted)."""
    def stop(*_):
        raise TimeoutError("hung for 30 s")

    old = signal.signal(signal.SIGALRM, stop)
    signal.alarm(30)
    yield
    signal.alarm(0)
    signal.signal(signal.SIGALRM, old)


def _main(capsys, *args: str) -> tuple[int, str, str]:
    """``python -m labkit ARGS`` in this process: its exit status, stdout and stderr."""
    from labkit.labs.cli import main

    try:
        rc = main(list(args))
    except SystemExit as e:
        rc = e.code
    out, err = capsys.readouterr()
    assert "Traceback" not in err, err
    return rc, out, err


def _one_line(capsys, words: str, *args: str) -> str:
    rc, _, err = _main(capsys, *args)
    assert rc == 2 and len(err.strip().splitlines()) == 1 and words in err, (rc, err[-800:])
    return err


@pytest.mark.parametrize("side", ["RUN", "--baseline"])
@pytest.mark.parametrize("plant, words", [row[1:] for row in NOT_METRICS], ids=[row[0] for row in NOT_METRICS])
def test_a_file_that_is_not_a_labs_metrics_is_one_line(capsys, tmp_path, no_hang, side, plant, words):
    base, run = _write(tmp_path / "base", BASE), _write(tmp_path / "run", BASE)
    bad = (run if side == "RUN" else base) / "other.metrics.json"
    plant(bad)
    err = _one_line(capsys, words, "compare", str(run), "--baseline", str(base))
    assert f"error: {side}: " in err and "other.metrics.json" in err, err
    assert not (run / "compare.md").exists()


@pytest.mark.parametrize("old, new, regressed", [
    (float("nan"), float("nan"), False),  # a NaN that stayed NaN has not changed
    ([4.0, float("nan")], [4.0, float("nan")], False),
    (float("nan"), 3.25, True),
    (3.25, float("nan"), True),
], ids=["NaN", "NaN in a series", "NaN to a number", "a number to NaN"])
@pytest.mark.parametrize("lab, path", [("lab", "loss"), ("fault_tolerance", "state_bytes")], ids=["exact", "close"])
def test_an_unchanged_nan_is_not_a_regression(lab, path, old, new, regressed):
    assert kind_of(lab, path).name == ("exact" if lab == "lab" else "close")
    assert compare({lab: {path: old}}, {lab: {path: new}}).regressed == regressed


@pytest.mark.parametrize("key", ["a\u0000b", "k" * 300, "a$\\frac$|b\nc", "../../escape"],
                         ids=["a NUL", "300 characters", "TeX, a pipe and a newline", "a relative path"])
def test_any_key_is_data_its_plot_a_plain_file_in_the_report_folder(capsys, tmp_path, key):
    base = _write(tmp_path / "base", {"lab": {**BASE["lab"], key: [1.0, 2.0]}})
    run = _write(tmp_path / "run", {"lab": {**BASE["lab"], key: [1.0, float("inf")]}})
    rc, out, _ = _main(capsys, "compare", str(run), "--baseline", str(base))
    assert rc == 1 and "regression" in out
    assert len([line for line in out.splitlines() if line.startswith("  changed")]) == 1, out
    (png,) = (run / "compare").iterdir()
    assert png.name == plot_name("lab", key) and png.name.isascii() and len(png.name) < 130, png.name


@pytest.mark.parametrize("environment", ["x", [1], None, 5])
def test_an_environment_that_is_not_an_object_is_compared_as_data(capsys, tmp_path, environment):
    base = _write(tmp_path / "base", BASE)
    run = _write(tmp_path / "run", {"lab": {**BASE["lab"], "environment": environment}})
    rc, out, _ = _main(capsys, "compare", str(run), "--baseline", str(base))
    assert rc == 1 and out.startswith("lab: 3 regression(s)"), out  # its three values gone: data, not an error


def _moved(tmp_path: Path) -> tuple[Path, Path]:
    """A baseline and a run whose loss moved: a report with one plot."""
    return _write(tmp_path / "base", BASE), _write(tmp_path / "run", _planted(loss=[4.0, 3.5, 3.3]))


@pytest.mark.parametrize("plant, words", [
    (lambda run: (run / "compare.md").mkdir(), "compare.md' is a folder, where the report goes"),
    (lambda run: (run / "compare").write_text("x"), "compare' is not a folder, where the plots go"),
    (lambda run: (run / "compare").symlink_to(run.parent / "elsewhere"), "compare' is a symbolic link"),
], ids=["compare.md a folder", "compare a file", "compare a link"])
def test_a_report_path_that_is_not_a_file_is_one_line_before_any_output(capsys, tmp_path, plant, words):
    base, run = _moved(tmp_path)
    (tmp_path / "elsewhere").mkdir()
    plant(run)
    rc, out, err = _main(capsys, "compare", str(run), "--baseline", str(base))
    assert rc == 2 and len(err.strip().splitlines()) == 1 and words in err and "--report" in err, err
    assert out == "" and not list((tmp_path / "elsewhere").iterdir())


@pytest.mark.parametrize("link", ["compare.md", f"compare/{plot_name('lab', 'loss')}"])
def test_the_report_replaces_a_link_and_does_not_write_through_it(capsys, tmp_path, link):
    base, run = _moved(tmp_path)
    outside = tmp_path / "outside.txt"
    outside.write_text("not yours")
    (run / link).parent.mkdir(exist_ok=True)
    (run / link).symlink_to(outside)
    rc, _, _ = _main(capsys, "compare", str(run), "--baseline", str(base))
    assert rc == 1 and outside.read_text() == "not yours"
    assert not (run / link).is_symlink() and (run / link).stat().st_size > 100


def test_a_new_baseline_replaces_a_link_and_does_not_write_through_it(capsys, tmp_path):
    run, to = _write(tmp_path / "run", BASE), tmp_path / "baseline"
    to.mkdir()
    outside = tmp_path / "outside.txt"
    outside.write_text("not yours")
    (to / "lab.metrics.json").symlink_to(outside)
    rc, _, _ = _main(capsys, "baseline", str(run), "--to", str(to))
    assert rc == 0 and outside.read_text() == "not yours" and load_metrics(to) == BASE


@pytest.mark.parametrize("args, words", [
    (["compare", ""], "RUN='' is empty"),
    (["compare", "RUN", "--baseline", ""], "--baseline='' is empty"),
    (["compare", "RUN", "--report", ""], "--report='' is empty"),
    (["baseline", "RUN", "--to", ""], "--to='' is empty"),
    (["baseline", "RUN", "--to", "RUN/lab.metrics.json"], "lab.metrics.json' is not a folder"),
    (["baseline", "RUN", "--to", "x" * 5000], "(5000 characters) cannot be looked at"),
], ids=["RUN", "--baseline", "--report", "--to", "--to a file", "--to 5,000 characters"])
def test_an_empty_or_odd_folder_name_is_one_line_not_the_working_directory(capsys, tmp_path, monkeypatch, args, words):
    monkeypatch.chdir(_write(tmp_path / "cwd", BASE))  # where '' would land: the working directory
    run = _write(tmp_path / "run", BASE)
    _one_line(capsys, words, *[a.replace("RUN", str(run)) for a in args])
    assert sorted(p.name for p in (tmp_path / "cwd").iterdir()) == ["lab.metrics.json"]
