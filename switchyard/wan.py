"""An emulated WAN between regions: a TCP relay before each region's gateway port.

The kernels here have no ``netem``, so round trips between regions are made by a relay that
listens on a region's advertised gateway address and forwards to its real gateway port. A
gateway connection is one-way in NATS terms (A's messages to B travel on A's outbound
connection, through B's relay; B's replies on B's outbound connection, through A's relay),
so each relay delays every byte, both ways, by *half* the pair's round trip: a request
A -> B -> A then takes the pair's RTT.

Which pair a connection belongs to is read off the wire: the server sends ``INFO {...}``
first (its JSON names its ``gateway``), then the dialer sends ``CONNECT {...}`` (naming its
own). Bytes before the CONNECT pass undelayed; every later byte is delayed. Order is kept
(one delay per connection, one writer per direction); there is no bandwidth limit, only a
bounded buffer per direction (``MAX_CHUNKS`` reads in flight), which slows the reader when
full. A side that closes is closed on the other after its last bytes are delivered.

Where the kernel has netem, ``tc qdisc ... netem delay`` does the same job (docs/federation.md).
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import time
import urllib.request
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import anyio
import anyio.abc
from anyio.streams.memory import MemoryObjectReceiveStream

from switchyard import nats_config, procs
from switchyard.nats_config import Address, RegionSpec, check_region_name, parse_address
from switchyard.settings import ConfigError

__all__ = ["MAX_CHUNKS", "LocalRegion", "Relay", "RttTable", "local_regions", "not_ready"]

log = logging.getLogger(__name__)

MAX_CHUNKS = 1024  # reads in flight per direction (each at most READ_BYTES)
READ_BYTES = 64 * 1024
_MAX_HELLO = 64 * 1024  # an INFO or CONNECT line longer than this is not a gateway's


@dataclass(frozen=True)
class RttTable:
    """Round trips in ms between pairs of regions, symmetric, with a default for the rest."""

    pairs: Mapping[frozenset[str], float] = field(default_factory=dict)
    default_ms: float = 0.0

    def rtt_ms(self, a: str | None, b: str | None) -> float:
        if a is None or b is None:
            return self.default_ms
        return self.pairs.get(frozenset((a, b)), self.default_ms)

    @classmethod
    def parse(cls, text: str) -> RttTable:
        """``us-eu=30,us-ap=70,eu-ap=140,*=10``: ms per pair, ``*`` the default (0 unless
        given). A pair of names that hold '-' themselves is written ``a:b``."""
        pairs: dict[frozenset[str], float] = {}
        default = 0.0
        for item in (part.strip() for part in text.split(",")):
            if not item:
                continue
            key, sep, value = item.partition("=")
            ms = _milliseconds(value, item) if sep else None
            if ms is None:
                raise ConfigError(f"--rtt-ms: {item!r} is not PAIR=MS (for example us-eu=30)")
            if key.strip() == "*":
                default = ms
                continue
            pair = _pair(key.strip(), item)
            if pair in pairs:
                raise ConfigError(f"--rtt-ms: the pair {key.strip()} is given twice")
            pairs[pair] = ms
        return cls(pairs=pairs, default_ms=default)

    def __str__(self) -> str:
        items = [f"{':'.join(sorted(p))}={ms:g}" for p, ms in self.pairs.items()]
        return ",".join([*items, f"*={self.default_ms:g}"])


def _milliseconds(text: str, item: str) -> float | None:
    try:
        ms = float(text)
    except ValueError:
        return None
    return ms if math.isfinite(ms) and ms >= 0 else None


def _pair(key: str, item: str) -> frozenset[str]:
    names = key.split(":") if ":" in key else key.split("-")
    if len(names) != 2 or names[0] == names[1]:
        raise ConfigError(f"--rtt-ms: {item!r}: a pair is two regions, a-b (or a:b when a name holds '-')")
    return frozenset(check_region_name(n) for n in names)


# --- the relay ---------------------------------------------------------------------------------


@dataclass
class _Link:
    """What one relayed connection has learnt of itself."""

    target: str | None = None  # the region whose gateway this relay stands before (its INFO)
    dialer: str | None = None  # the region that dialed (its CONNECT)
    delay_s: float = 0.0  # each way; 0 until the CONNECT is seen


# What a direction does with its first line's JSON (an INFO's, a CONNECT's).
_Sniff = Callable[[_Link, dict[str, object]], None]


class Relay:
    """Listens on ``listen`` and relays each connection to ``to``, delayed by ``rtt``.

    Run it in a task group: ``port = await tg.start(relay.serve)`` (the port it listens on,
    useful when ``listen.port`` is 0); cancelling the group closes every connection."""

    def __init__(self, listen: Address, to: Address, rtt: RttTable) -> None:
        self.listen = listen
        self.to = to
        self.rtt = rtt

    async def serve(self, *, task_status: anyio.abc.TaskStatus[int] = anyio.TASK_STATUS_IGNORED) -> None:
        listener = await anyio.create_tcp_listener(local_host=self.listen.host, local_port=self.listen.port)
        async with listener:
            port = listener.extra(anyio.abc.SocketAttribute.local_port)
            log.info("relaying %s:%d -> %s (%s)", self.listen.host, port, self.to, self.rtt)
            task_status.started(port)
            await listener.serve(self._relay)

    async def _relay(self, client: anyio.abc.SocketStream) -> None:
        """One connection, both ways. Its failure is its own: logged, never the listener's
        (a handler that raised would stop every other connection through this relay)."""
        try:
            async with client:
                await self._relay_to_upstream(client)
        except* Exception as group:
            log.warning("relayed connection to %s failed: %r", self.to, group.exceptions)

    async def _relay_to_upstream(self, client: anyio.abc.SocketStream) -> None:
        try:
            upstream = await anyio.connect_tcp(self.to.host, self.to.port)
        except OSError as exc:
            log.warning("relay to %s: %s", self.to, exc)
            return
        async with upstream, anyio.create_task_group() as tg:
            link = _Link()
            tg.start_soon(self._pipe, upstream, client, link, self._sniff_info, tg.cancel_scope)
            tg.start_soon(self._pipe, client, upstream, link, self._sniff_connect, tg.cancel_scope)

    def _sniff_info(self, link: _Link, hello: dict[str, object]) -> None:
        if isinstance(hello.get("gateway"), str):
            link.target = str(hello["gateway"])

    def _sniff_connect(self, link: _Link, hello: dict[str, object]) -> None:
        if isinstance(hello.get("gateway"), str):
            link.dialer = str(hello["gateway"])
        link.delay_s = self.rtt.rtt_ms(link.dialer, link.target) / 2000
        log.info("gateway %s -> %s: %.1f ms each way", link.dialer, link.target, link.delay_s * 1000)

    async def _pipe(
        self,
        src: anyio.abc.SocketStream,
        dst: anyio.abc.SocketStream,
        link: _Link,
        sniff: _Sniff,
        scope: anyio.CancelScope,
    ) -> None:
        """src -> dst, each chunk held until its time; then dst's write side is closed."""
        send, receive = anyio.create_memory_object_stream[tuple[float, bytes]](MAX_CHUNKS)
        try:
            async with anyio.create_task_group() as tg:
                tg.start_soon(_deliver, receive, dst)
                async with send:
                    hello = _Hello(sniff, link)
                    while True:
                        try:
                            chunk = await src.receive(READ_BYTES)
                        except anyio.EndOfStream:
                            break
                        hello.feed(chunk)
                        await send.send((time.monotonic() + link.delay_s, chunk))
            await dst.send_eof()
        # RuntimeError: uvloop's word for a transport already closed (the other side's pipe
        # ended the connection first)
        except* (anyio.BrokenResourceError, anyio.ClosedResourceError, OSError, RuntimeError):
            scope.cancel()  # one side is gone: the whole connection goes


async def _deliver(receive: MemoryObjectReceiveStream[tuple[float, bytes]], dst: anyio.abc.SocketStream) -> None:
    async with receive:
        async for due, chunk in receive:
            await _sleep_until(due)
            await dst.send(chunk)


async def _sleep_until(due: float) -> None:
    """Until ``time.monotonic()`` reaches ``due``, never before: the event loop's clock
    (``anyio.current_time``) is uvloop's, cached once an iteration in whole milliseconds,
    and a delay counted from it came up to 2 ms short on a round trip (CI measured 29.6 ms
    across a 30 ms pair)."""
    while (left := due - time.monotonic()) > 0:  # noqa: ASYNC110 (a clock is awaited, not an event)
        await anyio.sleep(left)


class _Hello:
    """Finds the first protocol line (INFO or CONNECT) of one direction and hands its JSON
    to ``sniff``, once."""

    def __init__(self, sniff: _Sniff, link: _Link) -> None:
        self._sniff = sniff
        self._link = link
        self._buffer = b""
        self.done = False

    def feed(self, chunk: bytes) -> None:
        if self.done:
            return
        self._buffer += chunk
        line, sep, _ = self._buffer.partition(b"\r\n")
        if not sep and len(self._buffer) < _MAX_HELLO:
            return
        self.done = True
        self._buffer = b""
        verb, _, body = line.partition(b" ")
        try:
            hello = json.loads(body) if verb in (b"INFO", b"CONNECT") and sep else {}
        except ValueError:
            hello = {}
        self._sniff(self._link, hello if isinstance(hello, dict) else {})


# --- switchyard wan-relay ----------------------------------------------------------------------


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.description = (
        "An emulated WAN for hosts without netem: listen on a region's advertised gateway address, relay "
        "to its real gateway port, and delay every byte of each gateway connection, both ways, by half the "
        "round trip of its pair of regions (read off the connection's INFO and CONNECT). docs/federation.md."
    )
    parser.add_argument(
        "--listen",
        required=True,
        metavar="HOST:PORT",
        help="the region's advertised gateway address (the others dial it)",
    )
    parser.add_argument("--to", required=True, metavar="HOST:PORT", help="the region's real gateway port")
    parser.add_argument(
        "--rtt-ms",
        default="",
        metavar="PAIRS",
        help="round trip per pair of regions, ms, symmetric: us-eu=30,us-ap=70,eu-ap=140,*=0 "
        "('*' the default; a:b where a name holds '-'); each way is delayed by half",
    )


def run(args: argparse.Namespace) -> int:
    relay = Relay(parse_address(args.listen, "--listen"), parse_address(args.to, "--to"), RttTable.parse(args.rtt_ms))
    from switchyard.cli import run_service

    run_service(relay.serve)
    return 0


# --- N regions on this machine -------------------------------------------------------------------


@dataclass(frozen=True)
class LocalRegion:
    """One region laid out on this machine: its server's config and command, and the relay
    that stands before its gateway (the address the others dial)."""

    name: str
    spec: RegionSpec
    config: Path
    nats_command: list[str]
    relay_command: list[str]

    @property
    def client_url(self) -> str:
        return f"nats://{self.spec.host}:{self.spec.client_port}"

    @property
    def monitor_url(self) -> str:
        return f"http://{self.spec.host}:{self.spec.http_port}"


def local_regions(
    names: Sequence[str], folder: Path, rtt: RttTable | str = "", host: str = "127.0.0.1"
) -> list[LocalRegion]:
    """Lay out ``names`` as regions on ``host``: free ports for each (client, cluster,
    gateway, its relay, leafnode, monitoring), each config written to ``folder/<name>.conf``
    and its JetStream store in ``folder/<name>/``. Starts nothing: run each region's
    ``nats_command`` and ``relay_command`` (``switchyard wan-relay``, delaying by ``rtt``)."""
    table = RttTable.parse(rtt) if isinstance(rtt, str) else rtt
    folder = folder.resolve()
    ports = _free_ports(host, 6 * len(names))
    specs = [
        RegionSpec(
            name=name,
            gateway=Address(host, next(ports)),  # the relay's: what the others dial
            host=host,
            client_port=next(ports),
            gateway_port=next(ports),
            cluster_port=next(ports),
            leafnode_port=next(ports),
            http_port=next(ports),
            store_dir=str(folder / name),
        )
        for name in names
    ]
    return [_lay_out(spec, specs, folder, table) for spec in specs]


def _lay_out(spec: RegionSpec, specs: Sequence[RegionSpec], folder: Path, rtt: RttTable) -> LocalRegion:
    config = nats_config.write(folder / f"{spec.name}.conf", nats_config.render(spec, specs))
    gateway = Address(spec.host, spec.listen_gateway_port)
    return LocalRegion(
        name=spec.name,
        spec=spec,
        config=config,
        nats_command=[str(procs.nats_server_binary()), "-c", str(config)],
        relay_command=procs.service_command(
            "wan-relay", "--listen", str(spec.gateway), "--to", str(gateway), "--rtt-ms", str(rtt)
        ),
    )


def _free_ports(host: str, count: int) -> Iterator[int]:
    """``count`` distinct free ports (each free when picked; a port may still be taken after)."""
    ports: list[int] = []
    while len(ports) < count:
        port = procs.free_port(host)
        if port not in ports:
            ports.append(port)
    return iter(ports)


def not_ready(regions: Sequence[LocalRegion]) -> str:
    """Why ``regions`` are not ready yet ("" once they are): each one's gateways connected both
    ways to each of the others, and a JetStream meta leader seen (their monitoring endpoints)."""
    names = {r.name for r in regions}
    for region in regions:
        try:
            gateways = _monitor(region, "gatewayz")
            jetstream = _monitor(region, "jsz")
        except OSError as exc:
            return f"{region.name}: {exc}"
        out, inbound = set(gateways.get("outbound_gateways", {})), set(gateways.get("inbound_gateways", {}))
        if not names - {region.name} <= out & inbound:
            return f"{region.name}: gateways out {sorted(out)}, in {sorted(inbound)}"
        if not jetstream.get("meta_cluster", {}).get("leader"):
            return f"{region.name}: no JetStream meta leader"
    return ""


def _monitor(region: LocalRegion, endpoint: str) -> dict:
    with urllib.request.urlopen(f"{region.monitor_url}/{endpoint}", timeout=1.0) as response:
        return json.load(response)
