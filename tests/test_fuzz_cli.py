"""Every flag of every command line, given what people and scripts pass by accident: NaN, infinities,
negative and huge numbers, an empty string (an unset variable), a superscript digit, a word, a
directory and a FIFO where a file goes. Each is taken (and then sane: finite, within range) or
refused in one line, exit status 2; never a traceback, never a hang (issue 29).

Which it must be is written down here, flag by flag (the ``*_TAKES`` tables): a value a table does
not list for its flag must be refused, so a flag that starts to take garbage fails its test, and one
that starts to refuse a valid value fails it too (issue 47).

What each command does with a value it takes is not run here: the training run, the lab or the
benchmark is replaced by a stub once every check before it has passed.
"""
from __future__ import annotations

import math
import os
import re
from dataclasses import dataclass, fields
from typing import Callable

import pytest

BIG, HUGE = str(10**30), str(10**400)  # a 31-digit integer, and one of 401 digits (inf as a float)
HOSTILE = ["nan", "inf", "-inf", "-1", "0", "1e300", "1e400", BIG, HUGE, "", "²", "x", "DIR", "FIFO"]
# What a file or folder may be called: not "" (an unset variable), not HUGE (longer than a name may
# be), not "-inf" (argparse reads it as a flag); a FIFO is neither file nor folder
DIRS = frozenset({"nan", "inf", "-1", "0", "1e300", "1e400", BIG, "²", "x", "DIR"})
FILES = DIRS - {"DIR"}
ZERO = frozenset({"0"})  # where 0 means off, none, or "the default": the only hostile value to take

# -- what each command must take; any other hostile value must be refused in one line ----------------

TRAIN_TAKES = {
    "--checkpoint-dir": DIRS, "--profile-dir": DIRS, "--profile-steps": {""},  # "": no profiling, the default
    # large but harmless: a grace period nothing outlasts, a clip that never bites, a peak no run nears
    "--grace-s": ZERO | {"1e300", BIG}, "--grad-clip": ZERO | {"1e300", BIG}, "--peak-tflops": ZERO | {"1e300", BIG},
    "--weight-decay": ZERO,
    # a degree: -1 takes the ranks the others leave (torchtitan's), 0 leaves it to the strategy
    **dict.fromkeys(["--cp", "--dp-shard", "--ep", "--pp", "--tp"], ZERO | {"-1"}), "--dp-replicate": {"-1"},
    **dict.fromkeys(["--pp-stages-per-rank", "--pp-first-stage-less-layers",
                     "--pp-last-stage-less-layers", "--dropout", "--input-delay-ms", "--link-gbps",
                     "--link-latency-ms", "--reserve-s", "--save-every", "--seed", "--warmup-steps",
                     "--moe-experts", "--moe-aux-weight", "--moe-bias-rate", "--moe-capacity-factor",
                     "--moe-expert-ffn", "--moe-shared", "--moe-groups", "--moe-group-limit"], ZERO),
}
# Flags whose value is only read with another one: fuzzed with it, or nothing of theirs is checked
TRAIN_WITH = {"--profile-dir": ["--profile-steps", "0:1"],
              **{f: ["--moe-experts", "4"] for f in ("--moe-top-k", "--moe-aux-weight", "--moe-bias-rate",
                                                     "--moe-capacity-factor", "--moe-expert-ffn", "--moe-shared",
                                                     "--moe-groups", "--moe-group-limit")}}
MEMORY_TAKES = {"--model": {""}}  # "": the default model (llama2-7b)
MEMORY_WITH = {"--preemptions-per-day": ["--tokens", "1e12"]}  # only the price reads it
COMM_BENCH_TAKES = {"--json": FILES, "--warmup": ZERO,
                    "--step-factor": {BIG, HUGE},  # one size: the smallest
                    "--target-ms": {"1e300", BIG}}  # the calls per size stop at max_iters
LAB_TAKES = {"seed": ZERO, "loss_tol": ZERO}  # data_parallel's ci profile
PLANNER_TAKES = {"--headroom": ZERO, "--model": {""}, "--top": {BIG, HUGE}}  # --top: every layout there is
GPU_CHECK_TAKES = {"--labs": {""}, "--only": {""}, "--strategies": {""}, "--profile": {""},  # "": the default
                   "--out": DIRS}
ASSIGNMENTS_TAKES = {"--course": DIRS}
HUB_TAKES = {"--state": DIRS, "--gpus": ZERO, "USER": {"nan", "inf", "x"}}

# -- taken today, and must not be: (command, flag) -> (values, why) ---------------------------------



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


def _expect(capsys, run, argv: list[str], taken: bool) -> str:
    """``run(argv)`` took the values (returned; its stdout is returned) when ``taken``, else refused
    them: exit status 2 and exactly one line on stderr, argparse's ``prog: error: ...``."""
    try:
        run(argv)
    except SystemExit as e:
        err = capsys.readouterr().err.strip()
        assert not taken, ("refused a value it must take", argv, e.code, err[-800:])
        assert e.code == 2 and len(err.splitlines()) == 1 and ": error: " in err, (argv, e.code, err[-800:])
        return ""
    out = capsys.readouterr().out
    assert taken, ("took a value it must refuse (garbage in, no error)", argv)
    return out


def _sane(obj) -> None:
    for f in fields(obj):
        v = getattr(obj, f.name)
        if isinstance(v, float):
            assert math.isfinite(v), (f.name, v)


@dataclass
class Command:
    takes: dict[str, set[str]]  # flag -> the hostile values it takes
    argv: dict[str, Callable[[str], list[str]]]  # flag -> the command line that gives it a value
    run: Callable[[list[str]], object]
    after: Callable[[str, str, str], None] = lambda flag, value, out: None  # a taken value's further checks


class _Started(Exception):
    """A command got past every check: where it would start its work."""


def _until_started(run):
    def call(argv):
        try:
            run(argv)
        except _Started:
            pass
    return call


def _train(monkeypatch) -> Command:
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

    return Command(TRAIN_TAKES, {f: lambda v, f=f: ["--steps", "1", *TRAIN_WITH.get(f, []), f, v]
                                 for f in _value_flags(build_parser())}, checked)


def _memory(monkeypatch) -> Command:
    from labkit.planning.memory_cli import build_parser, main

    def after(flag, value, out):  # what it prints for a taken value is numbers, not nan or inf
        assert not re.search(r"\b(nan|inf)\b", out), (flag, value, out[-800:])

    return Command(MEMORY_TAKES, {f: lambda v, f=f: [*MEMORY_WITH.get(f, []), f, v] for f in _value_flags(build_parser())},
                   main, after)


def _comm_bench(monkeypatch) -> Command:
    import labkit.comm.bench as bench

    for k, v in {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1"}.items():
        monkeypatch.setenv(k, v)  # as torchrun sets them: the variables' and the buffers' checks run too

    def started(*args):
        raise _Started

    monkeypatch.setattr(bench, "rank_device", started)
    return Command(COMM_BENCH_TAKES, {f: lambda v, f=f: [f, v] for f in _value_flags(bench._parser())},
                   _until_started(bench.main))


def _lab(monkeypatch) -> Command:
    import labkit.labs.cli as cli
    from labkit.labs.profiles import PROFILES

    ran = []
    monkeypatch.setattr(cli, "run_labs", lambda *a, **kw: ran.append(kw["overrides"]))

    def after(key, value, out):
        assert all(not isinstance(v, float) or math.isfinite(v) for v in ran[-1].values()), (key, value)

    return Command(LAB_TAKES, {k: lambda v, k=k: ["run", "data_parallel", "-p", k, v]
                               for k in PROFILES["data_parallel"]["ci"]}, cli.main, after)


def _planner(monkeypatch) -> Command:
    import labkit.planning.layouts_cli as layouts_cli

    monkeypatch.setattr(layouts_cli, "search", lambda *a, **kw: [])  # a taken value: no layouts, no search
    return Command(PLANNER_TAKES, {f: lambda v, f=f: [f, v] for f in _value_flags(layouts_cli.build_parser())},
                   layouts_cli.main)


def _gpu_check(monkeypatch) -> Command:
    from labkit.course.gpu_check import _parser, _setting

    ap = _parser()
    return Command(GPU_CHECK_TAKES, {f: lambda v, f=f: ["--device", "cpu", f, v] for f in _value_flags(ap)},
                   lambda argv: _setting(ap, ap.parse_args(argv)))


def _assignments(monkeypatch) -> Command:
    import labkit.course.assignments as assignments

    monkeypatch.setattr(assignments, "write_sources", lambda labs, course: [course / lab for lab in labs])
    return Command(ASSIGNMENTS_TAKES, {"--course": lambda v: ["memory", "--course", v, "--source-only"],
                                       "LAB": lambda v: [v, "--course", ".", "--source-only"]}, assignments.main)


def _hub(monkeypatch) -> Command:
    import labkit.course.hub as hub

    monkeypatch.setattr(hub, "serve", lambda state, settings: None)  # a taken value starts no hub
    monkeypatch.setattr(hub, "add_users", lambda *a: None)  # nor makes a user
    state = ["--state", "state"]  # in the test's folder, not the default /srv/labkit-hub on this machine
    argv = {f: lambda v, f=f: ["serve", *state, f, v] for f in ["--state", "--ip", "--port", "--gpus", "--cpus", "--memory"]}
    argv["USER"] = lambda v: ["add", *state, "--role", "student", "--", v]
    return Command(HUB_TAKES, argv, hub.main)


COMMANDS = {"train": _train, "memory": _memory, "comm_bench": _comm_bench, "lab": _lab, "planner": _planner,
            "gpu_check": _gpu_check, "assignments": _assignments, "hub": _hub}


@pytest.mark.parametrize("command", list(COMMANDS))
def test_every_flag_takes_or_refuses_each_hostile_value(command, capsys, paths, monkeypatch):
    cmd = COMMANDS[command](monkeypatch)
    assert set(cmd.takes) <= set(cmd.argv), sorted(set(cmd.takes) - set(cmd.argv))  # no table row for a gone flag
    for flag, argv in cmd.argv.items():
        for value in HOSTILE:
            taken = value in cmd.takes.get(flag, ())
            out = _expect(capsys, cmd.run, argv(paths.get(value, value)), taken)
            if taken:
                cmd.after(flag, value, out)

