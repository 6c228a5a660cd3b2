"""Ports for servers that bind later: outside the range outgoing connections are given, and free."""
import socket

from labkit.core import ports


def test_a_listen_port_is_free_and_no_outgoing_connection_can_be_given_it():
    lo, hi = ports.outgoing_range()
    picked = {ports.listen_port() for _ in range(20)}
    assert all(ports.is_free(p) and not lo <= p <= hi for p in picked)
    assert len(picked) > 1  # random, not the first free one: two launchers at once rarely collide
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen()
        assert not ports.is_free(server.getsockname()[1])
    assert not any(map(ports.is_free, (None, 0, True, 70000, "8080")))


def test_where_the_outgoing_range_takes_every_port_the_os_picks(monkeypatch):
    lo, hi = ports.outgoing_range()  # the OS's own pick comes from the real range
    monkeypatch.setattr(ports, "outgoing_range", lambda: (1024, 65535))
    port = ports.listen_port()
    assert ports.is_free(port) and lo <= port <= hi
