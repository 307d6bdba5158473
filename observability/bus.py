"""The instrumented NATS connection every service uses.

Core NATS drops messages for a slow consumer rather than slowing the publisher, so
every subscription here is created with explicit pending limits, and every drop is
counted (``BusStats.dropped``) and logged instead of vanishing in a callback.
Subscriptions are consumed by the caller's own task (``async for msg in
sub.messages``), never by callbacks whose errors would disappear.

The connection is watched. A server that goes away (killed, restarted) is reconnected
to forever, subscriptions kept. But nats-py never reconnects after a close the server
initiated (a protocol line over ``max_control_line``, a permissions or auth error):
its subscriptions' readers then just end, and a process would live on with a dead
connection, which no supervisor restarts. So such a close cancels the body of
``connect`` and raises ``BusClosedError`` out of it, and out of the service's
``run()``: the process exits non-zero and ``switchyard up`` (or any process manager)
starts it again on a fresh connection.

Who connects is a setting of every service (``NatsClientConfig``: ``--nats-credentials-file``,
``--nats-tls-ca``): a credentials file, never a password on a command line, and never a
password in a log line (``redacted`` hides what a URL carries). The file names the user,
its password and the inbox prefix its NATS permissions give it (``schemas.permissions``);
no file means no authentication. A permissions violation does not close the connection
(the server answers ``-ERR`` and carries on): a refused publish is logged as an error and
counted (``BusStats.denied``); a refused subscription, or credentials the server refuses
(which nats-py would retry forever), raise ``BusAuthError`` out of the block like a close:
the service cannot do its work, and says why.
"""

from __future__ import annotations

import logging
import re
import ssl
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Any, Protocol, TypeVar

import anyio
import anyio.lowlevel
import msgspec
import nats
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription
from nats.errors import SlowConsumerError

from switchyard.schemas import ConfigStruct, SwitchyardError, permissions, setting

log = logging.getLogger(__name__)

PENDING_MSGS = 65_536
PENDING_BYTES = 256 * 1024 * 1024

T_co = TypeVar("T_co", covariant=True)


class Decodes(Protocol[T_co]):
    """What ``decoded`` needs of a codec (``schemas.codec.Codec`` is one)."""

    def decode(self, data: bytes) -> T_co: ...


class BusClosedError(SwitchyardError):
    """The NATS server closed this connection for good: nats-py will not reconnect."""

    def __init__(self, name: str, reason: Exception | None) -> None:
        super().__init__(f"{name}: the NATS connection was closed by the server ({reason!r}); not reconnecting")
        self.name = name
        self.reason = reason


class BusAuthError(SwitchyardError):
    """Credentials or TLS settings this connection cannot use (no file, not readable, malformed)."""


class NatsClientConfig(ConfigStruct, frozen=True, kw_only=True):
    """Who a service is to NATS, and how it checks the server (a subtree of each service's config)."""

    credentials_file: Annotated[
        str, setting("file with this service's NATS user and password (`switchyard nats-auth` writes them)")
    ] = ""
    tls_ca: Annotated[str, setting("CA certificate (PEM) that the NATS server's TLS certificate must chain to")] = ""


DEFAULT_NATS_URL = "nats://127.0.0.1:4222"
# The two settings every service's tree has for its connection, declared here once.
NatsUrl = Annotated[str, setting("NATS server URL", flag="nats", min_length=1)]
NatsClient = Annotated[NatsClientConfig, setting("the NATS connection's credentials and TLS", prefix="nats-")]


@dataclass(frozen=True)
class Credentials:
    """One NATS user, as a credentials file holds it (JSON)."""

    user: str
    password: str = field(repr=False)
    inbox_prefix: str = permissions.DEFAULT_INBOX


def load_credentials(path: str) -> Credentials:
    try:
        return msgspec.json.decode(Path(path).read_bytes(), type=Credentials)
    except (OSError, msgspec.DecodeError) as exc:  # the message names no secret: msgspec quotes no values
        raise BusAuthError(f"NATS credentials file {path}: {exc}") from None


_USERINFO = re.compile(r"//[^/@]*@")


def redacted(url: str) -> str:
    """``url`` with whatever it carries before an ``@`` (user, password, token) replaced by ``***``."""
    return _USERINFO.sub("//***@", url)


def _client_options(url: str, client: NatsClientConfig) -> dict[str, Any]:
    options: dict[str, Any] = {}
    if client.credentials_file:
        if _USERINFO.search(url):
            raise BusAuthError(f"{redacted(url)}: credentials both in the URL and in --nats-credentials-file")
        creds = load_credentials(client.credentials_file)
        options |= {"user": creds.user, "password": creds.password, "inbox_prefix": creds.inbox_prefix}
    if client.tls_ca:
        try:
            options["tls"] = ssl.create_default_context(cafile=client.tls_ca)
        except (OSError, ssl.SSLError) as exc:
            raise BusAuthError(f"NATS TLS CA {client.tls_ca}: {exc}") from None
    return options


@dataclass
class BusStats:
    dropped: int = 0  # messages a slow subscription lost
    denied: int = 0  # publishes and subscriptions the server's permissions refused
    errors: int = 0  # other asynchronous client errors
    reconnects: int = 0  # times the connection came back after the server went away


@asynccontextmanager
async def connect(
    url: str, name: str, stats: BusStats | None = None, client: NatsClientConfig | None = None
) -> AsyncIterator[Client]:
    """A connection that reconnects forever to a server that went away, and raises
    ``BusClosedError`` out of the block if the server closes it; flushed and closed on
    exit (shielded). ``client``: its credentials and TLS (none: anonymous, plain)."""
    stats = stats if stats is not None else BusStats()
    options = _client_options(url, client or NatsClientConfig())
    watch = _Watch(name, stats)

    async def on_error(exc: Exception) -> None:
        if isinstance(exc, SlowConsumerError):
            stats.dropped += 1
            if stats.dropped in (1, 10, 100) or stats.dropped % 1000 == 0:
                log.warning("%s: slow consumer on %s, %d messages dropped so far", name, exc.subject, stats.dropped)
        elif "authorization violation" in str(exc).lower():  # who we are, refused: retrying cannot help
            watch.refuse(BusAuthError(f"{name}: the NATS server refused these credentials ({exc})"))
        elif "permissions violation" in str(exc).lower():
            stats.denied += 1
            if "subscription" in str(exc).lower():  # something this service must hear: it cannot work
                watch.refuse(BusAuthError(f"{name}: NATS refused a subscription this service needs: {exc}"))
            else:
                log.error("%s: NATS refused it: %s", name, exc)
        else:
            stats.errors += 1
            # While reconnecting, every refused attempt (5 a second) is an error: said once, by disconnected().
            quiet = watch.nc is not None and not watch.nc.is_connected and not watch.nc.is_closed
            log.log(logging.DEBUG if quiet else logging.WARNING, "%s: NATS error: %r", name, exc)

    with watch.first:
        nc = await nats.connect(
            url,
            name=name,
            error_cb=on_error,
            disconnected_cb=watch.disconnected,
            reconnected_cb=watch.reconnected,
            closed_cb=watch.closed,
            max_reconnect_attempts=-1,
            reconnect_time_wait=0.2,
            connect_timeout=5,
            **options,
        )
    if watch.lost is not None:  # refused before the first connection was made
        raise watch.lost
    watch.nc = nc
    try:
        with watch.scope:
            yield nc
    except Exception as exc:  # the block's cleanup tripped over the dead connection (a goodbye message)
        if watch.lost is None:
            raise
        raise watch.lost from exc
    finally:
        watch.closing = True  # our own close below is no loss
        # Flush what we published, then close. Not drain(): our subscription readers
        # are already cancelled, so drain would wait on their pending queues forever.
        with anyio.move_on_after(5, shield=True):
            if nc.is_connected:
                with anyio.move_on_after(2):
                    await settle(nc)
            await nc.close()
    if watch.lost is not None:
        raise watch.lost


class _Watch:
    """nats-py's connection callbacks, turned into log lines and, for a close we did not
    ask for or a refusal of who we are or of what we must hear, the cancellation of the
    ``connect`` block (``scope``, or the first connection attempts, ``first``) and the
    error it raises."""

    def __init__(self, name: str, stats: BusStats) -> None:
        self.name = name
        self.stats = stats
        self.scope = anyio.CancelScope()
        self.first = anyio.CancelScope()
        self.nc: Client | None = None
        self.closing = False
        self.lost: SwitchyardError | None = None

    def refuse(self, error: BusAuthError) -> None:
        if self.lost is None:
            self.lost = error
            log.error("%s", error)
        self.first.cancel()
        self.scope.cancel()

    async def disconnected(self) -> None:
        if not self.closing and self.nc is not None and not self.nc.is_closed:  # else closed() says it
            log.warning("%s: disconnected from NATS; reconnecting", self.name)

    async def reconnected(self) -> None:
        self.stats.reconnects += 1
        log.info("%s: reconnected to NATS", self.name)

    async def closed(self) -> None:
        if self.closing:
            return
        if self.lost is None:  # else refuse() said why
            self.lost = BusClosedError(self.name, self.nc.last_error if self.nc is not None else None)
            log.error("%s", self.lost)
        self.scope.cancel()


async def decoded(sub: Subscription, codec: Decodes[T_co], what: str) -> AsyncIterator[tuple[Msg, T_co]]:
    """``(msg, message)`` for each message of ``sub`` that ``codec`` decodes; one that it
    cannot is logged and skipped, never the end of the subscription's reader."""
    async for msg in sub.messages:
        try:
            message = codec.decode(msg.data)
        except msgspec.DecodeError as exc:
            log.warning("undecodable %s on %s: %s", what, msg.subject, exc)
            continue
        yield msg, message


async def subscribe(nc: Client, subject: str, queue: str = "") -> Subscription:
    return await nc.subscribe(subject, queue=queue, pending_msgs_limit=PENDING_MSGS, pending_bytes_limit=PENDING_BYTES)


_SETTLE_TURNS = 100


async def settle(nc: Client) -> None:
    """Return once the server has every command given on ``nc`` so far: a subscription
    made before it is heard from here on, by any connection. ``nc.flush()`` alone does not
    promise that. nats-py writes flush()'s PING straight to the socket, ahead of the
    commands still queued for its flusher task, so the PONG can come back before the server
    has read the SUBs just made, and a request from another connection then finds no
    responder (a worker that said it was ready, refusing its first task). So the flusher is
    given its turns until nothing is queued (it writes the queue in one go), and only then
    the PING goes out, behind everything. A connection that others keep publishing on may
    never be empty: after ``_SETTLE_TURNS`` turns its PING goes anyway."""
    for _ in range(_SETTLE_TURNS):
        if not nc.is_connected or nc.pending_data_size == 0:
            break
        await anyio.lowlevel.checkpoint()
    await nc.flush()
