"""The scheduler on the bus: a thin async loop around ``SchedulerCore``.

Inputs arrive on three subscriptions (submits, worker events, cancels) and a ticker;
each is fed to the core synchronously, in this one event loop, so the core needs no
locks. The core's actions go into a bounded stream drained by a fixed pool of
dispatchers that do the request/reply to workers and feed failures back.
"""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import Callable

import anyio
import msgspec
from anyio.abc import TaskStatus
from anyio.streams.memory import MemoryObjectReceiveStream
from nats.aio.client import Client
from nats.errors import NoRespondersError
from nats.errors import TimeoutError as NatsTimeout

from observability import tracing
from observability.bus import BusStats, connect, subscribe
from scheduler.config import SchedulerConfig
from scheduler.core import Action, Dispatch, FailStream, SchedulerCore
from schemas import (
    Cancel,
    RollCall,
    StatusRequest,
    StreamBatch,
    StreamChunk,
    SubmitRequest,
    codec,
    subjects,
)

log = logging.getLogger(__name__)


class SchedulerServiceConfig(msgspec.Struct, frozen=True, kw_only=True):
    nats_url: str
    core: SchedulerConfig = SchedulerConfig()
    tick_s: float = 0.1
    dispatch_timeout_s: float = 2.0
    dispatchers: int = 16


class SchedulerService:
    def __init__(self, config: SchedulerServiceConfig, clock: Callable[[], float] = time.monotonic):
        self.config = config
        self.core = SchedulerCore(config.core)
        self.scheduler_id = f"sched-{uuid.uuid4().hex[:8]}"
        self.stats = BusStats()
        self._clock = clock
        self._trace_headers: dict[str, dict[str, str]] = {}
        self._actions_in, self._actions_out = anyio.create_memory_object_stream[Action](4096)

    async def run(self, *, task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        async with connect(self.config.nats_url, self.scheduler_id, self.stats) as nc:
            async with anyio.create_task_group() as tg:
                submits = await subscribe(nc, subjects.SUBMIT, queue=subjects.SCHEDULER_QUEUE)
                events = await subscribe(nc, subjects.WORKER_EVENTS)
                cancels = await subscribe(nc, subjects.CANCEL)
                tg.start_soon(self._serve_submits, nc, submits)
                tg.start_soon(self._serve_events, events)
                tg.start_soon(self._serve_cancels, cancels)
                tg.start_soon(self._tick)
                for _ in range(self.config.dispatchers):
                    tg.start_soon(self._dispatcher, nc, self._actions_out.clone())
                await nc.flush()
                # Workers that were up before us register now instead of at their next beat.
                await nc.publish(subjects.ROLL_CALL,
                                 codec.ROLL_CALL.encode(RollCall(scheduler_id=self.scheduler_id)))
                log.info("scheduler %s ready on %s", self.scheduler_id, self.config.nats_url)
                task_status.started()

    # --- inputs --------------------------------------------------------------------

    async def _serve_submits(self, nc: Client, sub) -> None:
        async for msg in sub.messages:
            try:
                request = codec.SCHEDULER_REQUEST.decode(msg.data)
            except msgspec.DecodeError as exc:
                log.warning("undecodable scheduler request: %s", exc)
                continue
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

    async def _serve_events(self, sub) -> None:
        async for msg in sub.messages:
            try:
                event = codec.WORKER_EVENT.decode(msg.data)
            except msgspec.DecodeError as exc:
                log.warning("undecodable worker event: %s", exc)
                continue
            await self._act(self.core.on_event(event, self._clock()))

    async def _serve_cancels(self, sub) -> None:
        async for msg in sub.messages:
            try:
                cancel: Cancel = codec.CANCEL.decode(msg.data)
            except msgspec.DecodeError as exc:
                log.warning("undecodable cancel: %s", exc)
                continue
            await self._act(self.core.on_cancel(cancel.request_id, self._clock()))

    async def _tick(self) -> None:
        while True:
            await anyio.sleep(self.config.tick_s)
            await self._act(self.core.tick(self._clock()))
            self._forget_finished_traces()

    def _forget_finished_traces(self) -> None:
        stale = [rid for rid in self._trace_headers if rid not in self.core.requests]
        for rid in stale:
            del self._trace_headers[rid]

    # --- outputs -------------------------------------------------------------------

    async def _act(self, actions: list[Action]) -> None:
        for action in actions:
            await self._actions_in.send(action)

    async def _dispatcher(self, nc: Client, actions: MemoryObjectReceiveStream[Action]) -> None:
        async with actions:
            async for action in actions:
                match action:
                    case Dispatch():
                        await self._dispatch(nc, action)
                    case FailStream():
                        await self._fail_stream(nc, action)

    async def _dispatch(self, nc: Client, action: Dispatch) -> None:
        rid = action.task.spec.request_id
        kind = type(action.task).__name__.removesuffix("Task").lower()
        ctx = tracing.extract(self._trace_headers.get(rid))
        with tracing.tracer().start_as_current_span(f"scheduler.dispatch.{kind}", context=ctx) as span:
            span.set_attribute("switchyard.worker_id", action.worker_id)
            headers = tracing.inject()
        payload = codec.WORKER_TASK.encode(action.task)
        try:
            reply = await nc.request(subjects.worker_tasks(action.worker_id), payload,
                                     timeout=self.config.dispatch_timeout_s, headers=headers)
        except NoRespondersError:
            log.warning("worker %s has no responder for %s: removing it", action.worker_id, rid)
            await self._act(self.core.on_dispatch_failed(action.worker_id, rid, "no_responders", self._clock()))
            return
        except NatsTimeout:
            log.warning("worker %s did not answer for %s: removing it", action.worker_id, rid)
            await self._act(self.core.on_dispatch_failed(action.worker_id, rid, "timeout", self._clock()))
            return
        ack = codec.TASK_ACK.decode(reply.data)
        if not ack.accepted:
            log.info("worker %s refused %s: %s", action.worker_id, rid, ack.reason)
            await self._act(self.core.on_dispatch_failed(action.worker_id, rid, "refused", self._clock()))

    async def _fail_stream(self, nc: Client, action: FailStream) -> None:
        log.warning("failing %s: %s", action.request_id, action.error.message)
        chunk = StreamChunk(request_id=action.request_id, seq=0, error=action.error)
        batch = StreamBatch(sender=self.scheduler_id, chunks=[chunk])
        await nc.publish(subjects.stream(action.ingress_id), codec.STREAM_BATCH.encode(batch))
