"""The checkpointer against an attacker and an unlucky user: each case here was run against the old
code and broke it (code ran, checkpoints were lost, or a raw error escaped)."""
import enum
import errno
import os
import pickle
import shutil
import threading
from pathlib import Path

import numpy as np
import pytest
import torch

from ft_rank_fns import Payload, resign
from labkit.fault_tolerance import LOCAL, CheckpointError, Checkpointer
from labkit.fault_tolerance import directory as ckdir


def _state(step: int) -> dict:
    return {"model": {"w": torch.full((256,), float(step))}, "step": step, LOCAL: {"rng": torch.arange(3) + step}}


def _saved(tmp_path, *steps, keep_last=5) -> Checkpointer:
    ck = Checkpointer(tmp_path, keep_last=keep_last)
    for s in steps:
        ck.save(s, _state(s))
    return ck


def _load_quietly(ck, **kw):
    with pytest.warns(UserWarning, match="is unusable"):
        return ck.load_latest(**kw)


# -- 1, 2: code execution and reading outside the checkpoint --
def test_a_symlink_inside_a_checkpoint_is_refused_before_anything_is_read(tmp_path):
    ck = _saved(tmp_path / "c", 1, 2)
    step2 = tmp_path / "c" / "step_00000002"
    outside = tmp_path / "elsewhere"
    outside.mkdir()
    (outside / "optim.pt").write_bytes(pickle.dumps(Payload(str(tmp_path / "pwned"))))
    (step2 / "engine").symlink_to(outside, target_is_directory=True)  # rglob would not look inside
    resign(ck.dir, 2)
    assert any("engine: a symbolic link" in p for p in ck.verify(2))
    step, state = _load_quietly(ck)
    assert step == 1 and not (tmp_path / "pwned").exists()
    (step2 / "engine").unlink()
    os.symlink(outside / "optim.pt", step2 / "rank1.pt")
    assert ck.verify(2) == ["rank1.pt: a symbolic link (a checkpoint holds plain files only)"]


def test_a_symlinked_step_directory_is_refused(tmp_path):
    ck = _saved(tmp_path / "c", 1)
    shutil.copytree(tmp_path / "c" / "step_00000001", tmp_path / "real")
    (tmp_path / "c" / "step_00000005").symlink_to(tmp_path / "real", target_is_directory=True)
    assert ck.verify(5) == ["step_00000005 is a symbolic link (a checkpoint directory must be the directory itself)"]


def test_dcp_metadata_that_points_at_another_step_is_refused(tmp_path):
    ck = _saved(tmp_path / "c", 5, 10)
    md_path = tmp_path / "c" / "step_00000010" / ".metadata"
    md = pickle.loads(md_path.read_bytes())  # the test's own file: trusted here
    for info in md.storage_data.values():
        info.relative_path = "../step_00000005/" + info.relative_path
    md_path.write_bytes(pickle.dumps(md))
    resign(ck.dir, 10)
    assert ck.verify(10) == []  # every file matches the (rewritten) manifest
    step, state = _load_quietly(ck)
    assert step == 5 and torch.equal(state["model"]["w"], torch.full((256,), 5.0))
    assert "which is not a file of this checkpoint" in ck.last_load.skipped[0][1]


# -- 3: saves that succeed but can never load --
class Colour(enum.IntEnum):
    RED = 1


def test_values_that_would_never_load_are_refused_or_converted_exactly_at_save_time(tmp_path):
    ck = Checkpointer(tmp_path)
    ck.save(1, {"losses": [np.float64(2.5), np.float32(0.1)], "name": np.str_("run"), "n": np.int64(7),
                LOCAL: {"seen": np.int32(3), "rng": torch.arange(2)}})
    step, state = ck.load_latest()
    assert state["losses"] == [2.5, float(np.float32(0.1))] and type(state["losses"][0]) is float
    assert state["name"] == "run" and type(state["name"]) is str and state["n"] == 7
    assert state[LOCAL]["seen"] == 3 and type(state[LOCAL]["seen"]) is int
    with pytest.raises(TypeError, match=r"state\['cfg/colour'\] is a test_checkpoint_safety.Colour \(a subclass of "
                                        r"int\): it would save but never load"):
        ck.save(2, {"cfg": {"colour": Colour.RED}})
    with pytest.raises(TypeError, match=r"state\['local/when'\] is a numpy.ndarray"):
        ck.save(2, {LOCAL: {"when": np.zeros(3)}})
    assert ck.steps() == [1]


# -- 4: every checkpoint corrupt --
def test_when_no_checkpoint_verifies_loading_refuses_and_nothing_is_deleted(tmp_path):
    ck = _saved(tmp_path / "c", 10, 20, keep_last=2)
    for s in (10, 20):
        f = tmp_path / "c" / ckdir.step_name(s) / "__0_0.distcp"
        f.write_bytes(b"\0" + f.read_bytes()[1:])
    with pytest.warns(UserWarning), pytest.raises(CheckpointError, match=r"holds 2 checkpoint\(s\) and none is usable: "
                                                  r"step 20: __0_0.distcp: .* step 10: __0_0.distcp: .*Nothing was deleted"):
        ck.load_latest()
    assert _load_quietly(ck, if_unusable="start_over") is None
    ck.save(4, _state(4))  # the deliberate restart, keep_last=2
    assert ck.steps() == [4, 10, 20]  # newer than what was just published: kept for salvage


def test_the_training_loop_stops_on_unusable_checkpoints_unless_told_to_restart(tmp_path):
    from labkit.core.model import GPTConfig
    from labkit.train import TrainConfig, train
    from labkit.train.cli import main

    model = GPTConfig(block_size=16, n_layer=1)
    train(TrainConfig(steps=2, checkpoint_dir=str(tmp_path)), model)
    (tmp_path / "step_00000002" / "rank0.pt").write_bytes(b"torn")
    with pytest.warns(UserWarning), pytest.raises(SystemExit) as e:
        main(["--steps", "3", "--block-size", "16", "--n-layer", "1", "--checkpoint-dir", str(tmp_path)])
    assert e.value.code == 2
    with pytest.warns(UserWarning):
        r = train(TrainConfig(steps=3, checkpoint_dir=str(tmp_path), restart_if_unusable=True), model)
    assert r["start_step"] == 0 and "skipped step 2" in r["resume_notes"][0]


# -- 5: a kill between the two renames of a step saved again --
def test_a_kill_between_the_renames_of_a_resave_keeps_a_copy(tmp_path, monkeypatch):
    ck = _saved(tmp_path, 3)
    real = os.rename

    def killed_at_the_second_rename(src, dst):
        if str(src).endswith(".tmp-step_00000003"):
            raise KeyboardInterrupt  # stands for SIGKILL: nothing after this line runs
        return real(src, dst)

    monkeypatch.setattr(os, "rename", killed_at_the_second_rename)
    with pytest.raises(KeyboardInterrupt):
        ck.save(3, _state(3))
    monkeypatch.undo()
    ck.close()
    assert not (tmp_path / "step_00000003").exists() and (tmp_path / ".old-step_00000003").exists()
    with pytest.warns(UserWarning, match="restored step_00000003"):
        again = Checkpointer(tmp_path)
    assert again.load_latest()[0] == 3 and not any(tmp_path.glob(".tmp-*"))


# -- 6, 7: one writer, and only what it made --
def test_one_writer_per_directory_and_readers_alongside(tmp_path):
    ck = _saved(tmp_path, 1)
    (tmp_path / ".tmp-build").mkdir()  # someone else's, in a shared directory
    (tmp_path / ".tmp-step_00000002").mkdir()  # the writer's save in flight
    with pytest.raises(CheckpointError, match="is in use by another writer .*this process holds it"):
        Checkpointer(tmp_path)
    assert (tmp_path / ".tmp-step_00000002").exists() and (tmp_path / ".tmp-build").exists()
    reader = Checkpointer(tmp_path, readonly=True)
    assert reader.load_latest()[0] == 1
    with pytest.raises(ValueError, match="readonly=True: it cannot save"):
        reader.save(2, _state(2))
    ck.close()
    Checkpointer(tmp_path).close()  # free again; it tidies its own leftovers only
    assert (tmp_path / ".tmp-build").exists() and not (tmp_path / ".tmp-step_00000002").exists()


def test_a_reader_racing_retention_skips_what_vanished(tmp_path, monkeypatch):
    ck = _saved(tmp_path, 1, 2)
    reader = Checkpointer(tmp_path, readonly=True)
    real_verify = ckdir.tree_problems

    def retention_strikes(path):  # the writer retires step 2 just as the reader looks at it
        if path.name == "step_00000002" and path.exists():
            shutil.rmtree(path)
        return real_verify(path)

    monkeypatch.setattr(ckdir, "tree_problems", retention_strikes)
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)  # a retired step is no damage: no "is unusable" warning
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        step, _ = reader.load_latest()
    assert step == 1 and reader.last_load.skipped == [(2, "retired by the writer while it was read")]
    ck.close()


def test_a_reader_sees_a_step_whose_re_save_was_interrupted(tmp_path):
    """Killed between publish's two renames, a re-save leaves step 2's only complete copy as
    .old-step_00000002: a reader loads it there; the next writer puts it back (issue 29, item 4)."""
    ck = _saved(tmp_path, 1, 2)
    ck.close()
    os.rename(tmp_path / "step_00000002", tmp_path / ".old-step_00000002")
    reader = Checkpointer(tmp_path, readonly=True)
    assert reader.steps() == [1, 2] and reader.verify(2) == []
    step, state = reader.load_latest()
    assert step == 2 and reader.last_load.path.endswith(".old-step_00000002")
    with Checkpointer(tmp_path) as writer:  # a writer restores it, under its own name
        assert writer.steps() == [1, 2] and (tmp_path / "step_00000002").is_dir()
    assert reader.load_latest()[0] == 2 and reader.last_load.path.endswith("/step_00000002")


def test_a_lock_file_planted_as_a_symlink_is_not_followed(tmp_path):
    target = tmp_path / "victim"
    target.write_text("keep me")
    (tmp_path / "c").mkdir()
    (tmp_path / "c" / ".lock").symlink_to(target)
    with pytest.raises(CheckpointError, match="Too many levels of symbolic links|ELOOP|symbolic"):
        Checkpointer(tmp_path / "c")
    assert target.read_text() == "keep me"


def test_the_write_probe_never_collides_with_another_process(tmp_path, monkeypatch):
    (tmp_path / f".probe-{os.getpid()}").mkdir()  # another container's rank with our PID, mid-probe
    Checkpointer(tmp_path).close()


# -- 8: names and messages --
def test_names_that_are_not_ours_are_ignored_and_messages_are_true(tmp_path, monkeypatch):
    ck = _saved(tmp_path, 5, keep_last=1)
    (tmp_path / "step_²").mkdir()
    shutil.copytree(tmp_path / "step_00000005", tmp_path / "step_000010")  # a copy by hand
    assert ck.steps() == [5]
    ck.save(6, _state(6))  # retention works (it used to fail with "nothing was published")
    assert ck.steps() == [6] and (tmp_path / "step_000010").exists()
    real = ckdir.write_durably

    def full_disk(path, data):
        if path.name == ".latest.tmp":
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real(path, data)

    monkeypatch.setattr(ckdir, "write_durably", full_disk)
    with pytest.warns(UserWarning, match=r"step 7 was published in .*step_00000007, but updating 'latest'"):
        ck.save(7, _state(7))
    assert 7 in ck.steps()


# -- 9: manifests that lie about their shape, and files that are not files --
@pytest.mark.parametrize("change, why", [
    (lambda m: m.update(files=["rank0.pt"]), "does not have the structure labkit writes"),
    (lambda m: m.update(format=99), "has format 99; this labkit reads format 1"),
    (lambda m: m.update(step=4), "does not have the structure labkit writes"),
    (lambda m: m["files"].update({"rank0.pt": "big"}), "does not have the structure labkit writes"),
])
def test_a_well_checksummed_manifest_of_the_wrong_shape_is_skipped(tmp_path, change, why):
    import json
    import zlib

    ck = _saved(tmp_path, 1, 2)
    path = tmp_path / "step_00000002" / "manifest.json"
    m = json.loads(path.read_bytes().partition(b"\n")[2])
    change(m)
    body = json.dumps(m, sort_keys=True)
    path.write_bytes(f"{zlib.crc32(body.encode()):08x}\n{body}".encode())
    assert why in " ".join(ck.verify(2))
    assert _load_quietly(ck)[0] == 1


def test_damaged_tensor_data_behind_a_rewritten_manifest_is_skipped_not_raised(tmp_path):
    ck = _saved(tmp_path, 1, 2)
    f = tmp_path / "step_00000002" / "__0_0.distcp"
    f.write_bytes(f.read_bytes()[:40])  # truncated: DCP raises its CheckpointException (a BaseException)
    resign(ck.dir, 2)
    step, state = _load_quietly(ck)
    assert step == 1 and torch.equal(state["model"]["w"], torch.full((256,), 1.0))


def test_a_fifo_named_like_a_checkpoint_file_does_not_hang_the_loader(tmp_path):
    ck = _saved(tmp_path, 1, 2)
    manifest = tmp_path / "step_00000002" / "manifest.json"
    manifest.unlink()
    os.mkfifo(manifest)
    os.mkfifo(tmp_path / "step_00000001" / "rank5.pt")
    out = {}
    t = threading.Thread(target=lambda: out.update(p2=ck.verify(2), p1=ck.verify(1)), daemon=True)
    t.start()
    t.join(timeout=20)
    assert not t.is_alive(), "a FIFO blocked the loader"
    assert out["p2"] == ["manifest.json: not a regular file"]
    assert out["p1"] == ["rank5.pt: not a regular file"]


def test_the_lock_is_released_when_its_writer_closes(tmp_path):
    from labkit.fault_tolerance.lock import DirectoryLock

    lock = DirectoryLock(tmp_path)
    with pytest.raises(CheckpointError):
        DirectoryLock(tmp_path)
    lock.release()
    DirectoryLock(tmp_path).release()
    assert "pid" in (tmp_path / ".lock").read_text()


# -- what held up in the review, kept so --
def test_manifest_entries_outside_the_checkpoint_and_absurd_sizes_are_problems(tmp_path):
    import json
    import zlib

    ck = _saved(tmp_path / "c", 1, 2)
    path = tmp_path / "c" / "step_00000002" / "manifest.json"
    m = json.loads(path.read_bytes().partition(b"\n")[2])
    m["files"]["../../etc/passwd"] = [1, "0"]
    m["files"]["/etc/passwd"] = [1, "0"]
    m["files"]["rank0.pt"][0] = 10**30
    body = json.dumps(m, sort_keys=True)
    path.write_bytes(f"{zlib.crc32(body.encode()):08x}\n{body}".encode())
    problems = ck.verify(2)
    assert "../../etc/passwd: missing" in problems and "/etc/passwd: missing" in problems
    assert any(p.startswith("rank0.pt: ") and "the manifest says 1000000000000000000000000000000" in p
               for p in problems)
    assert _load_quietly(ck)[0] == 1


def test_linked_leftovers_are_unlinked_never_followed_and_odd_names_ignored(tmp_path):
    keep = tmp_path / "precious"
    keep.mkdir()
    (keep / "data").write_text("x")
    d = tmp_path / "c"
    d.mkdir()
    for name in (".tmp-step_00000003", ".trash-step_00000002", ".old-step_00000009", "step_00000007"):
        (d / name).symlink_to(keep, target_is_directory=True)
    for odd in ("step_-1", "step_1e3", "step_0x10", "step_12"):
        (d / odd).mkdir()
    ck = Checkpointer(d, keep_last=1)
    assert (keep / "data").read_text() == "x"
    assert ck.steps() == [7]  # the linked step is listed, and refused when read
    assert ck.verify(7)[0].endswith("is a symbolic link (a checkpoint directory must be the directory itself)")
    ck.save(8, _state(8))
    assert (keep / "data").read_text() == "x" and ck.steps() == [8]
    assert all((d / odd).is_dir() for odd in ("step_-1", "step_1e3", "step_0x10", "step_12"))


def test_a_pickle_planted_in_a_distcp_file_does_not_run(tmp_path):
    ck = _saved(tmp_path / "c", 1, 2)
    marker = tmp_path / "pwned"
    (tmp_path / "c" / "step_00000002" / "__0_0.distcp").write_bytes(pickle.dumps(Payload(str(marker))))
    resign(ck.dir, 2)
    step, _ = _load_quietly(ck)
    assert step == 1 and not marker.exists()
