"""The HTTP edge: what one connection may cost before, and while, the app serves it.

uvicorn's httptools protocol bounds none of this, so ``EdgeProtocol`` adds, per connection:

- **idle**: a fresh connection that sends nothing is closed after ``idle_timeout_s``, like one
  kept alive after a response (uvicorn's own keep-alive timer, armed at connect as well);
- **the head** (request line and headers) is at most ``max_header_bytes``, counted as the
  bytes arrive so the parser never buffers more, and at most ``max_headers`` fields (431); it
  must arrive within ``header_timeout_s`` of its first byte (408);
- **the body** must arrive within ``body_timeout_s`` of the head (408 if nothing was answered
  yet; the app, if reading it, sees a disconnect);
- **a client that stops reading**: writes pause as soon as the kernel's socket buffer is full
  (a high-water mark of 0: uvicorn then waits for the client before each write), and when the
  client takes no bytes for ``send_timeout_s`` the connection is aborted; the request sees a
  disconnect and cancels its work, so what is held for it is the kernel's buffers plus one
  message;
- **connections**: a request on a connection past ``max_connections`` gets 503 with
  ``Retry-After``.

A refusal is an OpenAI error body with ``connection: close``, written here, and the
connection closes. Everything runs in protocol callbacks on the event loop: no awaits, one
read timer and one write timer per connection.

Each refusal, each slow reader dropped and each fresh connection closed idle is counted in
``switchyard_edge_refusals_total{reason}`` (observability.metrics); a kept-alive connection
closed idle after a response is the normal end of one, not counted.

Counting the head: bytes are counted from the first byte of a request until the blank line
that ends its head, found by scanning each chunk (the 3 bytes before it carried over). A
pipelined request that starts inside a chunk is counted from the next chunk on; one chunk
(at most 256 KiB from asyncio) is the slack.
"""

from __future__ import annotations

import asyncio
import http
import logging
from dataclasses import dataclass
from typing import Any, cast

from starlette.requests import ClientDisconnect, Request
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol, RequestResponseCycle

from switchyard.ingress.config import IngressConfig
from switchyard.ingress.errors import ApiError, HeadersTooLarge, RequestTimeout, RequestTooLarge, Unavailable
from switchyard.observability import EDGE_REFUSAL_REASONS, ServingMetrics

log = logging.getLogger(__name__)

_END_OF_HEAD = b"\r\n\r\n"


@dataclass(frozen=True)
class EdgeLimits:
    max_connections: int
    max_header_bytes: int
    max_headers: int
    idle_timeout_s: float
    header_timeout_s: float
    body_timeout_s: float
    send_timeout_s: float

    @classmethod
    def of(cls, config: IngressConfig) -> EdgeLimits:
        return cls(
            max_connections=config.max_connections,
            max_header_bytes=config.max_header_bytes,
            max_headers=config.max_headers,
            idle_timeout_s=config.keep_alive_timeout_s,
            header_timeout_s=config.header_timeout_s,
            body_timeout_s=config.body_timeout_s,
            send_timeout_s=config.send_timeout_s,
        )


def edge_protocol(limits: EdgeLimits, metrics: ServingMetrics) -> type[asyncio.Protocol]:
    """The protocol class uvicorn is given: ``EdgeProtocol`` bound to ``limits`` and ``metrics``."""
    bound = {"limits": limits, "metrics": metrics}
    return cast("type[asyncio.Protocol]", type("EdgeProtocol", (EdgeProtocol,), bound))


class EdgeProtocol(HttpToolsProtocol):
    # Both set on the subclass edge_protocol() makes.
    limits: EdgeLimits
    metrics: ServingMetrics

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._reading_head = True
        self._head_bytes = 0
        self._carry = b""  # the last bytes of the head so far: the blank line may straddle chunks
        self._fields = 0
        self._read_timer: asyncio.TimerHandle | None = None
        self._write_timer: asyncio.TimerHandle | None = None
        self._refusal: ApiError | None = None  # decided inside a parser callback, sent after it
        self._refused = False
        self._reading_body: RequestResponseCycle | None = None  # the cycle whose body is due
        self._fresh = True  # no byte received yet: an idle close is then counted

    # --- connection -----------------------------------------------------------------------

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        # Paused as soon as the kernel's buffer is full: the app then waits for the client
        # (uvicorn drains before each write), and the write timer watches every stall.
        transport.set_write_buffer_limits(high=0)
        # uvicorn arms its keep-alive timer only after a response; a first request is due as soon.
        self.timeout_keep_alive_task = self.loop.call_later(self.limits.idle_timeout_s, self.timeout_keep_alive_handler)

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm_read()
        if self._write_timer is not None:
            self._write_timer.cancel()
        super().connection_lost(exc)

    def timeout_keep_alive_handler(self) -> None:
        if self._fresh and not self.transport.is_closing():
            self._count("idle")
        super().timeout_keep_alive_handler()

    def data_received(self, data: bytes) -> None:
        self._fresh = False
        if self._refused:
            return
        if self._reading_head and not self._count_head(data):
            self._count("headers_too_large")
            self._refuse(HeadersTooLarge(f"The request head exceeds {self.limits.max_header_bytes} bytes."))
            return
        super().data_received(data)
        if self._refusal is not None:
            self._refuse(self._refusal)

    def _count_head(self, data: bytes) -> bool:
        """Counts this chunk's part of the head; False once the head is too large."""
        if self._head_bytes == 0:
            self._arm_read(self.limits.header_timeout_s, "request head", "head_timeout")
        window = self._carry + data
        end = window.find(_END_OF_HEAD)
        self._head_bytes += end + len(_END_OF_HEAD) - len(self._carry) if end >= 0 else len(data)
        self._carry = window[-(len(_END_OF_HEAD) - 1) :]
        return self._head_bytes <= self.limits.max_header_bytes

    # --- parser callbacks ------------------------------------------------------------------

    def on_header(self, name: bytes, value: bytes) -> None:
        self._fields += 1
        if self._fields > self.limits.max_headers:
            if self._refusal is None:
                self._count("too_many_headers")
                self._refusal = HeadersTooLarge(f"A request may have at most {self.limits.max_headers} headers.")
            return
        super().on_header(name, value)

    def on_headers_complete(self) -> None:
        self._reading_head = False
        self._disarm_read()
        if self._refusal is not None:
            return
        if len(self.connections) > self.limits.max_connections:
            self._count("too_many_connections")
            self._refusal = Unavailable(
                f"This server is at its limit of {self.limits.max_connections} connections.",
                code="too_many_connections",
                retry_after_s=1.0,
            )
            return
        super().on_headers_complete()
        self._reading_body = self.cycle
        if not self.pipeline:  # a pipelined request is not read until its turn
            self._arm_read(self.limits.body_timeout_s, "request body", "body_timeout")

    def on_body(self, body: bytes) -> None:
        if self._refusal is None:
            super().on_body(body)

    def on_message_complete(self) -> None:
        self._disarm_read()
        self._reading_body = None
        self._reading_head, self._head_bytes, self._carry, self._fields = True, 0, b"", 0
        if self._refusal is None:
            super().on_message_complete()

    # --- writes the client does not take ---------------------------------------------------

    def pause_writing(self) -> None:
        super().pause_writing()
        if self._write_timer is None:
            self._arm_write()

    def _arm_write(self) -> None:
        buffered = self.transport.get_write_buffer_size()
        self._write_timer = self.loop.call_later(self.limits.send_timeout_s, self._stalled, buffered)

    def resume_writing(self) -> None:
        super().resume_writing()
        if self._write_timer is not None:
            self._write_timer.cancel()
            self._write_timer = None

    def _stalled(self, buffered: int) -> None:
        if self.transport.get_write_buffer_size() < buffered:  # slow, but taking bytes
            self._arm_write()
            return
        log.warning("%s took no response bytes for %.0f s; dropping it", _peer(self.client), self.limits.send_timeout_s)
        self._count("slow_reader")
        self.transport.abort()  # connection_lost tells the request, which cancels its work

    # --- the read timer ----------------------------------------------------------------------

    def _arm_read(self, timeout_s: float, what: str, reason: str) -> None:
        self._disarm_read()
        self._read_timer = self.loop.call_later(timeout_s, self._late, what, timeout_s, reason)

    def _disarm_read(self) -> None:
        if self._read_timer is not None:
            self._read_timer.cancel()
            self._read_timer = None

    def _late(self, what: str, timeout_s: float, reason: str) -> None:
        self._read_timer = None
        log.info("%s: the %s did not arrive within %.0f s", _peer(self.client), what, timeout_s)
        self._count(reason)
        self._refuse(RequestTimeout(f"The {what} did not arrive within {timeout_s:g} s."))

    # --- refusing ----------------------------------------------------------------------------

    def _count(self, reason: str) -> None:
        assert reason in EDGE_REFUSAL_REASONS, reason  # a new reason is declared there, at 0
        self.metrics.edge_refusals.labels(reason=reason).inc()

    def _refuse(self, error: ApiError) -> None:
        """Answer ``error`` unless this request was answered already, and close."""
        self._refused = True
        self._disarm_read()
        if self._reading_body is not None:  # the app has the request: answer only if it has not
            answer = not self._reading_body.response_started
        else:  # a head: answer unless an earlier response on this connection is still going
            answer = self.cycle is None or self.cycle.response_complete
        if self.cycle is not None and not self.cycle.response_complete:
            self.cycle.disconnected = True  # the app hears a disconnect and writes nothing more
            self.cycle.message_event.set()
        if self.transport.is_closing():
            return
        if answer:
            self.transport.write(_response(error, self.server_state.default_headers))
        self.transport.close()


def _response(error: ApiError, default_headers: list[tuple[bytes, bytes]]) -> bytes:
    body = error.encoded()
    headers = [
        *default_headers,
        (b"content-type", b"application/json"),
        (b"content-length", str(len(body)).encode()),
        (b"connection", b"close"),
        *((name.encode(), value.encode()) for name, value in error.headers().items()),
    ]
    status = f"HTTP/1.1 {error.status} {http.HTTPStatus(error.status).phrase}\r\n".encode()
    return status + b"".join(name + b": " + value + b"\r\n" for name, value in headers) + b"\r\n" + body


def _peer(client: tuple[str, int] | None) -> str:
    return f"{client[0]}:{client[1]}" if client else "a client"


async def read_body(request: Request, limit: int) -> bytes:
    """A JSON body, refused (413) past ``limit`` bytes: at once when its content-length says so,
    else as soon as the bytes arriving pass it, so it is never held whole first; one cut off
    (gone, or past the body deadline above) is a 408."""
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise RequestTooLarge(f"The request body is {declared} bytes; the limit is {limit}.")
    parts, size = [], 0
    try:
        async for part in request.stream():
            size += len(part)
            if size > limit:
                raise RequestTooLarge(f"The request body exceeds the limit of {limit} bytes.")
            parts.append(part)
    except ClientDisconnect:
        raise RequestTimeout("The request body did not arrive in full.") from None
    return b"".join(parts)
