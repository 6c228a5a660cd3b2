import os
import time

import psutil
import pytest
import torch

import rank_fns
from labkit.core.devices import check_device
from labkit.launch import RankError, launch


def _spawned_children() -> list[psutil.Process]:
    """Rank processes still alive: spawned ones, and what the forkserver forked (its children)."""
    out = []
    for p in psutil.Process().children(recursive=True):
        try:
            cmd = " ".join(p.cmdline())
            if "spawn_main" in cmd:
                out.append(p)
            elif "multiprocessing.forkserver" in cmd:
                out += p.children(recursive=True)
        except psutil.NoSuchProcess:
            pass
    return out


def test_results_come_back_indexed_by_rank():
    res = launch(rank_fns.rank_info, "hello", world_size=3)
    assert [r["rank"] for r in res] == [0, 1, 2]
    assert all(r["world"] == 3 and r["sum"] == 6.0 and r["tag"] == "hello" for r in res)
    assert len({r["pid"] for r in res}) == 3 and os.getpid() not in {r["pid"] for r in res}
    assert not _spawned_children()


def test_a_rank_that_raises_surfaces_its_traceback_and_nothing_is_left_behind():
    t0 = time.monotonic()
    with pytest.raises(RankError) as info:
        launch(rank_fns.fail_on, 1, world_size=2, timeout=120)
    assert time.monotonic() - t0 < 60, "a failing rank must not make the caller wait for the timeout"
    err = info.value
    assert 1 in err.failures
    assert "ValueError: deliberate failure on rank 1" in err.failures[1]
    assert "rank_fns.py" in err.failures[1]  # the rank's own traceback, with its file and line
    assert "--- rank 1 ---" in str(err)
    assert not _spawned_children()


def test_quiet_ranks_still_report_errors(capfd):
    with pytest.raises(RankError, match="deliberate failure on rank 0"):
        launch(rank_fns.fail_on, 0, world_size=2, quiet=True, timeout=120)
    assert "deliberate" not in capfd.readouterr().err  # nothing printed by the ranks themselves


def test_a_rank_that_dies_without_an_exception_is_reported():
    with pytest.raises(RankError, match=r"rank 0 died with exit code 3"):
        launch(rank_fns.die_on, 0, world_size=2, timeout=120)
    assert not _spawned_children()


def test_a_hanging_run_times_out_and_is_killed():
    t0 = time.monotonic()
    with pytest.raises(RankError, match=r"did not finish within the time allowed \(timeout=8"):
        launch(rank_fns.sleep_forever, world_size=2, timeout=8)
    assert time.monotonic() - t0 < 30
    assert not _spawned_children()


def test_functions_defined_in_an_interactive_session_get_a_clear_error(monkeypatch):
    import sys

    def f():
        return 1

    f.__module__ = "__main__"
    monkeypatch.delattr(sys.modules["__main__"], "__file__", raising=False)
    with pytest.raises(TypeError, match="defined in an interactive session"):
        launch(f, world_size=2)


def test_bad_device_and_world_size_are_named():
    with pytest.raises(ValueError, match=r"device='tpu' is unknown; valid devices: \['cpu', 'cuda'\]"):
        check_device("tpu")
    with pytest.raises(ValueError, match="world_size must be a positive integer"):
        launch(rank_fns.rank_info, "x", world_size=0)
    n = torch.cuda.device_count() if torch.cuda.is_available() else 0
    with pytest.raises(ValueError, match=rf"needs {n + 1} GPUs, found {n}"):
        launch(rank_fns.rank_info, "x", world_size=n + 1, device="cuda")


def test_arguments_that_cannot_reach_the_ranks_are_one_clear_error():
    """Spawn pickles the arguments when a rank starts: the PicklingError used to hide behind
    'AssertionError: can only join a started process', and the started ranks were left running."""
    with pytest.raises(TypeError, match=r"could not start rank 0: .*(Pickl|pickle).* pass module-level functions"):
        launch(rank_fns.rank_info, lambda: 1, world_size=2, timeout=60)
    assert not _spawned_children()


def test_what_a_rank_started_does_not_outlive_launch():
    pids = launch(rank_fns.start_a_sleeper, world_size=2, timeout=120)
    time.sleep(0.5)
    for pid in pids:  # killed with its rank's process group; reaped by init, or a zombie at most
        assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE, pid


def test_a_peer_stopped_after_a_failure_is_not_blamed_on_the_timeout():
    t0 = time.monotonic()
    with pytest.raises(RankError) as info:
        launch(rank_fns.fail_fast_or_wait, 0, world_size=2, timeout=600)
    assert time.monotonic() - t0 < 60
    waited = info.value.failures[1]
    assert "after rank 0 failed" in waited and "most likely waiting for rank 0" in waited, waited
    assert "timeout=600" not in waited


@pytest.mark.parametrize("env", ["1", "0"])
def test_a_ranks_progress_bar_is_drawn_by_the_caller(capfd, monkeypatch, env):
    """Rank 0 forwards its count; the caller draws it (a notebook's widget, a terminal's line), so the
    bar shows where the person is looking; LABKIT_PROGRESS=0 (papermill) draws none."""
    monkeypatch.setenv("LABKIT_PROGRESS", env)
    forwarded = launch(rank_fns.count_with_bar, 7, world_size=2)
    err = capfd.readouterr().err
    if env == "1":
        assert forwarded == [True, False]
        last = err.rstrip("\n").split("\r")[-1]  # one bar, redrawn in place, closed at 7/7
        assert err.count("\n") == 1 and last.startswith("counting: 100%") and "7/7" in last and "loss=0.5000" in last
    else:
        assert forwarded == [False, False] and "counting" not in err


def test_bars_show_in_a_notebook_and_on_a_terminal_for_long_runs(monkeypatch):
    from labkit.core import progress

    monkeypatch.delenv("LABKIT_PROGRESS", raising=False)
    monkeypatch.setattr(progress, "in_notebook", lambda: True)
    assert progress.wanted(3)
    monkeypatch.setattr(progress, "in_notebook", lambda: False)
    monkeypatch.setattr(progress.sys.stderr, "isatty", lambda: True, raising=False)
    assert progress.wanted(progress.LONG_RUN) and not progress.wanted(progress.LONG_RUN - 1)
    monkeypatch.setenv("LABKIT_PROGRESS", "0")
    assert not progress.wanted(10**6)
