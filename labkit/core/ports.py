"""A free TCP port for a server that binds it later: the hub, Jupyter, a rendezvous store.

The usual idiom, bind port 0 and close, hands back a port from the range Linux gives outgoing
connections (``net.ipv4.ip_local_port_range``, 32768-60999 by default; Linux ``ip-sysctl``
docs). Any connection opened on the machine between the pick and the bind may be given the same
port, and the server then fails with EADDRINUSE: on a busy machine, after a start-up of seconds
(a hub installing itself), that happens. A port below that range is never handed out that way,
so the pick holds until something binds it on purpose.
"""
from __future__ import annotations

import os
import random
import socket
from collections.abc import Iterable
from pathlib import Path

LISTEN_RANGE = (10000, 20000)  # below Linux's default outgoing range, and any sane one; 1024+ needs no root
LISTEN_RANGE_VAR = "LABKIT_LISTEN_PORTS"  # lo-hi: a site whose firewall opens other ports between nodes
_RANGE_FILE = Path("/proc/sys/net/ipv4/ip_local_port_range")


def listen_range() -> tuple[int, int]:
    """The ports ``listen_port`` picks from, ``lo`` to ``hi - 1``: LISTEN_RANGE, or the
    environment's ``LABKIT_LISTEN_PORTS=lo-hi`` (inclusive)."""
    value = os.environ.get(LISTEN_RANGE_VAR, "").strip()
    if not value:
        return LISTEN_RANGE
    lo, _, hi = value.partition("-")
    if not (lo.isdigit() and hi.isdigit() and 1024 <= int(lo) <= int(hi) <= 65535):
        raise ValueError(f"{LISTEN_RANGE_VAR}={value!r}: give a range of ports lo-hi within 1024-65535, "
                         "e.g. 10000-20000")
    return int(lo), int(hi) + 1


def outgoing_range() -> tuple[int, int]:
    """The ports the OS hands outgoing connections (Linux's setting; its default elsewhere)."""
    try:
        lo, hi = map(int, _RANGE_FILE.read_text().split())
        return lo, hi
    except (OSError, ValueError):
        return 32768, 60999


def is_free(port: int, host: str = "127.0.0.1") -> bool:
    """Whether a server could bind ``host:port`` now (with SO_REUSEADDR, as servers do: a closed
    connection's TIME_WAIT does not hold a port, a listening socket does)."""
    if not isinstance(port, int) or isinstance(port, bool) or not 0 < port < 65536:
        return False
    with socket.socket() as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError:
            return False
    return True


def listen_port(host: str = "127.0.0.1", avoid: Iterable[int] = ()) -> int:
    """A port free on ``host`` now, in ``listen_range()`` and outside the outgoing range, chosen at
    random (by the OS's entropy, not the seeded ``random``: two seeded runs would pick the same).
    ``avoid``: ports picked but not bound yet. Falls back to the OS's pick where the two ranges
    leave no room."""
    lo, hi = listen_range()
    out_lo, out_hi = outgoing_range()
    avoid = set(avoid)
    ports = [p for p in range(lo, hi) if not out_lo <= p <= out_hi and p not in avoid]
    for port in random.SystemRandom().sample(ports, min(len(ports), 200)):
        if is_free(port, host):
            return port
    while True:
        with socket.socket() as sock:
            sock.bind((host, 0))
            if (port := sock.getsockname()[1]) not in avoid:
                return port
