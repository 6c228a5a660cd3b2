"""The checkpoint directory's lock goes with its writer: closed, left by ``with``, dropped and
collected, or its process gone (forked children do not keep it); a filesystem without flock is named."""
from __future__ import annotations

import errno
import fcntl
import gc
import os
import subprocess
import sys
import textwrap

import pytest

from labkit.fault_tolerance import Checkpointer
from labkit.fault_tolerance.errors import CheckpointError


def test_a_dropped_checkpointer_releases_its_directory(tmp_path):
    c = Checkpointer(tmp_path)
    with pytest.raises(CheckpointError, match="this process holds it"):
        Checkpointer(tmp_path)  # a second live writer in one process is still refused
    del c
    gc.collect()
    Checkpointer(tmp_path).close()  # a notebook cell run twice


def test_with_releases_the_lock_at_the_end_of_the_block(tmp_path):
    with Checkpointer(tmp_path) as c:
        c.save(1, {"x": 1})
    with Checkpointer(tmp_path) as again:
        assert again.steps() == [1]


def test_a_child_forked_while_the_lock_was_held_does_not_keep_it(tmp_path):
    """The writer forks a long-lived child and exits: the directory is free at once."""
    script = textwrap.dedent(f"""
        import os, sys, time
        from labkit.fault_tolerance import Checkpointer
        c = Checkpointer({str(tmp_path)!r})
        if os.fork() == 0:
            time.sleep(60)
            os._exit(0)
        print("forked", flush=True)
    """)
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True, start_new_session=True)
    try:
        assert proc.stdout.readline().strip() == "forked"
        proc.wait(timeout=60)
        Checkpointer(tmp_path).close()  # the orphaned child is still sleeping
    finally:
        os.killpg(proc.pid, 9)


def test_a_filesystem_without_flock_is_named_and_the_opt_out_works(tmp_path, monkeypatch):
    real = fcntl.flock
    opened = len(os.listdir("/proc/self/fd"))

    def no_flock(fd, op):
        raise OSError(errno.ENOSYS, os.strerror(errno.ENOSYS))

    monkeypatch.setattr(fcntl, "flock", no_flock)
    with pytest.raises(CheckpointError, match="does not support flock .*LABKIT_CHECKPOINT_LOCK=0"):
        Checkpointer(tmp_path)
    assert len(os.listdir("/proc/self/fd")) == opened  # no descriptor leaked
    monkeypatch.setenv("LABKIT_CHECKPOINT_LOCK", "0")
    with Checkpointer(tmp_path) as c:
        c.save(1, {"x": 1})
    monkeypatch.setattr(fcntl, "flock", real)
    monkeypatch.setenv("LABKIT_CHECKPOINT_LOCK", "maybe")
    with pytest.raises(ValueError, match="LABKIT_CHECKPOINT_LOCK='maybe' must be 1"):
        Checkpointer(tmp_path)


def test_the_fault_injector_kills_workers_in_sessions_of_their_own():
    """torchrun's elastic agent starts each worker in a new session: a timeout must reach them too."""
    import time

    from labkit.fault_tolerance.injection import kill_tree

    script = ("import subprocess, sys, time\n"
              "c = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(120)'], start_new_session=True)\n"
              "print(c.pid, flush=True)\n"
              "time.sleep(120)\n")
    agent = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True, start_new_session=True)
    worker = int(agent.stdout.readline())
    kill_tree(agent.pid)
    agent.wait(timeout=30)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            os.kill(worker, 0)
        except ProcessLookupError:
            return
        try:  # a zombie still answers kill(0) until reaped by init
            if open(f"/proc/{worker}/stat").read().rsplit(")", 1)[1].split()[0] == "Z":
                return
        except OSError:
            return
        time.sleep(0.1)
    raise AssertionError(f"worker {worker} outlived the kill")


def test_readers_load_complete_steps_while_the_writer_saves_and_prunes(tmp_path):
    """A writer saving and pruning at keep_last=1, readers loading in a loop beside it: no reader
    fails, every load is one whole step (its tensor holds its own step number), and a load that met a
    step retired under it and retried says nothing (issue 43: DCP's tracebacks filled stderr)."""
    import json

    import torch

    reader = textwrap.dedent(f"""
        import json, os, sys, torch
        from labkit.fault_tolerance import Checkpointer
        ok, failures, wrong = 0, [], 0
        c = Checkpointer({str(tmp_path)!r}, readonly=True)
        c.load_latest()
        print("ready", flush=True)
        while not os.path.exists({str(tmp_path / "stop")!r}):
            try:
                got = c.load_latest(if_unusable="start_over")
            except Exception as e:
                failures.append(f"{{type(e).__name__}}: {{e}}"[:300])
                continue
            if got is not None:
                step, state = got
                wrong += int(not torch.equal(state["w"], torch.full((256,), float(step))))
                ok += 1
        print(json.dumps({{"ok": ok, "failures": failures[:5], "n_failures": len(failures), "wrong": wrong}}))
    """)
    with Checkpointer(tmp_path, keep_last=1) as writer:
        writer.save(0, {"w": torch.full((256,), 0.0)})
        readers = [subprocess.Popen([sys.executable, "-c", reader], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                    text=True) for _ in range(3)]
        try:
            assert all(r.stdout.readline().strip() == "ready" for r in readers)  # each has loaded once
            for step in range(1, 201):
                writer.save(step, {"w": torch.full((256,), float(step))})
        finally:
            (tmp_path / "stop").touch()
        outputs = [r.communicate(timeout=120) for r in readers]
    for out, err in outputs:
        r = json.loads(out)
        assert r["n_failures"] == 0 and r["wrong"] == 0 and r["ok"] > 0, r
        assert err == "", err[-2000:]


def test_a_reader_on_two_ranks_loads_one_step_when_the_ranks_listed_at_different_moments(tmp_path):
    import torch

    from ft_rank_fns import readers_load
    from labkit.launch import launch

    with Checkpointer(tmp_path) as writer:
        for step in (1, 2, 3):
            writer.save(step, {"x": torch.full((4,), float(step))})
    assert launch(readers_load, str(tmp_path), world_size=2) == [2, 2]
