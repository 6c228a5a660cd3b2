"""Ports for servers that bind later: outside the range outgoing connections are given, and free."""
import socket

import pytest

from labkit.core import ports


def test_a_listen_port_is_free_and_no_outgoing_connection_can_be_given_it(monkeypatch):
    lo, hi = ports.outgoing_range()
    picked = {ports.listen_port() for _ in range(20)}
    assert all(ports.is_free(p) and not lo <= p <= hi for p in picked)
    assert len(picked) > 1  # random, not the first free one: two launchers at once rarely collide
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen()
        assert not ports.is_free(server.getsockname()[1])
    assert not any(map(ports.is_free, (None, 0, True, 70000, "8080")))
    monkeypatch.setenv("LABKIT_LISTEN_PORTS", "30000-30002")  # three to pick from, two already picked
    assert {ports.listen_port(avoid=(30000, 30002)) for _ in range(5)} == {30001}


def test_where_the_outgoing_range_takes_every_port_the_os_picks(monkeypatch):
    lo, hi = ports.outgoing_range()  # the OS's own pick comes from the real range
    monkeypatch.setattr(ports, "outgoing_range", lambda: (1024, 65535))
    port = ports.listen_port()
    assert ports.is_free(port) and lo <= port <= hi


def test_the_hub_keeps_its_api_port_and_replaces_one_it_cannot_use(tmp_path, monkeypatch, capsys):
    import subprocess
    import sys
    import types

    from labkit.course import hub

    monkeypatch.setattr(hub, "time", types.SimpleNamespace(sleep=lambda s: None))  # the wait for an old hub
    first = hub._hub_port(tmp_path, taken=())
    assert hub._hub_port(tmp_path, taken=()) == first == hub._settings(tmp_path)["hub_port"]
    assert hub._hub_port(tmp_path, taken=(first,)) != first  # never the public port
    for bad in (True, "8081", 70000, 80):
        hub._save_settings(tmp_path, {"hub_port": bad})
        assert ports.is_free(hub._hub_port(tmp_path, taken=()))
        assert f"hub_port {bad!r} is not a port from 1024 to 65535" in capsys.readouterr().err
    with socket.socket() as other:  # another program has it: a new one, and the servers must restart
        other.bind(("127.0.0.1", hub._settings(tmp_path)["hub_port"]))
        other.listen()
        assert hub._hub_port(tmp_path, taken=()) != other.getsockname()[1]
        assert "is taken; a new one is kept, and servers still running must be restarted" in capsys.readouterr().err
        # the hub of this state still running on it: refused, and hub.json left as it was
        hub._save_settings(tmp_path, {"hub_port": other.getsockname()[1]})
        old = subprocess.Popen([sys.executable, "-c", "import time; print(flush=True); time.sleep(60)", "jupyterhub"],
                               stdout=subprocess.PIPE)
        try:
            old.stdout.readline()  # running: Popen returns once exec began, before /proc shows its arguments
            (tmp_path / "jupyterhub.pid").write_text(str(old.pid))
            with pytest.raises(SystemExit, match=f"a hub is still running on .* \\(pid {old.pid}\\)"):
                hub._hub_port(tmp_path, taken=())
            assert hub._settings(tmp_path)["hub_port"] == other.getsockname()[1]
        finally:
            old.kill()
            old.wait()


def test_a_site_sets_the_range_and_a_bad_one_is_named(monkeypatch):
    import subprocess
    import sys

    monkeypatch.setenv("LABKIT_LISTEN_PORTS", "30000-30009")
    assert {ports.listen_port() for _ in range(10)} <= set(range(30000, 30010))
    for bad in ("30000", "9-20", "20000-10000", "1000-2000", "x-y", "30000-70000"):
        monkeypatch.setenv("LABKIT_LISTEN_PORTS", bad)
        with pytest.raises(ValueError, match="LABKIT_LISTEN_PORTS=.*lo-hi within 1024-65535"):
            ports.listen_port()
    # train.sbatch's call: one line, exit 2
    proc = subprocess.run([sys.executable, "-m", "labkit", "port"], capture_output=True, text=True)
    assert proc.returncode == 2 and proc.stderr.count("\n") <= 2 and "LABKIT_LISTEN_PORTS='30000-70000'" in proc.stderr
    assert "Traceback" not in proc.stderr, proc.stderr
