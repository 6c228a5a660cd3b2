"""``launch(..., slurm=...)`` and ``launch_slurm`` reject bad input before anything is submitted.

Pure Python, no Slurm needed, so these run everywhere (tests/test_slurm.py needs a local Slurm).
"""
import pytest

import labkit.launch.slurm as slurm_launch
from labkit.launch import launch
from labkit.launch.slurm import SLURM_OPTIONS, launch_slurm


@pytest.fixture
def submitted(monkeypatch):
    """Record what would be submitted instead of submitting it."""
    calls = []
    monkeypatch.setattr(slurm_launch, "launch_slurm", lambda fn, *a, **kw: calls.append((fn, a, kw)) or ["ok"])
    return calls


def test_good_options_reach_launch_slurm(submitted):
    assert launch(print, 1, world_size=4, timeout=30, slurm=dict(nodes=2, partition="gpu"), end="") == ["ok"]
    (fn, args, kw), = submitted
    assert fn is print and args == (1,)
    assert kw == dict(nodes=2, tasks_per_node=2, partition="gpu", device="cpu", timeout=30, end="")


@pytest.mark.parametrize("nodes", [0, -1, 1.5, "2", True])
def test_bad_node_count_is_a_clear_error_not_a_division(submitted, nodes):
    with pytest.raises(ValueError, match=f"nodes must be a positive integer, got {nodes!r}"):
        launch(print, world_size=2, slurm=dict(nodes=nodes))
    assert not submitted


def test_misspelt_option_is_rejected_naming_it_and_the_valid_ones(submitted):
    with pytest.raises(ValueError) as e:
        launch(print, world_size=2, slurm=dict(nodes=1, partiton="gpu"))
    msg = str(e.value)
    assert "unknown option(s) ['partiton']" in msg and "valid options: ['nodes', 'tasks_per_node', 'partition'" in msg
    assert not submitted  # not passed on to the lab function on the compute nodes


def test_launch_arguments_inside_the_slurm_dict_point_to_launch(submitted):
    with pytest.raises(ValueError, match=r"\['device'\].*device: pass device= to launch itself"):
        launch(print, world_size=2, slurm=dict(device="cuda"))
    with pytest.raises(TypeError, match="slurm must be a dict of launch_slurm options, got int"):
        launch(print, world_size=2, slurm=2)
    assert not submitted


def test_world_size_must_match_nodes_times_tasks(submitted):
    with pytest.raises(ValueError, match=r"world_size=3 must equal slurm nodes x tasks_per_node \(2 x 1\)"):
        launch(print, world_size=3, slurm=dict(nodes=2))
    with pytest.raises(ValueError, match=r"world_size=4 must equal slurm nodes x tasks_per_node \(2 x 3\)"):
        launch(print, world_size=4, slurm=dict(nodes=2, tasks_per_node=3))
    assert not submitted


def test_valid_options_are_launch_slurms_own():
    assert SLURM_OPTIONS == ("nodes", "tasks_per_node", "partition", "time_min", "cpus_per_task", "folder",
                             "poll_s", "slurm_extra")


def test_launch_slurm_rejects_bad_input():
    with pytest.raises(ValueError, match="nodes must be a positive integer, got 0"):
        launch_slurm(print, nodes=0)
    with pytest.raises(ValueError, match="time_min must be a positive integer, got 0"):
        launch_slurm(print, time_min=0)
    with pytest.raises(ValueError, match=r"device='tpu' is unknown; valid devices: \['cpu', 'cuda'\]"):
        launch_slurm(print, device="tpu")


def test_tasks_meet_on_the_port_rank_0_found_free_not_one_derived_from_the_job_id(tmp_path):
    """Jobs 12345 and 32345 used to share port 20000 + id % 20000: rank 0 now binds a free port on the
    head node and publishes it in the job's shared folder; the other tasks read that one."""
    import socket

    ports = [slurm_launch._rendezvous_port(tmp_path, job, 0) for job in ("12345", "32345")]
    assert [slurm_launch._rendezvous_port(tmp_path, job, 3) for job in ("12345", "32345")] == ports
    for port in ports:
        assert port != 32345
        with socket.socket() as s:
            s.bind(("", port))  # it was free when published
    with pytest.raises(TimeoutError, match=r"rank 1: rank 0 of job 7 published no rendezvous port in .* within 0 s"):
        slurm_launch._rendezvous_port(tmp_path, "7", 1, timeout=0.3)
