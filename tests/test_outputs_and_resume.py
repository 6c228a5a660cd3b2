"""A resume meets what changed: a new learning rate, weight decay or warmup is applied and noted,
another precision, schedule, corpus or model is refused naming it; empty and unwritable output paths
are refused before the first step."""
from __future__ import annotations

import json
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


def test_a_resume_applies_a_new_weight_decay_and_notes_it(tmp_path):
    """Issue 43: the optimizer state brought the saved weight decay back, silently."""
    runs = {}
    for wd in (0.0, 0.5):
        base = dict(steps=2, batch_size=4, checkpoint_dir=str(tmp_path / str(wd)), seed=0)
        train(TrainConfig(**base), MODEL)
        runs[wd] = train(TrainConfig(**{**base, "steps": 4}, weight_decay=wd), MODEL)
    assert runs[0.5]["resume_notes"] == ["weight_decay changed from 0 to 0.5 at resume: applied to every "
                                         "parameter group"]
    assert runs[0.0]["resume_notes"] == []
    assert runs[0.5]["loss"][:3] == runs[0.0]["loss"][:3]  # the update of step 2 is the first to decay
    assert abs(runs[0.5]["loss"][3] - runs[0.0]["loss"][3]) > 1e-5


@pytest.mark.parametrize("saved, asked, note", [
    # the schedule is a function of the global step: step 2 takes the new curve's value
    (dict(warmup_steps=4), dict(warmup_steps=8), "warmup_steps changed from 4 to 8 at resume: applied, the "
     "schedule continues from step 2 on the new curve (lr 0.00225 -> 0.001125)"),
    (dict(), dict(warmup_steps=4), "warmup_steps changed from 0 to 4 at resume: applied, the schedule continues "
     "from step 2 on the new curve (lr 0.003 -> 0.00225)"),  # no scheduler was saved
    (dict(warmup_steps=4), dict(), "warmup_steps changed from 4 to 0 at resume: applied, the schedule continues "
     "from step 2 on the new curve (lr 0.00225 -> 0.003)"),  # none now
    (dict(lr_schedule="cosine"), dict(lr_schedule="cosine", steps=6), "steps changed from 2 to 6 at resume: "
     "applied, the schedule continues from step 2 on the new curve (lr 0.0003 -> 0.002325)"),  # cosine's length
    (dict(), dict(grad_clip=0.5), "grad_clip changed from 1 to 0.5 at resume: applied from step 2"),
])
def test_a_resume_with_another_warmup_length_or_clipping_applies_it_with_a_note(tmp_path, saved, asked, note):
    base = dict(batch_size=4, checkpoint_dir=str(tmp_path), seed=0)
    train(TrainConfig(**base, steps=2, **saved), MODEL)
    again = train(TrainConfig(**base, **{"steps": 4, **asked}), MODEL)
    assert again["start_step"] == 2 and again["resume_notes"] == [note]


def test_a_resume_on_another_corpus_or_model_is_refused_in_one_line(tmp_path, capsys):
    from labkit.train.cli import main

    (tmp_path / "a.txt").write_bytes(b"to be or not to be, that is the question. " * 20)
    (tmp_path / "b.txt").write_bytes(b"to be or not to be, that is the question! " * 20)
    (tmp_path / "a_copy.txt").write_bytes((tmp_path / "a.txt").read_bytes())
    run = ["--steps", "2", "--batch-size", "4", "--n-layer", "1", "--n-head", "2", "--n-embd", "16",
           "--block-size", "16", "--dropout", "0.1", "--checkpoint-dir", str(tmp_path / "ck")]
    assert main([*run, "--corpus", str(tmp_path / "a.txt")]) == 0
    for argv, message in [
        (["--corpus", str(tmp_path / "b.txt")], f"saved with --corpus='{tmp_path / 'a.txt'}' (840 bytes, sha256 "),
        ([], "but this run has --corpus=None ("),  # the shipped text
        (["--corpus", str(tmp_path / "a.txt"), "--n-layer", "2"],
         "saved with a model of --n-layer=1 but this run has --n-layer=2: its parameters would not fit"),
    ]:
        with pytest.raises(SystemExit) as stop:
            main([*run, "--steps", "4", *argv])
        err = capsys.readouterr().err
        line = next((x for x in err.splitlines() if message in x), "")  # one line: argparse's error, whole
        assert stop.value.code == 2 and "error: " in line and line.endswith("checkpoint_dir"), err[-1500:]
        assert "Traceback" not in err
    # the same bytes elsewhere are the same data order: resumed, with a note
    out = tmp_path / "m.json"
    assert main([*run, "--steps", "4", "--corpus", str(tmp_path / "a_copy.txt"), "--metrics", str(out)]) == 0
    resumed = json.loads(out.read_text())
    assert len(resumed["resume_notes"]) == 1, resumed["resume_notes"]
    assert resumed["resume_notes"][0].startswith(f"corpus read from '{tmp_path / 'a_copy.txt'}', saved from "
                                                 f"'{tmp_path / 'a.txt'}': the same bytes")
    model = GPTConfig(n_layer=1, n_head=2, n_embd=16, block_size=16, dropout=0.1)
    whole = train(TrainConfig(steps=4, batch_size=4), model, corpus=str(tmp_path / "a.txt"))
    assert resumed["loss"] == whole["loss"]  # a resume as any other: RNG states and all, bit for bit


def test_a_checkpoint_from_before_the_new_settings_resumes_as_before(tmp_path, monkeypatch):
    """Checkpoints whose meta lacks weight_decay, warmup_steps, steps, grad_clip and corpus still resume."""
    from labkit.train import resumable

    real = resumable.Resumable.__init__
    new = ("weight_decay", "grad_clip", "warmup_steps", "steps", "corpus")

    def old_meta(self, cfg, meta, *args, **kwargs):
        real(self, cfg, {k: v for k, v in meta.items() if k not in new}, *args, **kwargs)

    base = dict(batch_size=4, checkpoint_dir=str(tmp_path), seed=0)
    with monkeypatch.context() as m:
        m.setattr(resumable.Resumable, "__init__", old_meta)
        train(TrainConfig(**base, steps=2), MODEL)
    again = train(TrainConfig(**base, steps=4, weight_decay=0.5, warmup_steps=1), MODEL)
    assert again["start_step"] == 2 and again["resume_notes"] == []


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
    ("labkit.course.gpu_check", ["--device", "cpu", "--only", "environment", "--out", "FILE"], "is a file, not a folder"),
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
