"""Three regions as a NATS supercluster on this machine (tests/support/regions.py), with
emulated round trips of 30 (us-eu), 70 (us-ap) and 140 ms (eu-ap): what crosses the
gateways (requests to another region's services, streams to an ingress there, federation
subjects), what never does (everything else), JetStream per region, a leaf node, and the
loss of one region. The relay itself is tested first, in process, on plain sockets."""

from __future__ import annotations

import json
import subprocess
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import anyio
import anyio.abc
import pytest
from nats.aio.client import Client
from nats.errors import NoRespondersError, TimeoutError
from nats.js.errors import APIError, ServiceUnavailableError

from switchyard import nats_config, procs
from switchyard.nats_config import Address, LeafSpec
from switchyard.observability import settle
from switchyard.observability.bus import connect
from switchyard.schemas import subjects
from switchyard.wan import Relay, RttTable
from tests.support.regions import Supercluster, local_supercluster

pytestmark = pytest.mark.anyio

RTT = {("us", "eu"): 30, ("us", "ap"): 70, ("eu", "ap"): 140}
RTT_TABLE = ",".join(f"{a}-{b}={ms}" for (a, b), ms in RTT.items())
SLACK_MS = 200  # a functional check (the delay is there, nothing else is), not a benchmark


@pytest.fixture(scope="module")
def regions(tmp_path_factory):
    with local_supercluster(["us", "eu", "ap"], tmp_path_factory.mktemp("regions"), rtt=RTT_TABLE) as sc:
        yield sc


@asynccontextmanager
async def _clients(sc: Supercluster, *names: str) -> AsyncIterator[list[Client]]:
    async with connect(sc.url(names[0]), f"test-{names[0]}") as first:
        if len(names) == 1:
            yield [first]
        else:
            async with _clients(sc, *names[1:]) as rest:
                yield [first, *rest]


async def _request_when_routed(nc: Client, subject: str, timeout_s: float = 10.0) -> bytes:
    """The first answer: a subscription's interest takes a moment to cross the gateways."""
    with anyio.fail_after(timeout_s):
        while True:
            try:
                return (await nc.request(subject, b"hello", timeout=1.0)).data
            except (NoRespondersError, TimeoutError):
                await anyio.sleep(0.05)


async def _respond(msg) -> None:
    await msg.respond(b"served:" + msg.subject.encode())


# --- the relay, on plain sockets ------------------------------------------------------------------


async def _fake_gateway(listener: anyio.abc.SocketListener, received: list[bytes]) -> None:
    """A gateway port that says INFO, then echoes every line after the dialer's CONNECT."""

    async def serve(stream: anyio.abc.SocketStream) -> None:
        async with stream:
            await stream.send(b'INFO {"gateway":"eu"}\r\n')
            buffer = b""
            try:
                while True:
                    chunk = await stream.receive()
                    received.append(chunk)
                    buffer += chunk
                    *lines, buffer = buffer.split(b"\r\n")
                    for line in lines:
                        if not line.startswith(b"CONNECT"):
                            await stream.send(line + b"\r\n")
            except anyio.EndOfStream:
                received.append(b"<eof>")

    await listener.serve(serve)


async def test_relay_delays_each_way_by_half_the_pairs_round_trip_and_closes_cleanly():
    received: list[bytes] = []
    listener = await anyio.create_tcp_listener(local_host="127.0.0.1")
    upstream = Address("127.0.0.1", listener.extra(anyio.abc.SocketAttribute.local_port))
    with anyio.fail_after(10):
        await _relay_round_trip(listener, upstream, received)
    await listener.aclose()


async def _relay_round_trip(listener, upstream: Address, received: list[bytes]) -> None:
    async with anyio.create_task_group() as tg:
        tg.start_soon(_fake_gateway, listener, received)
        port = await tg.start(Relay(Address("127.0.0.1", 0), upstream, RttTable.parse("us-eu=80,*=0")).serve)
        async with await anyio.connect_tcp("127.0.0.1", port) as dialer:
            info = await dialer.receive()
            assert json.loads(info.partition(b" ")[2]) == {"gateway": "eu"}
            await dialer.send(b'CONNECT {"gateway":"us"}\r\n')
            start = anyio.current_time()
            await dialer.send(b"PING\r\n")
            assert await dialer.receive() == b"PING\r\n"
            assert (anyio.current_time() - start) * 1000 >= 80  # 40 there, 40 back
        with anyio.fail_after(2):  # the dialer's close reaches the gateway, after its bytes
            while b"<eof>" not in received:
                await anyio.sleep(0.01)
        assert b"".join(received) == b'CONNECT {"gateway":"us"}\r\nPING\r\n<eof>'
        tg.cancel_scope.cancel()


async def test_a_gateway_that_closes_closes_the_dialers_side_too():
    async def hang_up(stream: anyio.abc.SocketStream) -> None:
        async with stream:
            await stream.send(b'INFO {"gateway":"eu"}\r\n')

    listener = await anyio.create_tcp_listener(local_host="127.0.0.1")
    upstream = Address("127.0.0.1", listener.extra(anyio.abc.SocketAttribute.local_port))
    with anyio.fail_after(10):
        async with anyio.create_task_group() as tg:
            tg.start_soon(listener.serve, hang_up)
            port = await tg.start(Relay(Address("127.0.0.1", 0), upstream, RttTable()).serve)
            async with await anyio.connect_tcp("127.0.0.1", port) as dialer:
                assert (await dialer.receive()).startswith(b"INFO")
                with pytest.raises(anyio.EndOfStream):
                    await dialer.receive()
            tg.cancel_scope.cancel()
    await listener.aclose()


def test_rtt_table_reads_pairs_both_ways_and_a_default():
    table = RttTable.parse("us-eu=30, us-ap=70,eu-ap=140,*=5,us-east:eu=9")
    assert table.rtt_ms("eu", "us") == table.rtt_ms("us", "eu") == 30
    assert table.rtt_ms("ap", "eu") == 140
    assert table.rtt_ms("us", "sa") == table.rtt_ms(None, "us") == 5
    assert table.rtt_ms("eu", "us-east") == 9
    assert RttTable.parse(str(table)) == table


@pytest.mark.parametrize("bad", ["us-eu", "us-eu=x", "us-eu=-1", "us=3", "us-us=3", "a-b-c=3", "us-eu=1,eu-us=2"])
def test_rtt_table_refuses(bad):
    with pytest.raises(nats_config.ConfigError):
        RttTable.parse(bad)


# --- what crosses ---------------------------------------------------------------------------------


@pytest.mark.parametrize(("here", "there"), list(RTT))
async def test_a_request_to_another_regions_service_takes_the_pairs_round_trip(regions, here, there):
    async with _clients(regions, here, there) as (nc_here, nc_there):
        await nc_there.subscribe(subjects.SUBMIT, cb=_respond)
        await settle(nc_there)
        to_there = subjects.to_region(there, "submit")
        assert await _request_when_routed(nc_here, to_there) == b"served:" + subjects.SUBMIT.encode()
        start = time.monotonic()
        await nc_here.request(to_there, b"again", timeout=5.0)
        elapsed_ms = (time.monotonic() - start) * 1000
    assert RTT[(here, there)] <= elapsed_ms < RTT[(here, there)] + SLACK_MS


async def test_a_cancel_published_to_another_region_reaches_its_subscribers(regions):
    async with _clients(regions, "us", "eu") as (us, eu):
        cancels = await eu.subscribe(subjects.CANCEL)
        await eu.subscribe(subjects.FED_PING, cb=_respond)
        await settle(eu)
        await _request_when_routed(us, subjects.to_region("eu", "ping"))  # eu's interest is known in us
        await us.publish(subjects.to_region("eu", "cancel"), b"req-1")
        msg = await cancels.next_msg(timeout=5.0)
    assert (msg.subject, msg.data) == (subjects.CANCEL, b"req-1")


async def test_a_workers_stream_reaches_its_ingress_region_and_no_other(regions):
    async with _clients(regions, "us", "eu", "ap") as (us, eu, ap):
        at_us = await us.subscribe(subjects.streams_of("us.ing-1"))
        at_ap = await ap.subscribe(subjects.every_stream())
        await settle(us)
        await settle(ap)
        await anyio.sleep(0.5)  # the subscriptions' interest crosses the gateways
        await eu.publish(subjects.stream("us.ing-1", "w-eu"), b"tokens")
        await eu.publish(subjects.stream("ap.ing-1", "w-eu"), b"marker")  # ap's own: it does cross
        got = await at_us.next_msg(timeout=5.0)
        marker = await at_ap.next_msg(timeout=5.0)
        assert (got.subject, got.data) == (subjects.stream("us.ing-1", "w-eu"), b"tokens")
        assert marker.data == b"marker"
        assert at_ap.pending_msgs == 0  # eu's stream to us never reached ap


async def test_a_regions_own_subjects_never_cross(regions):
    async with _clients(regions, "us", "eu") as (us, eu):
        events = await us.subscribe(subjects.WORKER_EVENTS)
        summaries = await us.subscribe(subjects.every_fed_summary())
        await settle(us)
        await anyio.sleep(0.5)
        await eu.publish(subjects.WORKER_EVENTS, b"eu worker")
        await eu.publish(subjects.fed_summary("eu"), b"eu summary")  # federation: crosses, after it
        summary = await summaries.next_msg(timeout=5.0)
        await us.publish(subjects.WORKER_EVENTS, b"us worker")
        own = await events.next_msg(timeout=5.0)
    assert (summary.subject, summary.data) == (subjects.fed_summary("eu"), b"eu summary")
    assert own.data == b"us worker"  # the first event us heard is its own, not eu's


# --- JetStream --------------------------------------------------------------------------------------


async def _add_stream(nc: Client, name: str, subject_list: list[str], timeout_s: float = 20.0):
    """Create a stream, retrying while JetStream has no meta leader (after a region's loss)."""
    js = nc.jetstream(timeout=2.0)
    with anyio.fail_after(timeout_s):
        while True:
            try:
                return await js.add_stream(name=name, subjects=subject_list)
            except (ServiceUnavailableError, TimeoutError, NoRespondersError):
                await anyio.sleep(0.2)
            except APIError as exc:  # "JetStream system temporarily unavailable" while electing
                if exc.code != 503:
                    raise
                await anyio.sleep(0.2)


async def test_a_stream_of_the_same_name_lives_in_each_region_on_its_own(regions):
    async with _clients(regions, "us", "eu") as (us, eu):
        in_us = await _add_stream(us, "SAME", ["same.>"])
        in_eu = await _add_stream(eu, "SAME", ["same.>"])
        await us.jetstream().publish("same.a", b"us only")
        assert (in_us.cluster.name, in_eu.cluster.name) == ("us", "eu")
        assert (await us.jetstream().stream_info("SAME")).state.messages == 1
        assert (await eu.jetstream().stream_info("SAME")).state.messages == 0


async def test_a_session_directory_stream_holds_every_regions_bindings(regions):
    async with _clients(regions, "us", "eu") as (us, eu):
        await _add_stream(us, "DIRECTORY", [subjects.every_fed_session()])
        await anyio.sleep(0.5)  # the stream's interest crosses to eu
        await eu.publish(subjects.fed_session("eu", "k1"), b"eu binding")
        await us.publish(subjects.fed_session("us", "k2"), b"us binding")
        js = us.jetstream()
        with anyio.fail_after(5):
            while (await js.stream_info("DIRECTORY")).state.messages < 2:
                await anyio.sleep(0.05)
        got = {
            (await js.get_last_msg("DIRECTORY", subjects.fed_session(r, k))).data
            for r, k in (("eu", "k1"), ("us", "k2"))
        }
    assert got == {b"eu binding", b"us binding"}


# --- a leaf node -------------------------------------------------------------------------------------


async def test_an_ingress_on_a_leaf_node_reaches_its_regions_scheduler(regions, tmp_path):
    hub = regions.regions["us"].spec
    assert hub.leafnode_port is not None
    port = procs.free_port()
    config = nats_config.write(
        tmp_path / "leaf.conf",
        nats_config.render_leaf(
            LeafSpec(region="us", hub=Address(hub.host, hub.leafnode_port), host=hub.host, client_port=port)
        ),
    )
    leaf = procs.spawn([str(procs.nats_server_binary()), "-c", str(config)], stdout=subprocess.DEVNULL)
    try:
        procs.wait_for_port(hub.host, port, 10.0, leaf)
        async with _clients(regions, "us") as (us,), connect(f"nats://{hub.host}:{port}", "test-leaf") as edge:
            await us.subscribe(subjects.SUBMIT, cb=_respond)
            await settle(us)
            assert await _request_when_routed(edge, subjects.SUBMIT) == b"served:" + subjects.SUBMIT.encode()
            # and the region's account is the leaf's: us's imports are there too
            async with _clients(regions, "eu") as (eu,):
                await eu.subscribe(subjects.SUBMIT, cb=_respond)
                await settle(eu)
                assert await _request_when_routed(edge, subjects.to_region("eu", "submit"))
    finally:
        procs.stop([leaf])


# --- losing a region (last: it kills one) ----------------------------------------------------------


async def test_losing_a_region_leaves_the_other_two_talking_and_jetstream_working(regions):
    regions.kill("ap")
    async with _clients(regions, "us", "eu") as (us, eu):
        await eu.subscribe(subjects.SUBMIT, cb=_respond)
        await settle(eu)
        assert await _request_when_routed(us, subjects.to_region("eu", "submit"))
        created = await _add_stream(us, "AFTER_LOSS", ["after.>"])  # the meta group keeps 2 of 3
        assert created.config.name == "AFTER_LOSS"
    regions.start("ap")
    regions.wait_ready()
    async with _clients(regions, "eu", "ap") as (eu, ap):
        await ap.subscribe(subjects.SUBMIT, cb=_respond)
        await settle(ap)
        assert await _request_when_routed(eu, subjects.to_region("ap", "submit"))
