"""A resume meets what changed: a new learning rate is applied and noted, another precision or
schedule is refused naming it; empty and unwritable output paths are refused before the first step."""
from __future__ import annotations

import os
from unittest import mock

import pytest

from labkit.core.model import GPTConfig
from labkit.train import TrainConfig, train

MODEL = GPTConfig(n_layer=1, n_head=2, n_embd=16, block_size=16)


def _refused(main, argv: list[str], message: str, capsys) -> None:
    """``main(argv)`` exits 2 with ``message`` on stderr, before any work."""
    with pytest.raises(SystemExit) as stop:
        main(argv)
    err = capsys.readouterr().err
    assert stop.value.code == 2 and message in err, err[-1500:]


def test_a_resume_applies_a_new_learning_rate_and_refuses_another_schedule(tmp_path):
    base = dict(steps=4, batch_size=4, save_every=2, checkpoint_dir=str(tmp_path), seed=0)
    train(TrainConfig(**base, lr=3e-3), MODEL)
    more = train(TrainConfig(**{**base, "steps": 6}, lr=1e-3), MODEL)
    assert more["start_step"] == 4
    assert any("lr changed from 0.003 to 0.001 at resume: applied" in n for n in more["resume_notes"])
    with pytest.raises(ValueError, match="lr_schedule='constant' but this run has lr_schedule='cosine'"):
        train(TrainConfig(**{**base, "steps": 8}, lr=1e-3, lr_schedule="cosine"), MODEL)


def test_a_resume_at_another_precision_is_refused_naming_it(tmp_path):
    base = dict(steps=2, batch_size=4, save_every=2, checkpoint_dir=str(tmp_path), seed=0)
    train(TrainConfig(**base), MODEL)
    with pytest.raises(ValueError, match="precision='fp32' but this run has precision='bf16'"):
        train(TrainConfig(**{**base, "steps": 4}, precision="bf16"), MODEL)


@pytest.mark.parametrize("async_save", [False, True])
def test_a_failed_train_leaves_its_checkpoint_directory_unlocked(tmp_path, monkeypatch, async_save):
    """A notebook keeps the failed call's frames; the next run in the same kernel must not find the
    directory locked by this process (issue 29, item 3), once a save in flight is published."""
    import threading

    import labkit.train.loop as loop
    from labkit.fault_tolerance import Checkpointer

    real, calls = loop.train_step, []

    def fails_on_the_third(*args):
        calls.append(1)
        if len(calls) == 3:
            raise RuntimeError("a bad batch")
        return real(*args)

    monkeypatch.setattr(loop, "train_step", fails_on_the_third)
    kept = {}
    with pytest.raises(RuntimeError, match="a bad batch") as failed:
        train(TrainConfig(steps=4, batch_size=4, save_every=1, checkpoint_dir=str(tmp_path), seed=0,
                          async_save=async_save), MODEL)
    kept["traceback"] = failed.tb  # the frames, and the Checkpointer in them, stay alive
    for t in threading.enumerate():  # an async save in flight: its lock goes once it is published
        if t.name == "labkit-checkpoint-close":
            t.join(timeout=120)
    with Checkpointer(tmp_path) as again:
        assert again.steps() == [1, 2]


def test_a_resume_at_the_same_learning_rate_has_no_note(tmp_path):
    base = dict(steps=2, batch_size=4, save_every=2, checkpoint_dir=str(tmp_path), seed=0)
    train(TrainConfig(**base), MODEL)
    again = train(TrainConfig(**{**base, "steps": 4}), MODEL)
    assert not [n for n in again["resume_notes"] if n.startswith("lr changed")]


@pytest.mark.parametrize("flags, message", [
    (["--checkpoint-dir", ""], "--checkpoint-dir='' is empty"),
    (["--metrics", ""], "--metrics='' is empty"),
    (["--step-log", ""], "--step-log='' is empty"),
    (["--metrics", "/dev/full"], "is not a regular file"),
    (["--metrics", "TMP"], "is not a regular file"),
    (["--metrics", "TMP/" + "x" * 300], "cannot be written"),
])
def test_output_paths_are_checked_before_the_first_step(flags, message, tmp_path, capsys):
    from labkit.train.cli import main

    _refused(main, ["--steps", "2", *[f.replace("TMP", str(tmp_path)) for f in flags]], message, capsys)


@pytest.mark.parametrize("module, argv, message", [
    ("labkit.labs.gpu_check", ["--device", "cpu", "--only", "environment", "--out", "FILE"], "is a file, not a folder"),
    ("labkit.comm.bench", ["--json", "TMP"], "is not a regular file"),
    ("labkit.labs.cli", ["run", "data_parallel", "--out", "FILE"], "is a file, not a folder"),
])
def test_every_command_checks_its_output_path_first(module, argv, message, tmp_path, capsys):
    import importlib

    (tmp_path / "file").write_text("keep me")
    argv = [a.replace("FILE", str(tmp_path / "file")).replace("TMP", str(tmp_path)) for a in argv]
    with mock.patch.dict(os.environ):  # gpu_check sets PYTHONPATH for its children: not for this worker's
        _refused(importlib.import_module(module).main, argv, message, capsys)
    assert (tmp_path / "file").read_text() == "keep me"


@pytest.mark.parametrize("env, message", [
    ({"RANK": "0"}, "WORLD_SIZE is not set but RANK is"),
    ({"RANK": "0", "WORLD_SIZE": "0"}, "WORLD_SIZE=0 must be at least 1"),
    ({"RANK": "5", "WORLD_SIZE": "2"}, "RANK=5 is outside WORLD_SIZE=2"),
    ({"RANK": "0", "WORLD_SIZE": "abc"}, "WORLD_SIZE='abc' must be a whole number"),
    ({"RANK": "0", "WORLD_SIZE": "1", "LABKIT_THREADS": "two"}, "LABKIT_THREADS='two' must be a whole number"),
    ({"RANK": "0", "WORLD_SIZE": "1", "LABKIT_THREADS": "0"}, "LABKIT_THREADS=0 must be at least 1"),
    ({"LABKIT_PROGRESS": "yes"}, "LABKIT_PROGRESS='yes' must be 1"),
])
def test_torchrun_variables_are_checked_and_named(env, message, monkeypatch, capsys):
    from labkit.train.cli import main

    for k, v in env.items():
        monkeypatch.setenv(k, v)
    _refused(main, ["--steps", "1"], message, capsys)


@pytest.mark.parametrize("flags, message", [
    (["--vocab-size", "10"], "--vocab-size=10 is too small for this corpus"),
    (["--input-delay-ms", "1e300"], "is over an hour per batch"),
    (["--seed", str(2 ** 63)], "--seed=9223372036854775808 is too large"),
    (["--n-layer", "100000000"], "this run needs at least"),
    (["--n-embd", "1000000", "--n-head", "1"], "this run needs at least"),
])
def test_impossible_runs_are_refused_in_one_line(flags, message, capsys):
    from labkit.train.cli import main

    _refused(main, ["--steps", "1", *flags], message, capsys)
