"""procs.free_port: ports a child binds seconds later, which nothing else on the machine takes."""

from __future__ import annotations

import socket
from pathlib import Path

from switchyard import procs


def _ephemeral_range() -> tuple[int, int]:
    low, high = map(int, Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split())
    return low, high


def test_a_free_port_lies_outside_the_range_outgoing_connections_draw_from():
    low, high = _ephemeral_range()
    for _ in range(20):
        port = procs.free_port()
        assert not low <= port <= high, (port, low, high)


def test_a_port_handed_out_is_not_handed_out_again_while_reserved():
    ports = [procs.free_port() for _ in range(200)]
    assert len(set(ports)) == len(ports)


def test_a_free_port_can_be_bound():
    port = procs.free_port()
    with socket.socket() as s:
        s.bind(("127.0.0.1", port))


def test_a_port_bound_by_someone_else_is_not_handed_out(monkeypatch):
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        taken = held.getsockname()[1]
        monkeypatch.setattr(procs, "_unclaimed_range", lambda: (taken, taken + 1))
        # the one port of the range is bound: the kernel's own pick is the fallback
        assert procs.free_port() != taken
