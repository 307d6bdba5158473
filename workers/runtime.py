"""What every worker does on the bus, whatever its role.

``WorkerRuntime.run`` owns the task group: heartbeats (``LoadReport``), the task
subscription (request/reply: accept or refuse, then work), cancels, roll calls, KV
snapshot requests, and the role's own engine loop. Roles plug in through ``Role``.

Every task the worker accepted stays in its ``HeldLedger`` until the worker says it is
done with it (``PrefillDone``, ``PrefillFailed``, ``RequestFinished``) or hears it
cancelled. A roll call (a scheduler has just become active) is answered with the whole
ledger, each request as the scheduler charged it, so the new scheduler rebuilds the
ledger the old one kept; and a prefill that finishes for a scheduler that is gone
carries its request (``PrefillDone.spec``), which the new one could not know.

The worker's KV cache reaches the scheduler's prefix index through one ``KvReporter``
(``workers.kv_events``): the role publishes its changes with ``WorkerBus.kv_changes``
after each engine batch; the runtime answers ``KvSnapshotRequest`` from the same
reporter, so snapshot and batches share one sequence. A role whose engine keeps no
prefix cache (decode) reports an empty one.
"""

from __future__ import annotations

import contextlib
import logging
from collections import OrderedDict
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import anyio
import msgspec
from anyio.abc import TaskGroup, TaskStatus
from nats.aio.client import Client
from nats.aio.subscription import Subscription
from nats.errors import MaxPayloadError

from switchyard.observability import BusStats, connect, decoded, settle, subscribe
from switchyard.schemas import (
    Cancel,
    EngineStats,
    HeldRequest,
    LoadReport,
    LocalTask,
    PrefillDone,
    PrefillFailed,
    PrefillTask,
    RequestFinished,
    StreamBatch,
    StreamChunk,
    TaskAck,
    WorkerEvent,
    WorkerLeaving,
    WorkerTask,
    codec,
    subjects,
)
from switchyard.workers.config import WorkerConfig
from switchyard.workers.engine import CountingEngine, EngineLifecycle, PrefillEngine
from switchyard.workers.kv_events import KvCacheView, KvReporter, NoKvCache, PushedKvCache

log = logging.getLogger(__name__)

_REMEMBERED_CANCELS = 4096
_HELD_PER_REPORT = 2000


class Role(Protocol):
    """A role's half of a worker."""

    @property
    def engine(self) -> PrefillEngine:
        """Its engine; the runtime boots it (``EngineLifecycle``) and reports its counters
        (``CountingEngine``) when it can."""
        ...

    @property
    def kv_fallbacks(self) -> int:
        """Handed-over KV its engine did not find, and recomputed."""
        ...

    def inflight_tokens(self) -> int: ...

    def running(self) -> int: ...

    def offer(self, task: WorkerTask, headers: dict[str, str]) -> str | None:
        """Take the task, or say why not."""
        ...

    def cancel(self, request_id: str) -> None: ...

    async def serve(self, bus: WorkerBus) -> None:
        """The engine loop; runs until cancelled."""
        ...


@runtime_checkable
class CachingRole(Protocol):
    """A role whose engine keeps a prefix cache the scheduler should hear of (prefill)."""

    @property
    def kv_cache(self) -> KvCacheView: ...


@dataclass(slots=True)
class _Held:
    task: WorkerTask
    decoding: bool = False  # a local task past its prefill
    orphaned: bool = False  # placed by a scheduler that has since been replaced

    def report(self) -> HeldRequest:
        spec = self.task.spec
        decode_tokens = spec.sampling.kv_tokens(len(spec.prompt_tokens))
        prefill = isinstance(self.task, PrefillTask) or (isinstance(self.task, LocalTask) and not self.decoding)
        charged = self.task.charged_tokens
        if charged is None:  # a scheduler that does not say: what it would have charged
            charged = len(spec.prompt_tokens) if isinstance(self.task, PrefillTask) else decode_tokens
        return HeldRequest(
            request_id=spec.request_id,
            ingress_id=spec.ingress_id,
            phase="prefill" if prefill else "decode",
            tokens=charged,
            decode_tokens=decode_tokens,
            local=isinstance(self.task, LocalTask),
            attempt=spec.attempt,
        )


class HeldLedger:
    """The requests this worker holds for the scheduler (see the module's note)."""

    def __init__(self) -> None:
        self._held: dict[str, _Held] = {}
        self._scheduler: str | None = None

    def __len__(self) -> int:
        return len(self._held)

    def accepted(self, task: WorkerTask) -> None:
        self._held[task.spec.request_id] = _Held(task)

    def cancelled(self, request_id: str) -> None:
        self._held.pop(request_id, None)

    def attempt(self, request_id: str) -> int | None:
        """The attempt of the request's run held here, if any."""
        held = self._held.get(request_id)
        return None if held is None else held.task.spec.attempt

    def roll_call(self, scheduler_id: str) -> list[HeldRequest]:
        """A scheduler became active: what it must adopt. Tasks held so far came from
        another one (a standby never dispatches)."""
        if scheduler_id != self._scheduler:
            self._scheduler = scheduler_id
            for held in self._held.values():
                held.orphaned = True
        return [held.report() for held in self._held.values()]

    def sent(self, event: WorkerEvent) -> WorkerEvent:
        """Account for an event on its way out; the event to send in its place."""
        match event:
            case PrefillDone(request_id=rid):
                held = self._held.get(rid)
                if held is None:
                    return event
                if event.finished or isinstance(held.task, PrefillTask):
                    del self._held[rid]
                else:
                    held.decoding = True
                return msgspec.structs.replace(event, spec=held.task.spec) if held.orphaned else event
            case PrefillFailed(request_id=rid) | RequestFinished(request_id=rid):
                self._held.pop(rid, None)
        return event


class WorkerBus:
    """The worker's outbound side, handed to its role."""

    def __init__(self, nc: Client, config: WorkerConfig, kv: KvReporter, held: HeldLedger | None = None) -> None:
        self.nc = nc
        self.config = config
        self.kv = kv
        self.held = held if held is not None else HeldLedger()

    async def kv_changes(self) -> None:
        """Publish what the engine's cache stored and evicted since last time, if anything."""
        batch = self.kv.next_batch()  # numbered now, with its changes taken (see kv_events)
        if batch is not None:
            await self.nc.publish(subjects.KV_EVENTS, codec.KV_EVENTS.encode(batch))

    async def event(self, event: WorkerEvent) -> None:
        event = self.held.sent(event)
        await self.nc.publish(subjects.WORKER_EVENTS, codec.WORKER_EVENT.encode(event))

    async def stream(self, ingress_id: str, chunks: list[StreamChunk]) -> None:
        batch = StreamBatch(sender=self.config.worker_id, chunks=chunks)
        await self.nc.publish(subjects.stream(ingress_id, self.config.worker_id), codec.STREAM_BATCH.encode(batch))


class WorkerRuntime:
    def __init__(self, config: WorkerConfig, role: Role) -> None:
        self.config = config
        self.role = role
        self.stats = BusStats()
        self._seq = 0
        # request -> the last attempt cancelled (None: all of them)
        self._cancelled: OrderedDict[str, Cancel] = OrderedDict()
        cache = role.kv_cache if isinstance(role, CachingRole) else NoKvCache()
        self.kv = KvReporter(config.worker_id, cache)
        self.held = HeldLedger()

    async def run(self, *, task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        cfg = self.config
        engine = self.role.engine
        serving: AbstractAsyncContextManager[None] = contextlib.nullcontext()
        if isinstance(engine, EngineLifecycle):
            # Boot first: the worker registers (first LoadReport) only once it can serve. An
            # engine task that dies raises out of the block, and out of run().
            log.info("%s worker %s: starting its %s engine", cfg.role, cfg.worker_id, cfg.engine)
            serving = engine.serving()
        async with serving:
            await self._run(task_status)

    async def _run(self, task_status: TaskStatus[None]) -> None:
        cfg = self.config
        async with connect(cfg.nats_url, cfg.worker_id, self.stats, cfg.nats_client) as nc:
            bus = WorkerBus(nc, cfg, self.kv, self.held)
            try:
                async with anyio.create_task_group() as tg:
                    await self._start(tg, nc, bus)
                    log.info("%s worker %s ready (engine %s)", cfg.role, cfg.worker_id, cfg.engine)
                    task_status.started()
            finally:
                with anyio.move_on_after(2, shield=True):
                    await bus.event(WorkerLeaving(worker_id=cfg.worker_id))
                    await settle(nc)

    async def _start(self, tg: TaskGroup, nc: Client, bus: WorkerBus) -> None:
        tasks = await subscribe(nc, subjects.worker_tasks(self.config.worker_id))
        cancels = await subscribe(nc, subjects.CANCEL)
        roll_calls = await subscribe(nc, subjects.ROLL_CALL)
        snapshots = await subscribe(nc, subjects.kv_snapshot(self.config.worker_id))
        tg.start_soon(self._serve_tasks, tasks)
        tg.start_soon(self._serve_cancels, cancels)
        tg.start_soon(self._serve_roll_calls, roll_calls, bus)
        tg.start_soon(self._serve_kv_snapshots, snapshots)
        tg.start_soon(self.role.serve, bus)
        cache = self.kv.cache
        if isinstance(cache, PushedKvCache):
            tg.start_soon(self._publish_kv_pushes, cache, bus)
        await settle(nc)
        tg.start_soon(self._heartbeat, bus)

    async def _publish_kv_pushes(self, cache: PushedKvCache, bus: WorkerBus) -> None:
        """An engine that reports its cache changes on its own time (vLLM's events come
        from its core process): publish them as they come, not only after a batch."""
        while True:
            await cache.wait_kv_changes()
            await bus.kv_changes()

    async def _serve_tasks(self, sub: Subscription) -> None:
        async for msg, task in decoded(sub, codec.WORKER_TASK, "task"):
            rid = task.spec.request_id
            cancel = self._cancelled.get(rid)
            cancelled = cancel is not None and cancel.covers(task.spec.attempt)
            held = self.held.attempt(rid)
            if not cancelled and held is not None and held < task.spec.attempt:
                self._supersede(rid, held, task.spec.attempt)
            refusal = "cancelled" if cancelled else self.role.offer(task, msg.headers or {})
            if refusal is None:
                self.held.accepted(task)
            ack = TaskAck(request_id=rid, accepted=refusal is None, reason=refusal or "")
            await msg.respond(codec.TASK_ACK.encode(ack))

    def _supersede(self, request_id: str, held: int, attempt: int) -> None:
        """A later attempt of a request whose earlier run this worker still holds: the
        ingress cancelled that run before it submitted this one, but the cancel did not
        come (core NATS delivers at most once: a worker still reconnecting after the bus
        restarted misses it). The ingress takes chunks only from the later run, so the
        earlier one is ended here as its cancel would have, and the task is offered to a
        worker that no longer runs it (it was refused as "already decoding" until the old
        run ended on its own, and the request failed once its dispatches were spent)."""
        log.info("%s: attempt %d supersedes attempt %d held here; ending that one", request_id, attempt, held)
        self._end_run(request_id)

    def _end_run(self, request_id: str) -> None:
        """Stop the request's run here and forget it (a cancel, or a later attempt)."""
        self.role.cancel(request_id)
        self.held.cancelled(request_id)

    async def _serve_cancels(self, sub: Subscription) -> None:
        async for _, cancel in decoded(sub, codec.CANCEL, "cancel"):
            # Remembered, so a task that crosses the cancel on the wire is refused.
            self._cancelled[cancel.request_id] = cancel
            if len(self._cancelled) > _REMEMBERED_CANCELS:
                self._cancelled.popitem(last=False)
            held = self.held.attempt(cancel.request_id)
            if held is None or cancel.covers(held):  # a newer run of it is not this cancel's
                self._end_run(cancel.request_id)

    async def _serve_roll_calls(self, sub: Subscription, bus: WorkerBus) -> None:
        async for _, roll_call in decoded(sub, codec.ROLL_CALL, "roll call"):
            held = self.held.roll_call(roll_call.scheduler_id)
            # In parts that each fit a NATS message (about 150 bytes a request, 1 MB a message):
            # every report of the answer carries held, so the scheduler adopts each part.
            for start in range(0, max(len(held), 1), _HELD_PER_REPORT):
                await self._report(bus, held[start : start + _HELD_PER_REPORT])

    async def _serve_kv_snapshots(self, sub: Subscription) -> None:
        async for msg in sub.messages:
            snapshot = self.kv.snapshot()  # one synchronous read: consistent with kv.seq
            try:
                await msg.respond(codec.KV_SNAPSHOT.encode(snapshot))
            except MaxPayloadError:
                # Too big for one message: the scheduler times out and keeps what it had.
                log.error(
                    "KV snapshot of %d blocks exceeds the NATS max payload", sum(map(len, snapshot.blocks.values()))
                )

    async def _heartbeat(self, bus: WorkerBus) -> None:
        while True:
            await self._report(bus)
            await anyio.sleep(self.config.report_interval_s)

    async def _report(self, bus: WorkerBus, held: list[HeldRequest] | None = None) -> None:
        cfg = self.config
        self._seq += 1
        await bus.event(
            LoadReport(
                worker_id=cfg.worker_id,
                role=cfg.role,
                seq=self._seq,
                engine=cfg.engine,
                model=cfg.model,
                block_size=cfg.block_size,
                token_budget=cfg.token_budget,
                inflight_tokens=self.role.inflight_tokens(),
                running=self.role.running(),
                interval_s=cfg.report_interval_s,
                kv_seq=self.kv.seq,
                boot_s=self._boot_s(),
                stats=self._engine_stats(),
                held=held,
                device_class=cfg.device_class,
            )
        )

    def _boot_s(self) -> float:
        engine = self.role.engine
        return engine.boot_s if isinstance(engine, EngineLifecycle) else 0.0

    def _engine_stats(self) -> EngineStats | None:
        engine = self.role.engine
        if not isinstance(engine, CountingEngine):
            return None
        return EngineStats(kv_fallbacks=self.role.kv_fallbacks, **engine.counters.wire())
