"""``settle``: a subscription made before it has reached the server when it returns, which
nats-py's own ``flush()`` does not promise. Read off a real nats-server's protocol trace."""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path

import pytest

from switchyard.observability import connect, settle, subscribe
from switchyard.procs import free_port, nats_server_command, spawn, stop, wait_for_port

pytestmark = pytest.mark.anyio


@pytest.fixture
def traced(tmp_path: Path) -> Iterator[tuple[str, Path]]:
    """A nats-server that logs every protocol line its clients send (``-V``)."""
    port, log = free_port(), tmp_path / "trace.log"
    proc = spawn([*nats_server_command("127.0.0.1", port, None), "-V", "-l", str(log)])
    try:
        wait_for_port("127.0.0.1", port, 10.0, proc)
        yield f"nats://127.0.0.1:{port}", log
    finally:
        stop([proc])


def _received(log: Path) -> list[str]:
    """What clients sent, in the order the server read it: ``SUB <subject>``, ``PING``."""
    lines = re.findall(r"<<- \[(SUB \S+|PING)", log.read_text())
    return [line for line in lines if line == "PING" or line.startswith("SUB work.")]


async def test_settle_returns_only_after_the_server_has_read_the_subscriptions(traced):
    """With nats-py 2.16's ``flush()`` in its place the server reads PING first (its PING is
    written straight to the socket, the SUBs wait for the flusher task), and this fails."""
    url, log = traced
    async with connect(url, "settle-test") as nc:
        before = len(_received(log))
        for i in range(4):  # as a worker does before it says it is ready
            await subscribe(nc, f"work.{i}")
        await settle(nc)
        assert _received(log)[before:] == ["SUB work.0", "SUB work.1", "SUB work.2", "SUB work.3", "PING"]
