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

A request's chunks are accepted only from the workers the scheduler assigned to it: the
subject names the sender (``subjects.stream``; NATS permissions let a worker publish
under its own id only), and the scheduler announces each assignment (a chunk with
``assigned``) before the worker hears of the task. A chunk from a sender not assigned
is held, a few per request, in case the announcement is still on its way (two
publishers are not ordered across a NATS cluster), and refused (counted) if none comes
before the stream ends. A migration starts the list afresh: the lost run's late chunks
are refused.

Core NATS delivers at most once: while the connection is down (a nats-server restart),
chunks are lost, and a stream waiting for them would wait for the idle timeout. So when
the connection comes back, every stream is suspect for a while; a suspect stream that
has begun and makes no progress for ``stall_s`` (a gap it cannot fill, or silence) is
failed with ``stream_lost``, and its generation continues it elsewhere after the tokens
it has (``ingress.generation``), as when its worker dies.

A scheduler that starts (or takes over) rolls call. When a new one does, what the last
one only had in memory may be gone: a stream not yet assigned to any worker was queued
there, and is failed with ``scheduler_failover`` (its generation submits it again: the
new scheduler replaces any copy a standby kept); every other stream is suspect, as after
a reconnect (a request waiting for decode room is held by no worker).
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Collection, Iterable

import anyio

from switchyard.ingress.errors import IngressError
from switchyard.observability import BusStats, decoded
from switchyard.schemas import PromptUsage, StreamChunk, StreamError, TokenLogprobs, codec, subjects

log = logging.getLogger(__name__)

_SLACK = 16
_FOREIGN = 32  # chunks held per request from a sender not (yet) assigned
_SUSPECT_S = 30.0  # how long after a reconnect a stream is watched for a stall


class Inbox:
    """The chunks of one request, from the router to its reader."""

    __slots__ = (
        "_wake",
        "chunks",
        "foreign",
        "last_put",
        "limit",
        "progress_at",
        "received_at",
        "request_id",
        "senders",
        "suspect_since",
    )

    def __init__(self, request_id: str, limit: int) -> None:
        self.request_id = request_id
        self.chunks: deque[StreamChunk] = deque()
        self.limit = limit
        self.last_put = time.monotonic()
        self.senders: set[str] = set()  # the workers assigned to it
        self.foreign: list[tuple[str, StreamChunk]] = []  # from senders not assigned (yet)
        self.progress_at: float | None = None  # when its reader last took a token
        self.received_at: float | None = None  # when a chunk last came for it
        self.suspect_since: float | None = None  # when the bus came back, while it is watched
        self._wake: anyio.Event | None = None

    def assign(self, sender: str) -> list[StreamChunk]:
        """``sender`` serves the request now; the chunks it sent before we knew."""
        self.senders.add(sender)
        early = [chunk for who, chunk in self.foreign if who == sender]
        self.foreign = [(who, chunk) for who, chunk in self.foreign if who != sender]
        return early

    def hold(self, sender: str, chunk: StreamChunk) -> bool:
        """False when too many are held already: refuse it."""
        if len(self.foreign) >= _FOREIGN:
            return False
        self.foreign.append((sender, chunk))
        return True

    def reassign(self) -> int:
        """A migration: no worker is assigned until the scheduler says; returns how many
        held chunks are refused with the old assignments."""
        refused = len(self.foreign)
        self.senders.clear()
        self.foreign.clear()
        return refused

    def put(self, chunk: StreamChunk) -> bool:
        """False when full: the request is failed instead of growing without bound."""
        if len(self.chunks) >= self.limit:
            return False
        self.chunks.append(chunk)
        self.last_put = self.received_at = time.monotonic()
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
        self.refused = 0  # chunks from a sender the scheduler never assigned to their request
        self.schedulers: set[str] = set()  # the ids of the schedulers whose chunks we had

    def open(self, request_id: str, max_tokens: int, choices: int = 1) -> Inbox:
        """Each choice (``n``) sends its own chunks, up to one a token and its usage."""
        inbox = Inbox(request_id, choices * (max_tokens + 1) + _SLACK)
        self._inboxes[request_id] = inbox
        return inbox

    def close(self, request_id: str) -> None:
        inbox = self._inboxes.pop(request_id, None)
        if inbox is not None and inbox.foreign:
            self._refuse(inbox, inbox.foreign[0][0], len(inbox.foreign))

    def fail(self, request_id: str, code: str, message: str) -> bool:
        """End a request's stream with ``code`` (its region went dark); False if it has ended."""
        inbox = self._inboxes.get(request_id)
        if inbox is None:
            return False
        inbox.fail(code, message)
        return True

    def reassign(self, inbox: Inbox) -> None:
        self.refused += inbox.reassign()

    def __len__(self) -> int:
        return len(self._inboxes)

    async def serve(self, sub) -> None:
        async for msg, batch in decoded(sub, codec.STREAM_BATCH, "stream batch"):
            sender = subjects.stream_sender(msg.subject)
            if sender == subjects.SCHEDULER_SENDER and len(self.schedulers) < 64:
                self.schedulers.add(batch.sender)  # which replica: said in the body
            for chunk in batch.chunks:
                self.route(chunk, sender)

    def route(self, chunk: StreamChunk, sender: str) -> None:
        inbox = self._inboxes.get(chunk.request_id)
        if inbox is None:
            self.unroutable += 1
        elif sender == subjects.SCHEDULER_SENDER:
            if chunk.assigned is None:
                self._deliver(inbox, chunk)  # an error the scheduler ends the stream with
            else:
                for early in inbox.assign(chunk.assigned):
                    self._deliver(inbox, early)
        elif sender in inbox.senders:
            self._deliver(inbox, chunk)
        elif not inbox.hold(sender, chunk):
            self._refuse(inbox, sender, 1)

    def _refuse(self, inbox: Inbox, sender: str, count: int) -> None:
        self.refused += count
        log.warning("refused %d chunk(s) of %s from %s, which it was not assigned to", count, inbox.request_id, sender)

    def _deliver(self, inbox: Inbox, chunk: StreamChunk) -> None:
        if not inbox.put(chunk):
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

    def suspect_all(self, now: float | None = None) -> None:
        """The bus came back: chunks of any stream may have been lost meanwhile."""
        _suspect(self._inboxes.values(), time.monotonic() if now is None else now)

    def scheduler_changed(self, scheduler_id: str, request_ids: Collection[str] | None = None) -> int:
        """A new scheduler rolled call (or, for ``request_ids`` only, another region's new
        scheduler published its first summary); returns how many queued streams are
        submitted again."""
        if request_ids is None:
            inboxes = list(self._inboxes.values())
        else:
            inboxes = [self._inboxes[rid] for rid in request_ids if rid in self._inboxes]
        _suspect(inboxes, time.monotonic())
        queued = [inbox for inbox in inboxes if not inbox.senders]
        for inbox in queued:
            inbox.fail("scheduler_failover", f"scheduler {scheduler_id} took over; it may not know this request")
        return len(queued)

    async def watch_schedulers(self, sub) -> None:
        """Roll calls: one by a scheduler id not heard before, when another scheduler was
        (by its roll call or its chunks), means that one was replaced; an audit rolls call
        under the id that already did."""
        called: set[str] = set()
        async for _, call in decoded(sub, codec.ROLL_CALL, "roll call"):
            new = call.scheduler_id
            if new not in called and (called or self.schedulers - {new}):
                queued = self.scheduler_changed(new)
                log.warning("scheduler %s took over; submitting %d queued streams again", new, queued)
            called.add(new)

    def expire_stalled(self, stall_s: float, now: float | None = None) -> int:
        """Fail, as ``stream_lost``, every suspect stream that has begun and has taken no
        token for ``stall_s``; its route stays open for the run that continues it. Begun: a
        token taken, or chunks come since the reconnect of which none could be taken (its
        first ones lost). One that has had nothing may be queued: it is left alone."""
        now = time.monotonic() if now is None else now
        stalled = 0
        for inbox in self._inboxes.values():
            since = inbox.suspect_since
            if since is None:
                continue
            if now - since > _SUSPECT_S:
                inbox.suspect_since = None
                continue
            if inbox.progress_at is not None:
                last = max(since, inbox.progress_at)
            elif inbox.received_at is not None and inbox.received_at > since:
                last = since
            else:
                continue
            if now - last > stall_s:
                inbox.suspect_since = None
                inbox.fail("stream_lost", f"no token for {stall_s:g} s after the NATS connection came back")
                stalled += 1
        return stalled

    async def watch_idle(self, idle_s: float, stall_s: float = 3.0, stats: BusStats | None = None) -> None:
        """Fail silent streams; after each reconnect (``stats``), stalled ones."""
        reconnects = stats.reconnects if stats is not None else 0
        while True:
            await anyio.sleep(min(1.0, idle_s / 4, stall_s / 4))
            if stats is not None and stats.reconnects != reconnects:
                reconnects = stats.reconnects
                self.suspect_all()
            self.expire_idle(idle_s)
            if self.expire_stalled(stall_s):
                log.warning("streams stalled after the NATS connection came back: continuing them elsewhere")


def _suspect(inboxes: Iterable[Inbox], now: float) -> None:
    for inbox in inboxes:
        inbox.suspect_since = now


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
        # The logprobs of every token taken, in order, when the request asked for them.
        self.logprobs: list[TokenLogprobs] = []

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

    def drop_ahead(self) -> None:
        """Forget chunks held past the next position: they belong to a run given up on."""
        self._held.clear()

    def _next_ready(self) -> StreamChunk | None:
        for seq in [s for s in self._held if s <= self.next_seq]:
            chunk = self._held.pop(seq)
            if seq + len(chunk.token_ids) > self.next_seq or chunk.finish_reason is not None:
                return chunk
        return None

    def _take(self, chunk: StreamChunk) -> list[int]:
        fresh = chunk.token_ids[self.next_seq - chunk.seq :]
        if chunk.logprobs is not None:
            self.logprobs += chunk.logprobs[self.next_seq - chunk.seq :]
        self.next_seq += len(fresh)
        if chunk.finish_reason is not None:
            self.finish_reason = chunk.finish_reason
        return fresh


def _reaches_further(new: StreamChunk, old: StreamChunk) -> bool:
    """Of two chunks at one position, keep the one that says more."""
    if len(new.token_ids) != len(old.token_ids):
        return len(new.token_ids) > len(old.token_ids)
    return new.finish_reason is not None and old.finish_reason is None
