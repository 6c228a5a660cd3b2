"""The labs' graded exercises: nbgrader releases them and autogrades them, headless, from a gradebook.

The labs are split over two temporary course directories that grade side by side (one core each),
with the committed ``course/nbgrader_config.py``. In each, ``nbgrader generate_assignment`` releases
the labs, then one ``nbgrader autograde`` grades three submissions of every lab: the instructor's
own notebook, the unanswered student version, and a planted bug from ``tests/planted_bugs/``. A
last call, with a short cell timeout, grades a syntax error and an infinite loop. Scores come from
nbgrader's sqlite gradebook: ``nbgrader validate`` exits 0 even when tests fail.
"""
from __future__ import annotations

import json
import re
import shutil
import time
from pathlib import Path

import nbformat
import pytest

from labkit.course.assignments import BOOK_ONLY, COURSE_DIR, exercise_cells, generate, main, nbgrader, source_notebook
from labkit.labs import LABS_DIR, list_labs

LABS = list_labs()
PLANTED = Path(__file__).parent / "planted_bugs"
STUDENTS = ("instructor", "unsolved", "planted")
LOOP_TIMEOUT_S = 3
TAMPERED = "mem_zero_bytes_figure1"  # a locked test cell of the memory lab's exercise
# The unanswered version of the labs whose exercises start ranks or train (36, 24 and 18 s each to
# grade) is left out: what it shows (stubs score zero, the rest of the notebook runs) is the same
# code path in every lab, and the planted bug and the instructor's version still grade every lab.
UNSOLVED_SKIPPED = {"data_parallel", "activation_checkpointing", "zero_fsdp"}


def planted_solutions(lab: str) -> dict[str, str]:
    """grade_id -> replacement source of that solution cell, from tests/planted_bugs/<lab>.py."""
    parts = re.split(r"^# -- grade_id: (\S+) --\n", (PLANTED / f"{lab}.py").read_text(), flags=re.M)
    return {gid: src.strip() + "\n" for gid, src in zip(parts[1::2], parts[2::2])}


def _solution_ids(nb) -> list[str]:
    return [c.metadata["nbgrader"]["grade_id"] for c in nb.cells
            if c.cell_type == "code" and c.metadata.get("nbgrader", {}).get("solution")]


def _with_solutions(nb, sources: dict[str, str]):
    nb = nbformat.from_dict(json.loads(json.dumps(nb)))
    for c in nb.cells:
        gid = c.metadata.get("nbgrader", {}).get("grade_id")
        if gid in sources:
            c.source = sources[gid]
    return nb


def _submit(course: Path, student: str, lab: str, nb) -> None:
    path = course / "submitted" / student / lab / f"{lab}.ipynb"
    path.parent.mkdir(parents=True, exist_ok=True)
    nbformat.write(nb, path)


# Rough seconds to autograde a lab's three submissions here (each notebook is a fresh kernel; torch
# imports and data_parallel's two ranks dominate). Only used to split the labs over two nbgrader
# processes that run side by side, one per core.
COST = {"data_parallel": 24, "activation_checkpointing": 16, "zero_fsdp": 12, "input_pipeline": 12,  # two submissions
        "tensor_parallel": 12, "pipeline_parallel": 12, "finetuning": 12, "memory": 5 + 12}  # + the bad-input run


def _split(labs: list[str]) -> list[list[str]]:
    groups: list[list[str]] = [[], []]
    for lab in sorted(labs, key=lambda lab: -COST.get(lab, 5)):
        min(groups, key=lambda g: sum(COST.get(x, 5) for x in g)).append(lab)
    return [g for g in groups if g]


def _autograde(course: Path, *args: str) -> str:
    """``nbgrader autograde ARGS``, its log. Each kernel runs in the course's sandbox and talks to
    nbgrader over unix sockets (labkit/course/sandbox.py): two graders side by side race for no port."""
    return nbgrader(course, "autograde", *args)


def _grade(course: Path, labs: list[str]) -> dict:
    """Release ``labs`` in ``course``, submit three versions of each, autograde them in one call."""
    shutil.copy(COURSE_DIR / "nbgrader_config.py", course)  # the committed config, as instructors get it
    t0 = time.perf_counter()
    generate(labs, course)
    for lab in labs:
        release = nbformat.read(course / "release" / lab / f"{lab}.ipynb", as_version=4)
        _submit(course, "instructor", lab, nbformat.read(course / "source" / lab / f"{lab}.ipynb", as_version=4))
        if lab not in UNSOLVED_SKIPPED:
            _submit(course, "unsolved", lab, release)
        _submit(course, "planted", lab, _with_solutions(release, planted_solutions(lab)))
    logs = {"graded": _autograde(course, "*", "--ExecutePreprocessor.timeout=300")}
    times = {"graded": time.perf_counter() - t0}
    if "memory" in labs:  # bad input: a syntax error, and a loop that never ends
        release = nbformat.read(course / "release" / "memory" / "memory.ipynb", as_version=4)
        (gid,) = _solution_ids(release)
        _submit(course, "bad_syntax", "memory", _with_solutions(
            release, {gid: "def zero_bytes_per_device(n_params, world_size, stage, k=12)\n    return 0\n"}))
        _submit(course, "bad_loop", "memory", _with_solutions(
            release, {gid: "def zero_bytes_per_device(n_params, world_size, stage, k=12):\n"
                           "    while True:\n        pass\n"}))
        tampered = nbformat.from_dict(json.loads(json.dumps(release)))  # a visible test edited into passing
        (test,) = [c for c in tampered.cells if c.metadata.get("nbgrader", {}).get("grade_id") == TAMPERED]
        test.source = "pass\n"
        _submit(course, "bad_tampered", "memory", tampered)
        t0 = time.perf_counter()
        logs["bad"] = _autograde(course, "memory", "--CourseDirectory.student_id=bad_*",
                                 f"--ExecutePreprocessor.timeout={LOOP_TIMEOUT_S}")
        times["bad"] = time.perf_counter() - t0
    return {"times": times, "logs": logs}


@pytest.fixture(scope="module")
def graded(tmp_path_factory, grading_sandbox) -> dict:
    from concurrent.futures import ThreadPoolExecutor

    from nbgrader.api import Gradebook

    groups = _split(LABS)
    courses = [tmp_path_factory.mktemp(f"course{i}") for i in range(len(groups))]
    with ThreadPoolExecutor(len(groups)) as pool:
        runs = list(pool.map(_grade, courses, groups))
    times = [r["times"] for r in runs]
    scores: dict = {}
    course_of = {lab: course for course, labs in zip(courses, groups) for lab in labs}
    for course, labs in zip(courses, groups):
        with Gradebook(f"sqlite:///{course / 'gradebook.db'}") as gb:
            for student in (*STUDENTS, "bad_syntax", "bad_loop", "bad_tampered"):
                for lab in labs if student in STUDENTS else {"memory"} & set(labs):
                    if student == "unsolved" and lab in UNSOLVED_SKIPPED:
                        continue
                    sub = gb.find_submission(lab, student)
                    nb = gb.find_submission_notebook(lab, lab, student)
                    scores[student, lab] = dict(score=sub.score, max_score=sub.max_score,
                                                cells={g.name: (g.score, g.max_score) for g in nb.grades})
    print("\n" + "; ".join(f"{' '.join(g)}: " + ", ".join(f"{k} {v:.1f} s" for k, v in t.items())
                           for g, t in zip(groups, times)))
    return dict(course_of=course_of, scores=scores, logs=[r["logs"] for r in runs])


def _autograded(course: Path, student: str, lab: str):
    return nbformat.read(course / "autograded" / student / lab / f"{lab}.ipynb", as_version=4)


def _errors(cell) -> list[str]:
    return [o.ename for o in cell.get("outputs", []) if o.output_type == "error"]


def test_every_lab_has_a_graded_exercise_and_a_planted_bug():
    for lab in LABS:
        nb = source_notebook(lab)
        meta = [c.metadata["nbgrader"] for c in nb.cells if c.cell_type == "code"]
        assert sum(m.get("points", 0) for m in meta if m["grade"]) >= 2, lab
        assert any("### BEGIN HIDDEN TESTS" in c.source for c in nb.cells), f"{lab}: no hidden tests"
        assert all(m["locked"] for m in meta if m["grade"]), f"{lab}: autograder tests must be locked"
        assert "hide-input" not in str(nb), f"{lab}: book-only tags leaked into the assignment"
        assert set(planted_solutions(lab)) == set(_solution_ids(nb)), f"{lab}: one planted bug per solution cell"


def _directives(cells) -> list[tuple[str, str, str, int]]:
    """(name, argument, options, cell index) of every sphinx-exercise gated directive in ``cells``."""
    pattern = r"^```\{((?:exercise|solution)-(?:start|end))\}[ \t]*(.*)\n((?::.*\n)*)"
    return [(m[1], m[2].strip(), m[3], i) for i, c in enumerate(cells) if c.cell_type == "markdown"
            for m in re.finditer(pattern, c.source + "\n", flags=re.M)]


def test_book_frames_the_statement_and_collapses_only_the_solution():
    import jupytext

    for lab in LABS:
        cells = jupytext.read(LABS_DIR / f"{lab}.md").cells
        tags = [c.metadata.get("tags", []) for c in cells]
        found = _directives(cells)
        names = [d[0] for d in found]
        assert names and names == ["exercise-start", "exercise-end", "solution-start", "solution-end"] * (len(names) // 4), (lab, names)
        in_solution: set[int] = set()
        for n, ((_, _, ex_opts, a), (_, _, _, b), (_, target, sol_opts, c), (_, _, _, d)) in enumerate(zip(*[iter(found)] * 4)):
            label = re.search(r"^:label: (\S+)$", ex_opts, flags=re.M)
            assert label and target == label[1], (lab, ex_opts, target)  # the solution names its exercise
            assert n or label[1] == f"lab-{lab}-exercise", (lab, label[1])  # tests/test_book.py finds it by this id
            assert ":class: dropdown\n" in sol_opts, (lab, sol_opts)
            assert all(tags[i] == [BOOK_ONLY] for i in (a, b, c, d)), lab  # never in a student's notebook
            statement = range(a + 1, b)
            assert statement and all(cells[i].cell_type == "markdown" and "exercise" in tags[i] for i in statement), lab
            in_solution.update(range(c + 1, d))
        solutions = {i for i, c in enumerate(cells) if c.metadata.get("nbgrader", {}).get("solution")}
        assert solutions and in_solution == solutions, (lab, solutions, in_solution)
        assert not any("hide-input" in tags[i] for i in solutions), f"{lab}: the dropdown already collapses it"
        tests = [i for i, c in enumerate(cells) if c.metadata.get("nbgrader", {}).get("grade")]
        assert tests and all(i not in in_solution and "hide-input" in tags[i] for i in tests), \
            f"{lab}: tests go after the solution dropdown, collapsed by hide-input"
        nb = source_notebook(lab)
        assert BOOK_ONLY not in str(nb) and not _directives(nb.cells), f"{lab}: book markup in the assignment"


def test_book_only_cells_are_dropped_and_directives_in_exercise_cells_are_named(tmp_path):
    solution = ("```{code-cell} ipython3\n---\nnbgrader: {grade: false, grade_id: s, locked: false, "
                "schema_version: 3, solution: true, task: false}\ntags: [exercise]\n---\n"
                "def f():\n    ### BEGIN SOLUTION\n    return 1\n    ### END SOLUTION\n```\n\n"
                "```{code-cell} ipython3\n---\nnbgrader: {grade: true, grade_id: t, locked: true, points: 1, "
                "schema_version: 3, solution: false, task: false}\ntags: [exercise]\n---\nassert f() == 1\n```\n")
    start = "```{solution-start} ex\n:class: dropdown\n```\n\n"
    (tmp_path / "ok.md").write_text(f"# Lab: ok\n\n+++ {{\"tags\": [\"exercise\", \"book-only\"]}}\n\n{start}{solution}")
    assert [c.cell_type for c in exercise_cells("ok", tmp_path)] == ["code", "code"]
    (tmp_path / "bad.md").write_text(f"# Lab: bad\n\n+++ {{\"tags\": [\"exercise\"]}}\n\nDo it.\n\n{start}{solution}")
    with pytest.raises(ValueError, match="markdown cell tagged 'exercise' holds a sphinx-exercise directive"):
        exercise_cells("bad", tmp_path)

def test_release_has_stubs_and_no_solutions_or_hidden_tests(graded):
    for lab in LABS:
        source = nbformat.read(graded["course_of"][lab] / "source" / lab / f"{lab}.ipynb", as_version=4)
        release = nbformat.read(graded["course_of"][lab] / "release" / lab / f"{lab}.ipynb", as_version=4)
        released = "\n".join(c.source for c in release.cells)
        assert "BEGIN SOLUTION" not in released and "HIDDEN TESTS" not in released, lab
        assert released.count("raise NotImplementedError()") >= len(_solution_ids(source)), lab
        hidden = [line.strip() for c in source.cells
                  for block in re.findall(r"### BEGIN HIDDEN TESTS\n(.*?)### END HIDDEN TESTS", c.source, flags=re.S)
                  for line in block.splitlines() if len(line.strip()) > 20]
        assert hidden, lab
        leaked = [line for line in hidden if line in released and line not in _visible_lines(source)]
        assert not leaked, (lab, leaked)  # no line of a hidden test reaches the students


def test_feedback_shows_the_score_and_no_hidden_test(graded):
    """nbgrader leaves hidden tests in the feedback by design (jupyter/nbgrader#917); the course's
    config takes them out again, and the failing line out of a traceback (labkit/course/feedback.py)."""
    import html

    for lab in ("memory", "data_parallel"):
        course = graded["course_of"][lab]
        nbgrader(course, "generate_feedback", lab, "--student", "planted", "--force")
        page = html.unescape(re.sub(r"<[^>]+>", "", (course / "feedback" / "planted" / lab / f"{lab}.html").read_text()))
        s = graded["scores"]["planted", lab]
        assert f"Score: {s['score']:g}" in page.replace(".0 ", " ") or f"{s['score']:g} / {s['max_score']:g}" in page
        assert "HIDDEN TESTS" not in page, lab
        source = nbformat.read(course / "source" / lab / f"{lab}.ipynb", as_version=4)
        hidden = {line.strip() for c in source.cells
                  for block in re.findall(r"### BEGIN HIDDEN TESTS\n(.*?)### END HIDDEN TESTS", c.source, flags=re.S)
                  for line in block.splitlines() if len(line.strip()) > 20} - _visible_lines(source)
        assert hidden and not [line for line in hidden if line in page], lab


def _visible_lines(nb) -> set[str]:
    text = "\n".join(re.sub(r"### BEGIN HIDDEN TESTS\n.*?### END HIDDEN TESTS", "", c.source, flags=re.S)
                     for c in nb.cells)
    return {line.strip() for line in text.splitlines()}


def test_instructor_version_scores_full_marks(graded):
    for lab in LABS:
        s = graded["scores"]["instructor", lab]
        assert s["max_score"] > 0 and s["score"] == s["max_score"], (lab, s)
        assert all(score == top for score, top in s["cells"].values()), (lab, s["cells"])


def test_unsolved_version_runs_and_scores_zero(graded):
    for lab in sorted(set(LABS) - UNSOLVED_SKIPPED):
        s = graded["scores"]["unsolved", lab]
        assert s["score"] == 0 and s["max_score"] > 0, (lab, s)
        assert all(score == 0 for score, _ in s["cells"].values()), (lab, s["cells"])
        nb = _autograded(graded["course_of"][lab], "unsolved", lab)
        for c in nb.cells:  # outside the autograder tests, nothing failed: only the exercise is missing
            if c.cell_type == "code" and not c.metadata.get("nbgrader", {}).get("grade"):
                assert not _errors(c), (lab, c.source[:80], _errors(c))
        assert any(_errors(c) for c in nb.cells if c.cell_type == "code"), lab


def test_planted_bug_scores_less_than_full(graded):
    for lab in LABS:
        s = graded["scores"]["planted", lab]
        assert 0 <= s["score"] < s["max_score"], (lab, s)


def test_syntax_error_and_infinite_loop_are_graded_zero_not_a_crash(graded):
    for student, expect in (("bad_syntax", "SyntaxError"), ("bad_loop", "CellTimeoutError|KeyboardInterrupt")):
        s = graded["scores"][student, "memory"]
        assert s["score"] == 0 and s["max_score"] > 0, (student, s)
        nb = _autograded(graded["course_of"]["memory"], student, "memory")
        names = [e for c in nb.cells if c.cell_type == "code" for e in _errors(c)]
        assert any(re.fullmatch(expect, e) for e in names), (student, names)
        if student == "bad_loop":  # the two test cells that call the looping function time out, and no other
            calls = [c for c in nb.cells if c.cell_type == "code" and "zero_bytes_per_device(" in c.source
                     and "def zero_bytes_per_device" not in c.source]
            timed_out = [c for c in nb.cells
                         if c.cell_type == "code" and any(re.fullmatch(expect, e) for e in _errors(c))]
            assert len(calls) == 2 and timed_out == calls, ([c.source[:80] for c in timed_out], names)


def test_untouched_and_wrong_submissions_grade_without_a_warning_and_tampering_shows(graded):
    """An instructor reads a warning in autograde's log as a student's doing: the instructor's, the
    unanswered and the wrong submissions of every lab raise none; an edited test cell is named."""
    for logs in graded["logs"]:
        quiet = logs["graded"]
        assert not re.search(r"WARNING|SAWarning|has changed", quiet), re.findall(r".*(?:WARNING|Warning).*", quiet)
    (bad,) = [logs["bad"] for logs in graded["logs"] if "bad" in logs]
    assert re.findall(r"Attribute 'checksum' for cell (\S+) has changed", bad) == [TAMPERED], bad[-3000:]
    assert graded["scores"]["bad_tampered", "memory"]["score"] == 0  # the test restored, and run


def test_validator_passes_the_instructor_notebook_and_fails_the_students(graded):
    from nbgrader.validator import Validator

    v = Validator()
    v.execute_timeout = 60
    ok = v.validate(str(graded["course_of"]["memory"] / "source" / "memory" / "memory.ipynb"))
    assert not ok.get("failed") and not ok.get("changed"), ok
    bad = v.validate(str(graded["course_of"]["memory"] / "release" / "memory" / "memory.ipynb"))
    assert bad.get("failed"), bad


def test_bad_lab_and_missing_exercise_are_named(tmp_path, capsys):
    with pytest.raises(ValueError, match=re.escape(f"lab='nope' does not exist; valid labs: {LABS}")):
        exercise_cells("nope")
    (tmp_path / "bare.md").write_text("# Lab: bare\n\n```{code-cell} ipython3\nx = 1\n```\n")
    with pytest.raises(ValueError, match="has no cells tagged 'exercise'"):
        exercise_cells("bare", tmp_path)
    with pytest.raises(ValueError, match="has no nbgrader_config.py"):
        nbgrader(tmp_path, "--version")
    for argv, words in ((["nope", "--course", str(tmp_path)], "no such lab(s) ['nope']; valid labs"),
                        (["memory", "--course", ""], "--course='' is empty"),
                        (["memory", "--course", "/proc/nope"], "is not a writable directory")):
        with pytest.raises(SystemExit) as stop:
            main([*argv, "--source-only"])
        err = capsys.readouterr().err
        assert stop.value.code == 2 and words in err and len(err.strip().splitlines()) == 1, (argv, err)
    assert not (tmp_path / "source").exists()


def test_course_config_reads_course_id_and_exchange_from_the_environment(monkeypatch):
    from traitlets.config.loader import PyFileConfigLoader

    monkeypatch.setenv("NBGRADER_EXCHANGE", "/mnt/exchange")
    monkeypatch.setenv("NBGRADER_COURSE_ID", "tas-2026")
    cfg = PyFileConfigLoader("nbgrader_config.py", path=str(COURSE_DIR)).load_config()
    assert cfg.Exchange.root == "/mnt/exchange" and cfg.CourseDirectory.course_id == "tas-2026"
    assert cfg.CourseDirectory.root == str(COURSE_DIR) and cfg.ExecutePreprocessor.timeout > 0
