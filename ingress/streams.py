"""Token streams from the bus to the request that waits for them.

One subscription per ingress (``stream(ingress_id)``) carries the tokens of every
request this ingress serves; ``StreamRouter`` hands each chunk to its request's
``Inbox``. An inbox is bounded by construction: a request gets at most one chunk per
output token plus a terminal one, so ``max_tokens + slack`` never fills unless
something upstream misbehaves, in which case the request fails loudly.

The inbox is a deque and an event, not a memory object stream with a timeout per
receive: this is the per-token hot path. Idle streams are failed instead by one
watchdog for the whole ingress (``StreamRouter.expire_idle``).

``TokenSequencer`` turns chunks, possibly repeated or out of order (a retried prefill,
two publishers), into each output position exactly once.
"""

from __future__ import annotations

import logging
import time
from collections import deque

import anyio

from switchyard.ingress.errors import IngressError
from switchyard.observability import decoded
from switchyard.schemas import PromptUsage, StreamChunk, StreamError, codec

log = logging.getLogger(__name__)

_SLACK = 16


class Inbox:
    """The chunks of one request, from the router to its reader."""

    __slots__ = ("_wake", "chunks", "last_put", "limit", "request_id")

    def __init__(self, request_id: str, limit: int) -> None:
        self.request_id = request_id
        self.chunks: deque[StreamChunk] = deque()
        self.limit = limit
        self.last_put = time.monotonic()
        self._wake: anyio.Event | None = None

    def put(self, chunk: StreamChunk) -> bool:
        """False when full: the request is failed instead of growing without bound."""
        if len(self.chunks) >= self.limit:
            return False
        self.chunks.append(chunk)
        self.last_put = time.monotonic()
        if self._wake is not None:
            self._wake.set()
        return True

    def fail(self, code: str, message: str) -> None:
        self.chunks.append(
            StreamChunk(request_id=self.request_id, seq=0, error=StreamError(code=code, message=message))
        )
        if self._wake is not None:
            self._wake.set()

    async def wait(self) -> None:
        """Until at least one chunk is there."""
        while not self.chunks:
            self._wake = anyio.Event()
            try:
                await self._wake.wait()
            finally:
                self._wake = None


class StreamRouter:
    def __init__(self) -> None:
        self._inboxes: dict[str, Inbox] = {}
        self.unroutable = 0  # chunks for requests that already ended here
        self.overflows = 0

    def open(self, request_id: str, max_tokens: int) -> Inbox:
        inbox = Inbox(request_id, max_tokens + _SLACK)
        self._inboxes[request_id] = inbox
        return inbox

    def close(self, request_id: str) -> None:
        self._inboxes.pop(request_id, None)

    def __len__(self) -> int:
        return len(self._inboxes)

    async def serve(self, sub) -> None:
        async for _msg, batch in decoded(sub, codec.STREAM_BATCH, "stream batch"):
            for chunk in batch.chunks:
                self._route(chunk)

    def _route(self, chunk: StreamChunk) -> None:
        inbox = self._inboxes.get(chunk.request_id)
        if inbox is None:
            self.unroutable += 1
        elif not inbox.put(chunk):
            self.overflows += 1
            log.error("stream of %s overflowed; failing it", chunk.request_id)
            self.close(chunk.request_id)
            inbox.fail("overflow", "the token stream overflowed")

    def expire_idle(self, idle_s: float, now: float | None = None) -> int:
        """Fail every stream silent for ``idle_s``; returns how many."""
        now = time.monotonic() if now is None else now
        stale = [inbox for inbox in self._inboxes.values() if now - inbox.last_put > idle_s]
        for inbox in stale:
            self.close(inbox.request_id)
            inbox.fail("timeout", f"no token for {idle_s:.0f} s")
        return len(stale)

    async def watch_idle(self, idle_s: float) -> None:
        while True:
            await anyio.sleep(min(1.0, idle_s / 4))
            self.expire_idle(idle_s)


class StreamFailed(IngressError):
    def __init__(self, error: StreamError) -> None:
        super().__init__(error.message)
        self.error = error


class TokenSequencer:
    """Feeds chunks in any order; yields each output position's token once, in order."""

    def __init__(self) -> None:
        self.next_seq = 0
        self.usage: PromptUsage | None = None
        self.finish_reason: str | None = None
        self._held: dict[int, StreamChunk] = {}

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def feed(self, chunk: StreamChunk) -> list[int]:
        if chunk.error is not None:
            raise StreamFailed(chunk.error)
        if chunk.usage is not None and self.usage is None:
            self.usage = chunk.usage
        held = self._held.get(chunk.seq)
        if held is None or _reaches_further(chunk, held):
            self._held[chunk.seq] = chunk
        tokens: list[int] = []
        while not self.finished and (ready := self._next_ready()) is not None:
            tokens += self._take(ready)
        return tokens

    def _next_ready(self) -> StreamChunk | None:
        for seq in [s for s in self._held if s <= self.next_seq]:
            chunk = self._held.pop(seq)
            if seq + len(chunk.token_ids) > self.next_seq or chunk.finish_reason is not None:
                return chunk
        return None

    def _take(self, chunk: StreamChunk) -> list[int]:
        fresh = chunk.token_ids[self.next_seq - chunk.seq :]
        self.next_seq += len(fresh)
        if chunk.finish_reason is not None:
            self.finish_reason = chunk.finish_reason
        return fresh


def _reaches_further(new: StreamChunk, old: StreamChunk) -> bool:
    """Of two chunks at one position, keep the one that says more."""
    if len(new.token_ids) != len(old.token_ids):
        return len(new.token_ids) > len(old.token_ids)
    return new.finish_reason is not None and old.finish_reason is None
