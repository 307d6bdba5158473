"""Token streams from the bus to the request that waits for them.

One subscription per ingress (``stream(ingress_id)``) carries the tokens of every
request this ingress serves; ``StreamRouter`` hands each chunk to its request's
memory stream. That stream is bounded by construction: a request gets at most one
chunk per output token plus a terminal one, so ``max_tokens + slack`` never fills
unless something upstream misbehaves, in which case the request fails loudly.

``TokenSequencer`` turns chunks, possibly repeated or out of order (a retried prefill,
two publishers), into each output position exactly once.
"""

from __future__ import annotations

import logging

import anyio
import msgspec
from anyio.streams.memory import MemoryObjectReceiveStream, MemoryObjectSendStream

from schemas import PromptUsage, StreamChunk, StreamError, codec

log = logging.getLogger(__name__)

_SLACK = 16


class StreamRouter:
    def __init__(self) -> None:
        self._routes: dict[str, MemoryObjectSendStream[StreamChunk]] = {}
        self.unroutable = 0  # chunks for requests that already ended here
        self.overflows = 0

    def open(self, request_id: str, max_tokens: int) -> MemoryObjectReceiveStream[StreamChunk]:
        send, receive = anyio.create_memory_object_stream[StreamChunk](max_tokens + _SLACK)
        self._routes[request_id] = send
        return receive

    def close(self, request_id: str) -> None:
        send = self._routes.pop(request_id, None)
        if send is not None:
            send.close()

    def __len__(self) -> int:
        return len(self._routes)

    async def serve(self, sub) -> None:
        async for msg in sub.messages:
            try:
                batch = codec.STREAM_BATCH.decode(msg.data)
            except msgspec.DecodeError as exc:
                log.warning("undecodable stream batch: %s", exc)
                continue
            for chunk in batch.chunks:
                self._route(chunk)

    def _route(self, chunk: StreamChunk) -> None:
        send = self._routes.get(chunk.request_id)
        if send is None:
            self.unroutable += 1
            return
        try:
            send.send_nowait(chunk)
        except anyio.WouldBlock:
            self.overflows += 1
            log.error("stream of %s overflowed; failing it", chunk.request_id)
            self.close(chunk.request_id)  # the reader sees the end and reports an error
        except (anyio.BrokenResourceError, anyio.ClosedResourceError):
            self.close(chunk.request_id)


class StreamFailed(Exception):
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
        fresh = chunk.token_ids[self.next_seq - chunk.seq:]
        self.next_seq += len(fresh)
        if chunk.finish_reason is not None:
            self.finish_reason = chunk.finish_reason
        return fresh


def _reaches_further(new: StreamChunk, old: StreamChunk) -> bool:
    """Of two chunks at one position, keep the one that says more."""
    if len(new.token_ids) != len(old.token_ids):
        return len(new.token_ids) > len(old.token_ids)
    return new.finish_reason is not None and old.finish_reason is None
