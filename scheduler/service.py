"""The scheduler on the bus: a thin async loop around ``SchedulerCore``.

Inputs arrive on five subscriptions (submits, worker events, cancels, task acks, KV
events) and a ticker; each is fed to the core synchronously, in this one event loop,
so the core needs no locks. The core's actions are carried out at once by the task
that fed it: a dispatch is published straight away (it is on the token's path), with
a reply subject on the scheduler's own ack inbox. Acks, refusals and NATS's
no-responders status come back there; a dispatch unanswered for ``dispatch_timeout_s``
times out on the ticker. Every failure goes back into the core, which decides what to
retry.

KV events (``KV_EVENTS``) feed the core's prefix index. A snapshot the core asks for
(a worker joined, or its events had a gap) is a request/reply that can take up to
``snapshot_timeout_s``, too slow to await in the task that decided it: the worker id
goes into a bounded stream, and a few fetcher tasks of the service's own task group
carry the requests out and feed each answer (or its failure) back to the core. A
fresh scheduler thus rebuilds the whole index from the running workers: its roll call
registers them, and each registration asks a snapshot.
"""

from __future__ import annotations

import itertools
import logging
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass

import anyio
import msgspec
import nats.errors
from anyio.abc import TaskStatus
from nats.aio.client import Client
from nats.aio.subscription import Subscription

from switchyard.observability import BusStats, connect, decoded, redacted, subscribe, tracing
from switchyard.scheduler.config import SchedulerServiceConfig
from switchyard.scheduler.core import (
    Action,
    BindSession,
    Dispatch,
    DispatchOutcome,
    FailStream,
    RequestSnapshot,
    SchedulerCore,
)
from switchyard.scheduler.session_store import SessionStore
from switchyard.scheduler.sessions import Binding
from switchyard.schemas import (
    KvSnapshot,
    KvSnapshotRequest,
    RollCall,
    StatusRequest,
    StreamBatch,
    StreamChunk,
    SubmitRequest,
    codec,
    subjects,
)

log = logging.getLogger(__name__)

_NO_RESPONDERS = "503"
# Snapshots waiting for a fetcher. The core asks at most one per worker at a time, so
# this bounds the fleet the scheduler can resync at once, not the work it can do.
_SNAPSHOT_QUEUE = 4096


def _brief(session: str) -> str:
    """A session id fit for a log line: sessions come from clients, at any length."""
    return repr(session) if len(session) <= 64 else f"{session[:64]!r}... ({len(session)} characters)"


@dataclass(frozen=True, slots=True)
class _PendingAck:
    worker_id: str
    request_id: str
    deadline: float


class SchedulerService:
    def __init__(self, config: SchedulerServiceConfig, clock: Callable[[], float] = time.monotonic):
        self.config = config
        self.core = SchedulerCore(config.core)
        self.scheduler_id = f"sched-{uuid.uuid4().hex[:8]}"
        self.stats = BusStats()
        self._clock = clock
        self._trace_headers: dict[str, dict[str, str]] = {}
        self._ack_inbox = f"_INBOX.{self.scheduler_id}"
        self._pending: dict[str, _PendingAck] = {}  # ack token -> dispatch awaiting its ack
        self._tokens = itertools.count()
        self._nc: Client | None = None
        self._snapshots_send, self._snapshots_receive = anyio.create_memory_object_stream[str](_SNAPSHOT_QUEUE)
        self._bindings_send, self._bindings_receive = anyio.create_memory_object_stream[Binding](_SNAPSHOT_QUEUE)
        self._sessions = SessionStore.disabled()

    async def run(self, *, task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        async with connect(self.config.nats_url, self.scheduler_id, self.stats, self.config.nats_client) as nc:
            self._nc = nc
            async with anyio.create_task_group() as tg:
                submits = await subscribe(nc, subjects.SUBMIT, queue=subjects.SCHEDULER_QUEUE)
                events = await subscribe(nc, subjects.WORKER_EVENTS)
                cancels = await subscribe(nc, subjects.CANCEL)
                acks = await subscribe(nc, f"{self._ack_inbox}.*")
                kv_events = await subscribe(nc, subjects.KV_EVENTS)
                await self._restore_sessions(nc)
                tg.start_soon(self._persist_sessions)
                tg.start_soon(self._serve_submits, submits)
                tg.start_soon(self._serve_events, events)
                tg.start_soon(self._serve_cancels, cancels)
                tg.start_soon(self._serve_acks, acks)
                tg.start_soon(self._serve_kv_events, kv_events)
                for _ in range(self.config.snapshot_fetchers):
                    tg.start_soon(self._fetch_snapshots)
                tg.start_soon(self._tick)
                await nc.flush()
                # Workers that were up before us register now instead of at their next beat.
                await nc.publish(subjects.ROLL_CALL, codec.ROLL_CALL.encode(RollCall(scheduler_id=self.scheduler_id)))
                log.info("scheduler %s ready on %s", self.scheduler_id, redacted(self.config.nats_url))
                task_status.started()

    # --- inputs --------------------------------------------------------------------

    async def _serve_submits(self, sub: Subscription) -> None:
        async for msg, request in decoded(sub, codec.SCHEDULER_REQUEST, "scheduler request"):
            match request:
                case SubmitRequest(spec=spec):
                    ctx = tracing.extract(msg.headers)
                    with tracing.tracer().start_as_current_span("scheduler.admit", context=ctx) as span:
                        span.set_attribute("switchyard.request_id", spec.request_id)
                        span.set_attribute("switchyard.prompt_tokens", len(spec.prompt_tokens))
                        self._trace_headers[spec.request_id] = dict(msg.headers or {})
                        reply, actions = self.core.submit(spec, self._clock())
                        span.set_attribute("switchyard.admission", type(reply).__name__.lower())
                    await self._act(actions)  # the dispatch first: it is on the token's path
                    await msg.respond(codec.SCHEDULER_REPLY.encode(reply))
                case StatusRequest():
                    await msg.respond(codec.SCHEDULER_REPLY.encode(self.core.status()))

    async def _serve_events(self, sub: Subscription) -> None:
        async for _, event in decoded(sub, codec.WORKER_EVENT, "worker event"):
            await self._act(self.core.on_event(event, self._clock()))

    async def _serve_cancels(self, sub: Subscription) -> None:
        async for _, cancel in decoded(sub, codec.CANCEL, "cancel"):
            await self._act(self.core.on_cancel(cancel.request_id, self._clock()))

    async def _serve_acks(self, sub: Subscription) -> None:
        async for msg in sub.messages:
            pending = self._pending.pop(msg.subject.rsplit(".", 1)[-1], None)
            if pending is None:
                continue  # already timed out
            if msg.headers and msg.headers.get("Status") == _NO_RESPONDERS:
                await self._dispatch_failed(pending, "no_responders")
                continue
            try:
                ack = codec.TASK_ACK.decode(msg.data)
            except msgspec.DecodeError as exc:
                log.warning("undecodable ack from %s: %s", pending.worker_id, exc)
                continue
            if not ack.accepted:
                log.info("worker %s refused %s: %s", pending.worker_id, pending.request_id, ack.reason)
                await self._dispatch_failed(pending, "refused")

    async def _serve_kv_events(self, sub: Subscription) -> None:
        async for _, batch in decoded(sub, codec.KV_EVENTS, "KV events"):
            await self._act(self.core.on_kv_events(batch, self._clock()))

    async def _fetch_snapshots(self) -> None:
        async for worker_id in self._snapshots_receive:
            snapshot = await self._request_snapshot(worker_id)
            if snapshot is None:
                await self._act(self.core.on_snapshot_failed(worker_id, self._clock()))
            else:
                await self._act(self.core.on_kv_snapshot(snapshot, self._clock()))

    async def _request_snapshot(self, worker_id: str) -> KvSnapshot | None:
        assert self._nc is not None
        request = codec.KV_SNAPSHOT_REQUEST.encode(KvSnapshotRequest(scheduler_id=self.scheduler_id))
        try:
            reply = await self._nc.request(
                subjects.kv_snapshot(worker_id), request, timeout=self.config.snapshot_timeout_s
            )
            snapshot = codec.KV_SNAPSHOT.decode(reply.data)
        except (nats.errors.Error, msgspec.DecodeError) as exc:  # timeout, no responders, garbage
            log.warning("no KV snapshot from %s: %r", worker_id, exc)
            return None
        if snapshot.worker_id != worker_id:
            log.warning("asked %s for its KV snapshot, %s answered", worker_id, snapshot.worker_id)
            return None
        return snapshot

    async def _tick(self) -> None:
        while True:
            await anyio.sleep(self.config.tick_s)
            now = self._clock()
            for token in [t for t, p in self._pending.items() if p.deadline <= now]:
                await self._dispatch_failed(self._pending.pop(token), "timeout")
            await self._act(self.core.tick(now))
            self._forget_finished_traces()

    def _forget_finished_traces(self) -> None:
        stale = [rid for rid in self._trace_headers if rid not in self.core.requests]
        for rid in stale:
            del self._trace_headers[rid]

    # --- outputs -------------------------------------------------------------------

    async def _act(self, actions: list[Action]) -> None:
        for action in actions:
            match action:
                case Dispatch():
                    await self._dispatch(action)
                case FailStream():
                    await self._fail_stream(action)
                case RequestSnapshot():
                    await self._queue_snapshot(action.worker_id)
                case BindSession(binding=binding):
                    self._queue_binding(binding)

    # --- sessions, kept in JetStream KV ---------------------------------------------

    async def _restore_sessions(self, nc: Client) -> None:
        self._sessions = await SessionStore.open(nc, self.config.core.session_ttl_s)
        now = self._clock()
        bindings = await self._sessions.load(now)
        for binding in bindings:
            self.core.restore_session(binding, now)
        if bindings:
            log.info("restored %d session bindings", len(bindings))

    def _queue_binding(self, binding: Binding) -> None:
        """Written by ``_persist_sessions``, off the request's path; dropped (logged) if
        the writer is that far behind: the binding still holds in this scheduler."""
        try:
            self._bindings_send.send_nowait(binding)
        except anyio.WouldBlock:
            log.warning("session writer behind: binding of %s not persisted", _brief(binding.session))

    async def _persist_sessions(self) -> None:
        async for binding in self._bindings_receive:
            await self._persist(binding)

    async def _persist(self, binding: Binding) -> None:
        if await self._put(binding):  # the bucket was lost (NATS restarted without its store)
            live = self.core.sessions.live(self._clock())
            log.info("session bucket created again; writing back the %d bindings held here", len(live))
            for held in live:
                await self._put(held)

    async def _put(self, binding: Binding) -> bool:
        try:
            return await self._sessions.put(binding, self._clock())
        except Exception as exc:  # a JetStream hiccup must not stop the scheduler
            log.warning("could not persist the binding of %s: %s", _brief(binding.session), exc)
            return False

    async def _queue_snapshot(self, worker_id: str) -> None:
        """Hand the request to a fetcher without waiting; if none can take it, it failed."""
        try:
            self._snapshots_send.send_nowait(worker_id)
        except anyio.WouldBlock:
            log.warning(
                "%d KV snapshots already waiting; %s must ask again",
                self._snapshots_send.statistics().current_buffer_used,
                worker_id,
            )
            await self._act(self.core.on_snapshot_failed(worker_id, self._clock()))

    async def _dispatch(self, action: Dispatch) -> None:
        assert self._nc is not None
        rid = action.task.spec.request_id
        kind = type(action.task).__name__.removesuffix("Task").lower()
        ctx = tracing.extract(self._trace_headers.get(rid))
        with tracing.tracer().start_as_current_span(f"scheduler.dispatch.{kind}", context=ctx) as span:
            span.set_attribute("switchyard.worker_id", action.worker_id)
            headers = tracing.inject()
        token = str(next(self._tokens))
        self._pending[token] = _PendingAck(action.worker_id, rid, self._clock() + self.config.dispatch_timeout_s)
        await self._nc.publish(
            subjects.worker_tasks(action.worker_id),
            codec.WORKER_TASK.encode(action.task),
            reply=f"{self._ack_inbox}.{token}",
            headers=headers or None,
        )

    async def _dispatch_failed(self, pending: _PendingAck, outcome: DispatchOutcome) -> None:
        if outcome != "refused":
            log.warning(
                "worker %s: %s for %s; removing it", pending.worker_id, outcome.replace("_", " "), pending.request_id
            )
        await self._act(self.core.on_dispatch_failed(pending.worker_id, pending.request_id, outcome, self._clock()))

    async def _fail_stream(self, action: FailStream) -> None:
        assert self._nc is not None
        log.warning("failing %s: %s", action.request_id, action.error.message)
        chunk = StreamChunk(request_id=action.request_id, seq=0, error=action.error)
        batch = StreamBatch(sender=self.scheduler_id, chunks=[chunk])
        await self._nc.publish(subjects.stream(action.ingress_id), codec.STREAM_BATCH.encode(batch))
