"""Every connection is watched: a server that closes it for good ends the service loudly
(nats-py would not reconnect, and a live process with a dead connection is never
restarted); a server that goes away and comes back on its port is reconnected to, its
JetStream store intact."""

from __future__ import annotations

import subprocess

import anyio
import pytest

from switchyard import procs
from switchyard.observability import BusClosedError, connect, settle, subscribe
from switchyard.scheduler import SchedulerServiceConfig
from switchyard.scheduler.service import SchedulerService
from switchyard.scheduler.session_store import SessionStore
from switchyard.scheduler.sessions import Binding

pytestmark = pytest.mark.anyio

# A subject past the server's max_control_line (4,096 bytes): the server closes the client.
_OVERSIZED = "sy.test." + "x" * 5000


async def test_a_connection_the_server_closes_raises_out_of_the_block(nats):
    with anyio.fail_after(5), pytest.raises(BusClosedError) as closed:
        async with connect(nats.url, "victim") as nc:
            await nc.publish(_OVERSIZED, b"")
            await anyio.sleep(30)  # cancelled by the close
    assert "victim" in str(closed.value) and "control line" in str(closed.value).lower()


async def test_a_cleanup_that_trips_over_the_closed_connection_still_says_why(nats):
    with anyio.fail_after(5), pytest.raises(BusClosedError):
        async with connect(nats.url, "polite") as nc:
            try:
                await nc.publish(_OVERSIZED, b"")
                await anyio.sleep(30)
            finally:
                with anyio.CancelScope(shield=True):
                    await nc.publish("sy.test.goodbye", b"")  # as a worker says WorkerLeaving


async def test_leaving_the_block_is_no_loss(nats):
    async with connect(nats.url, "calm") as nc:
        await settle(nc)
    assert nc.is_closed


async def test_a_scheduler_whose_connection_the_server_closes_stops(nats):
    service = SchedulerService(SchedulerServiceConfig(nats_url=nats.url))
    with anyio.fail_after(10), pytest.raises(ExceptionGroup) as stopped:
        async with anyio.create_task_group() as tg:
            await tg.start(service.run)
            assert service._nc is not None
            await service._nc.publish(_OVERSIZED, b"")  # as an overlong session key once did
            await anyio.sleep(30)  # run() must end on its own
    assert stopped.group_contains(BusClosedError)


def _start(command: list[str], port: int) -> subprocess.Popen:
    proc = procs.spawn(command, stdout=subprocess.DEVNULL)
    procs.wait_for_port("127.0.0.1", port, 10.0, proc)
    return proc


async def _wait_reconnected(nc, timeout_s: float) -> None:
    with anyio.fail_after(timeout_s):
        while not (nc.stats["reconnects"] and nc.is_connected):  # nats-py offers flags, no event
            await anyio.sleep(0.05)


async def test_a_server_restarted_on_its_port_is_reconnected_with_its_store(tmp_path):
    port = procs.free_port()
    command = procs.nats_server_command("127.0.0.1", port, str(tmp_path))
    server = _start(command, port)
    try:
        async with connect(f"nats://127.0.0.1:{port}", "patient") as nc:
            sub = await subscribe(nc, "sy.test.echo")
            store = await SessionStore.open(nc, ttl_s=60)
            await store.put(Binding("t", "s", "prefill-a", expires_at=100.0), now=0.0)
            server.kill()
            server.wait()
            server = _start(command, port)
            await _wait_reconnected(nc, 10)
            await nc.publish("sy.test.echo", b"still here")  # the subscription came back too
            with anyio.fail_after(5):
                msg = await anext(aiter(sub.messages))
            assert msg.data == b"still here"
            [binding] = await store.load(now=0.0)
            assert binding.worker_id == "prefill-a" and binding.expires_at == pytest.approx(100.0, abs=5)
    finally:
        procs.stop([server])
