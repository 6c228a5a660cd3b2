"""Every flag of every command line, given what people and scripts pass by accident: NaN, infinities,
negative and huge numbers, an empty string (an unset variable), a superscript digit, a word, a
directory and a FIFO where a file goes. Each is taken (and then sane: finite, within range) or
refused in one line naming its flag, exit status 2; never a traceback, never a hang (issue 29).

What each command does with a value it takes is not run here: the training run, the lab or the
benchmark is replaced by a stub once every check before it has passed.
"""
from __future__ import annotations

import math
import os
from dataclasses import fields

import pytest

HOSTILE = ["nan", "inf", "-inf", "-1", "0", "1e300", "1e400", str(10**30), str(10**400), "", "²", "x", "DIR",
           "FIFO"]


@pytest.fixture(scope="module")
def paths(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("fuzz")
    os.mkfifo(root / "fifo")  # opened for reading, it would block for ever
    return {"DIR": str(root), "FIFO": str(root / "fifo")}


@pytest.fixture(autouse=True)
def elsewhere(tmp_path, monkeypatch):
    """A taken output folder ("nan", "x", ...) is made where the test runs: not in the checkout."""
    monkeypatch.chdir(tmp_path)


def _value_flags(parser) -> list[str]:
    """The long flags that take a value (not --help, not switches)."""
    return sorted(a.option_strings[-1] for a in parser._actions
                  if a.option_strings and a.option_strings[-1].startswith("--") and a.nargs != 0
                  and a.help != "==SUPPRESS==")


def _taken_or_one_line(capsys, run, argv: list[str]) -> bool:
    """True when ``run(argv)`` took the values, False when it refused them in one line (exit 2)."""
    try:
        run(argv)
    except SystemExit as e:
        err = capsys.readouterr().err.strip()
        assert e.code == 2 and len(err.splitlines()) == 1 and ": error: " in err, (argv, e.code, err[-800:])
        return False
    capsys.readouterr()
    return True


def _sane(obj) -> None:
    for f in fields(obj):
        v = getattr(obj, f.name)
        if isinstance(v, float):
            assert math.isfinite(v), (f.name, v)


def test_every_train_flag_takes_or_refuses_each_hostile_value(capsys, paths):
    from labkit.core.model import GPTConfig
    from labkit.train.cli import build_parser, configs_from
    from labkit.train.feasible import check_fits

    def checked(argv):  # what main checks before it trains
        tc, mc = configs_from(argv)
        try:
            check_fits(tc, mc, 1, 1)
        except ValueError as e:  # main turns this into the parser's one line
            build_parser().error(str(e))
        _sane(tc), _sane(mc)
        assert isinstance(mc, GPTConfig)

    for flag in _value_flags(build_parser()):
        for value in HOSTILE:
            _taken_or_one_line(capsys, checked, ["--steps", "1", flag, paths.get(value, value)])


def test_every_memory_flag_takes_or_refuses_each_hostile_value(capsys, paths):
    from labkit.planning.cli import build_parser, main

    for flag in _value_flags(build_parser()):
        for value in HOSTILE:
            _taken_or_one_line(capsys, main, [flag, paths.get(value, value)])


class _Started(Exception):
    """A command got past every check: where it would start its work."""


def _until_started(run):
    def call(argv):
        try:
            run(argv)
        except _Started:
            pass
    return call


def test_every_comm_bench_flag_takes_or_refuses_each_hostile_value(capsys, paths, monkeypatch):
    import labkit.comm.bench as bench

    for k, v in {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1"}.items():
        monkeypatch.setenv(k, v)  # as torchrun sets them: the variables' and the buffers' checks run too

    def started(*args):
        raise _Started

    monkeypatch.setattr(bench, "rank_device", started)
    for flag in _value_flags(bench._parser()):
        for value in HOSTILE:
            _taken_or_one_line(capsys, _until_started(bench.main), [flag, paths.get(value, value)])


def test_every_lab_parameter_takes_or_refuses_each_hostile_value(capsys, paths, monkeypatch):
    import labkit.labs.cli as cli
    from labkit.labs.profiles import PROFILES

    ran = []
    monkeypatch.setattr(cli, "run_labs", lambda *a, **kw: ran.append(kw["overrides"]))
    for key in PROFILES["data_parallel"]["ci"]:
        for value in HOSTILE:
            if _taken_or_one_line(capsys, cli.main, ["run", "data_parallel", "-p", key, paths.get(value, value)]):
                assert all(not isinstance(v, float) or math.isfinite(v) for v in ran[-1].values()), (key, value)


def test_every_planner_flag_takes_or_refuses_each_hostile_value(capsys, paths, monkeypatch):
    import labkit.planning.plan_cli as plan_cli

    monkeypatch.setattr(plan_cli, "search", lambda *a, **kw: [])  # a taken value: no layouts, no search
    for flag in _value_flags(plan_cli.build_parser()):
        for value in HOSTILE:
            _taken_or_one_line(capsys, plan_cli.main, [flag, paths.get(value, value)])


def test_every_gpu_check_flag_takes_or_refuses_each_hostile_value(capsys, paths):
    from labkit.labs.gpu_check import _parser, _setting

    ap = _parser()
    for flag in _value_flags(ap):
        for value in HOSTILE:
            _taken_or_one_line(capsys, lambda argv: _setting(ap, ap.parse_args(argv)),
                               ["--device", "cpu", flag, paths.get(value, value)])


def test_every_assignments_flag_takes_or_refuses_each_hostile_value(capsys, paths, monkeypatch):
    import labkit.labs.assignments as assignments

    monkeypatch.setattr(assignments, "write_sources", lambda labs, course: [course / lab for lab in labs])
    for value in HOSTILE:
        for argv in (["memory", "--course", paths.get(value, value)], [paths.get(value, value), "--course", "."]):
            _taken_or_one_line(capsys, assignments.main, [*argv, "--source-only"])


def test_every_hub_flag_takes_or_refuses_each_hostile_value(capsys, paths, monkeypatch):
    import labkit.labs.hub as hub

    monkeypatch.setattr(hub, "serve", lambda state, settings: None)  # a taken value starts no hub
    monkeypatch.setattr(hub, "add_users", lambda *a: None)  # nor makes a user
    ap_flags = ["--state", "--ip", "--port", "--gpus", "--cpus", "--memory"]
    state = ["--state", "state"]  # in the test's folder, not the default /srv/labkit-hub on this machine
    for value in HOSTILE:
        v = paths.get(value, value)
        for flag in ap_flags:
            _taken_or_one_line(capsys, hub.main, ["serve", *state, flag, v])
        _taken_or_one_line(capsys, hub.main, ["add", *state, "--role", "student", "--", v])
