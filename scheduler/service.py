"""The scheduler on the bus: a thin async loop around ``SchedulerCore``.

Inputs arrive on five subscriptions (submits, worker events, cancels, task acks, KV
events) and a ticker; each is fed to the core synchronously, in this one event loop,
so the core needs no locks. The core's actions are carried out at once by the task
that fed it: a dispatch is published straight away (it is on the token's path), with
a reply subject on the scheduler's own ack inbox. Acks, refusals and NATS's
no-responders status come back there; a dispatch unanswered for ``dispatch_timeout_s``
times out on the ticker. Every failure goes back into the core, which decides what to
retry. A tick that comes late (the loop stalled: a long pause of the process) counts the
stall as no worker's silence and no ack's wait (``_unheard``): what arrived meanwhile is
still unread, and taking it for silence would remove every worker at once.

KV events (``KV_EVENTS``) feed the core's prefix index. A snapshot the core asks for
(a worker joined, or its events had a gap) is a request/reply that can take up to
``snapshot_timeout_s``, too slow to await in the task that decided it: the worker id
goes into a bounded stream, and a few fetcher tasks of the service's own task group
carry the requests out and feed each answer (or its failure) back to the core. A
fresh scheduler thus rebuilds the whole index from the running workers: its roll call
registers them, and each registration asks a snapshot.

Replicas: only the one holding the lease (``scheduler.lease``) is active. Every replica
hears every submit (a plain subscription: only the active one answers), every worker
event and every cancel; a standby answers nothing, dispatches nothing, and keeps the
submits it heard until they end (``scheduler.standby``). It tries for the lease every
``lease_renew_s``; once it has it, it starts as a fresh scheduler does (sessions from
their bucket, the index and the ledger from the workers' answers to its roll call),
waits up to ``takeover_settle_s`` for those answers, settles the submits it kept, and
only then answers submits. Every dispatch and every answer waits for the lease first: a
scheduler whose lease lapsed (NATS was away) places nothing until it holds the lease
again, and one that lost it to another replica raises ``LeaseLostError`` out of
``run()`` (its supervisor starts it again, as a standby).
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import time
import uuid
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

import anyio
import msgspec
import nats.errors
from anyio.abc import TaskGroup, TaskStatus
from nats.aio.client import Client
from nats.aio.subscription import Subscription

from switchyard.observability import BusStats, connect, decoded, redacted, settle, subscribe, tracing
from switchyard.scheduler.audit import Audit
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
from switchyard.scheduler.heap import freeze_heap
from switchyard.scheduler.lease import LeaseKeeper, LeaseState
from switchyard.scheduler.session_store import SessionStore
from switchyard.scheduler.sessions import Binding
from switchyard.scheduler.standby import Kept, Settlement, Shadowed, SubmitShadow, settlement
from switchyard.schemas import (
    Cancel,
    HeldRequest,
    KvSnapshot,
    KvSnapshotRequest,
    LoadReport,
    PrefillDone,
    PrefillFailed,
    RequestFinished,
    RequestSpec,
    RollCall,
    SchedulerReply,
    StatusRequest,
    StreamBatch,
    StreamChunk,
    SubmitRequest,
    WorkerEvent,
    WorkerLeaving,
    codec,
    subjects,
)

log = logging.getLogger(__name__)

_NO_RESPONDERS = "503"
# Snapshots waiting for a fetcher. The core asks at most one per worker at a time, so
# this bounds the fleet the scheduler can resync at once, not the work it can do.
_SNAPSHOT_QUEUE = 4096
# A stall of the loop this long (or a quarter of the worker expiry, if less) is credited to
# the workers' silence and logged (``SchedulerService._unheard``). Shorter lateness is a busy
# loop that still reads its inbox between tasks: credited every tick, it would slow the
# detection of a dead worker by as much as the loop runs late.
_STALL_S = 0.5
# Runs this scheduler knows a worker holds (it dispatched them there, or adopted them from
# that worker's answer), by request id, the latest last: an audit cancels a stray run only
# if it is one of these (``Audit.strays``). A worker, which may not publish cancels, cannot
# have the scheduler cancel a run it never held, nor flood the bus with cancels by naming
# made-up ids. Runs live minutes; at 1,000 requests a second a run older than about a
# minute falls out, and its stray is then dropped from the answer without a cancel.
_PLACED_REMEMBERED = 65_536


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
        self._keeper: LeaseKeeper | None = None
        self._snapshots_send, self._snapshots_receive = anyio.create_memory_object_stream[str](_SNAPSHOT_QUEUE)
        self._bindings_send, self._bindings_receive = anyio.create_memory_object_stream[Binding](_SNAPSHOT_QUEUE)
        self._sessions = SessionStore.disabled()
        self.lease = LeaseState(config.lease_ttl_s, config.lease_renew_s)
        self.active = anyio.Event()  # set once it holds the lease and its subscriptions are up
        self._settled = anyio.Event()  # and the takeover is settled: it answers submits
        self._shadow = SubmitShadow(config.standby_shadow_bytes)
        self._answered: set[str] = set()  # workers that answered this scheduler's roll call
        self._answer = anyio.Event()  # set at each answer
        self._audit: Audit | None = None  # after the bus may have lost messages (scheduler.audit)
        self.strays_cancelled = 0  # runs a worker still held after they ended here (Audit.strays)
        self.strays_ignored = 0  # claimed in an audit's answer, never placed there by this scheduler
        self._placed: OrderedDict[str, tuple[str, int]] = OrderedDict()  # _PLACED_REMEMBERED
        self._bus_losses = (0, 0)  # reconnects and drops the last audit covered

    async def run(self, *, task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        """Ready (``task_status``) once active, or once standing by behind an active one."""
        async with connect(self.config.nats_url, self.scheduler_id, self.stats, self.config.nats_client) as nc:
            self._nc = nc
            lease = self._keeper = LeaseKeeper(nc, self.scheduler_id, self.lease, self._clock)
            await lease.open()
            try:
                async with anyio.create_task_group() as tg:
                    answers = await self._listen(nc, tg)
                    if not await lease.try_once():
                        log.info("scheduler %s standing by: another scheduler holds the lease", self.scheduler_id)
                        task_status.started()
                        task_status = anyio.TASK_STATUS_IGNORED
                        await lease.acquire()
                        log.info("scheduler %s took the lease over", self.scheduler_id)
                    await self._activate(nc, tg, lease, answers)
                    task_status.started()
            finally:
                await lease.release()

    async def _listen(self, nc: Client, tg: TaskGroup) -> Subscription:
        """What every replica hears, active or not (see the module's note); the subscription
        to answers, which only a standby needs."""
        submits = await subscribe(nc, subjects.SUBMIT)
        events = await subscribe(nc, subjects.WORKER_EVENTS)
        cancels = await subscribe(nc, subjects.CANCEL)
        answers = await subscribe(nc, "_INBOX.>")  # the active one's answers to submits
        tg.start_soon(self._serve_submits, submits)
        tg.start_soon(self._serve_events, events)
        tg.start_soon(self._serve_cancels, cancels)
        tg.start_soon(self._serve_answers, answers)
        await settle(nc)
        return answers

    async def _activate(self, nc: Client, tg: TaskGroup, lease: LeaseKeeper, answers: Subscription) -> None:
        """The lease is ours: become the active scheduler."""
        tg.start_soon(lease.keep)
        acks = await subscribe(nc, f"{self._ack_inbox}.*")
        kv_events = await subscribe(nc, subjects.KV_EVENTS)
        await self._restore_sessions(nc)
        tg.start_soon(self._persist_sessions)
        tg.start_soon(self._serve_acks, acks)
        tg.start_soon(self._serve_kv_events, kv_events)
        for _ in range(self.config.snapshot_fetchers):
            tg.start_soon(self._fetch_snapshots)
        tg.start_soon(self._tick)
        if self.config.region:
            pings = await subscribe(nc, subjects.FED_PING, queue=subjects.FED_PING_QUEUE)
            tg.start_soon(self._serve_pings, pings)
            tg.start_soon(self._publish_summaries)
        await settle(nc)
        self.active.set()  # from here on, events feed the core
        # Workers that were up before us register now instead of at their next beat, and
        # say what they hold for the scheduler before us.
        await self._roll_call()
        await self._take_over()
        self._settled.set()
        await answers.unsubscribe()  # ours now: no one else answers
        frozen = freeze_heap()  # startup's heap out of the collector's passes (``scheduler.heap``)
        log.debug("scheduler %s froze %d startup objects out of the collector", self.scheduler_id, frozen)
        log.info("scheduler %s ready on %s", self.scheduler_id, redacted(self.config.nats_url))

    async def _take_over(self) -> None:
        """Wait for the workers' answers, then settle every submit the standby kept."""
        expected = self._shadow.live_workers(self._clock(), self.config.core.worker_expiry_s)
        with anyio.move_on_after(self.config.takeover_settle_s):
            while not expected <= self._answered:
                self._answer = anyio.Event()
                await self._answer.wait()
        if missing := expected - self._answered:
            log.warning("taking over without the roll-call answers of %s", ", ".join(sorted(missing)))
        kept = self._shadow.take()
        if self._shadow.evicted:
            log.warning("%d submits were not kept while standing by (no room)", self._shadow.evicted)
        outcomes = [await self._settle(k) for k in kept]
        if kept:
            log.info("took over %s", ", ".join(f"{outcomes.count(o)} {o}" for o in sorted(set(outcomes))))

    async def _settle(self, kept: Kept) -> Settlement:
        request = codec.SCHEDULER_REQUEST.decode(kept.entry.data)
        assert isinstance(request, SubmitRequest)
        spec, now = request.spec, self._clock()
        outcome = settlement(spec.request_id in self.core.requests, kept.prefill is not None, kept.admitted)
        if outcome != "adopted":
            self._trace_headers[spec.request_id] = kept.entry.headers
        match outcome:
            case "adopted":  # a worker holds it
                self.core.learn_spec(spec)
            case "decode":  # prefilled, and no decode worker has it: it waited for one
                assert kept.prefill is not None
                await self._act(self.core.resume_decode(spec, kept.prefill, now))
            case "queue":  # admitted, not placed: it waited in the queue
                await self._act(self.core.requeue(spec, kept.entry.received_at, now))
            case "admit":  # nobody answered it: we do, late
                await self._admit(spec, kept.entry.headers, kept.entry.reply)
        return outcome

    async def _fence(self) -> None:
        """Place nothing, answer nothing, while the lease is not ours: waits out a lapse
        (NATS was away), raises ``LeaseLostError`` once another replica holds it."""
        assert self._keeper is not None
        await self._keeper.wait_held()

    # --- inputs --------------------------------------------------------------------

    async def _serve_submits(self, sub: Subscription) -> None:
        async for msg, request in decoded(sub, codec.SCHEDULER_REQUEST, "scheduler request"):
            if not self.active.is_set():
                if isinstance(request, SubmitRequest):
                    self._keep(msg.data, request.spec, msg.reply, dict(msg.headers or {}))
                continue
            await self._settled.wait()
            match request:
                case SubmitRequest(spec=spec):
                    await self._admit(spec, dict(msg.headers or {}), msg.reply)
                case StatusRequest():
                    await self._fence()
                    status = self.core.status()
                    strays = {"strays_cancelled": self.strays_cancelled, "strays_ignored": self.strays_ignored}
                    await self._reply(msg.reply, msgspec.structs.replace(status, **strays))

    def _keep(self, data: bytes, spec: RequestSpec, reply: str | None, headers: dict[str, str]) -> None:
        self._shadow.submitted(Shadowed(spec.request_id, data, reply or None, headers, self._clock(), spec.attempt))

    async def _admit(self, spec: RequestSpec, headers: dict[str, str], reply_to: str | None) -> None:
        ctx = tracing.extract(headers)
        with tracing.tracer().start_as_current_span("scheduler.admit", context=ctx) as span:
            span.set_attribute("switchyard.request_id", spec.request_id)
            span.set_attribute("switchyard.prompt_tokens", len(spec.prompt_tokens))
            self._trace_headers[spec.request_id] = headers
            await self._fence()
            reply, actions = self.core.submit(spec, self._clock())
            span.set_attribute("switchyard.admission", type(reply).__name__.lower())
        await self._act(actions)  # the dispatch first: it is on the token's path
        await self._reply(reply_to, reply)

    async def _reply(self, reply_to: str | None, reply: SchedulerReply) -> None:
        if reply_to:
            assert self._nc is not None
            await self._nc.publish(reply_to, codec.SCHEDULER_REPLY.encode(reply))

    async def _serve_events(self, sub: Subscription) -> None:
        async for _, event in decoded(sub, codec.WORKER_EVENT, "worker event"):
            if not self.active.is_set():
                self._shadow_event(event)
                continue
            if isinstance(event, LoadReport) and event.held is not None and self._audit is not None:
                self._audit.heard(event)
                strays = self._audit.strays(event, self.core.requests)
                if strays:  # ended here, their cancels lost: ended there too, not adopted
                    await self._cancel_strays(event.worker_id, strays)
                    event = msgspec.structs.replace(event, held=[h for h in event.held if h not in strays])
            if isinstance(event, LoadReport) and event.held:
                for held in event.held:  # adopted, or known already: its run is on that worker
                    self._remember_placed(held.request_id, event.worker_id, held.attempt)
            actions = self.core.on_event(event, self._clock())
            if isinstance(event, LoadReport) and event.held is not None:
                self._answered.add(event.worker_id)
                self._answer.set()
                self._give_prompts(event.held)
            if not self._settled.is_set():  # the shadow still settles what it kept
                self._shadow_event(event)
            await self._act(actions)

    async def _cancel_strays(self, worker_id: str, strays: list[HeldRequest]) -> None:
        """Cancel runs a worker holds that ended here (``Audit.strays``), each up to its own
        attempt: a later one the ingress submits since is not theirs to end."""
        assert self._nc is not None
        ours = [h for h in strays if self._placed.get(h.request_id) == (worker_id, h.attempt)]
        if len(ours) < len(strays):
            self.strays_ignored += len(strays) - len(ours)
            log.warning(
                "audit: %s answered with %d runs this scheduler never placed there; ignoring them",
                worker_id,
                len(strays) - len(ours),
            )
        if not ours:
            return
        log.warning("audit: %s still ran %d requests that had ended; cancelling them", worker_id, len(ours))
        self.strays_cancelled += len(ours)
        for held in ours:
            cancel = Cancel(request_id=held.request_id, reason="ended", attempt=held.attempt)
            await self._nc.publish(subjects.CANCEL, codec.CANCEL.encode(cancel))

    def _remember_placed(self, request_id: str, worker_id: str, attempt: int) -> None:
        self._placed[request_id] = (worker_id, attempt)
        self._placed.move_to_end(request_id)
        if len(self._placed) > _PLACED_REMEMBERED:
            self._placed.popitem(last=False)

    def _give_prompts(self, held: list[HeldRequest]) -> None:
        """Adopted requests whose submits the standby kept get their prompts at once."""
        for request in held:
            entry = self._shadow.get(request.request_id)
            if entry is not None:
                submit = codec.SCHEDULER_REQUEST.decode(entry.data)
                assert isinstance(submit, SubmitRequest)
                self.core.learn_spec(submit.spec)

    def _shadow_event(self, event: WorkerEvent) -> None:
        match event:
            case LoadReport(worker_id=worker_id):
                self._shadow.worker_heard(worker_id, self._clock())
            case WorkerLeaving(worker_id=worker_id):
                self._shadow.worker_left(worker_id)
            case RequestFinished(request_id=rid) | PrefillFailed(request_id=rid):
                self._shadow.ended(rid)
            case PrefillDone():
                self._shadow.prefilled(event)

    async def _serve_answers(self, sub: Subscription) -> None:
        async for msg in sub.messages:
            if not self.active.is_set():
                self._shadow.answered(msg.subject, msg.data)

    async def _serve_cancels(self, sub: Subscription) -> None:
        async for _, cancel in decoded(sub, codec.CANCEL, "cancel"):
            if not self._settled.is_set():  # what the shadow kept ends here too
                self._shadow.cancelled(cancel)
            if not self.active.is_set():
                continue
            await self._act(self.core.on_cancel(cancel.request_id, self._clock(), cancel.attempt))

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
        last = self._clock()
        while True:
            await anyio.sleep(self.config.tick_s)
            now = self._clock()
            unheard, last = self._unheard(now - last), now
            for token in [t for t, p in self._pending.items() if p.deadline <= now]:
                await self._dispatch_failed(self._pending.pop(token), "timeout")
            await self._act(self.core.tick(now, unheard))
            await self._audit_step(now)
            self._forget_finished_traces()

    def _unheard(self, since_tick_s: float) -> float:
        """How long this loop read nothing before a tick that came ``since_tick_s`` after the
        last one: how late it came, if that is a stall (``_STALL_S``); else 0. A stall (a long
        pause of the process, a task that held the loop) leaves the workers' heartbeats and
        acks of its time unread in the inbox: the tick after it must not take that for
        silence, expire every worker and fail their streams, nor time out the dispatches it
        has not read the acks of."""
        late = since_tick_s - self.config.tick_s
        if late < min(_STALL_S, self.config.core.worker_expiry_s / 4):
            return 0.0
        self._pending = {t: dataclasses.replace(p, deadline=p.deadline + late) for t, p in self._pending.items()}
        log.warning("the scheduler's loop stalled %.1f s: worker silence and ack waits over it are not counted", late)
        return late

    async def _serve_pings(self, sub: Subscription) -> None:
        """Another region's ingress measures its round trip to this region (an empty reply)."""
        async for msg in sub.messages:
            if msg.reply:
                await msg.respond(b"")

    async def _publish_summaries(self) -> None:
        """The region's state for every other region (``scheduler.regions``), while active."""
        assert self._nc is not None
        subject = subjects.fed_summary(self.config.region)
        for seq in itertools.count(1):
            await self._fence()
            summary = self.core.region_summary(self.config.region, self.scheduler_id, seq, time.time())
            await self._nc.publish(subject, codec.REGION_SUMMARY.encode(summary))
            await anyio.sleep(self.config.summary_interval_s)

    async def _audit_step(self, now: float) -> None:
        """Start an audit when the bus may have lost messages; finish it once the workers
        have had time to answer (``scheduler.audit``)."""
        if self._audit is not None:
            settle = self.config.takeover_settle_s
            if not self._audit.asked_again and now - self._audit.asked_at >= settle:
                self._audit.asked_again = True
                await self._roll_call()  # a worker that reconnected after the first one answers this
            elif self._audit.asked_again and now - self._audit.asked_at >= 2 * settle:
                lost, self._audit = self._audit.lost(), None
                if lost:
                    log.warning("audit: %d requests were no longer held by their workers; reclaimed", len(lost))
                for rid, worker in lost:
                    await self._act(self.core.reclaim(rid, worker, now))
            return
        losses = (self.stats.reconnects, self.stats.dropped)
        if losses == self._bus_losses or not self._settled.is_set():
            return
        self._bus_losses = losses
        unacked = {p.request_id for p in self._pending.values()}
        placed = {rid: w for rid, w in self.core.placed().items() if rid not in unacked}
        self._audit = Audit(asked_at=now, placed=placed)
        await self._roll_call()

    async def _roll_call(self) -> None:
        """Every worker reports at once, with what it holds (under our id: see LoadReport.held)."""
        assert self._nc is not None
        await self._nc.publish(subjects.ROLL_CALL, codec.ROLL_CALL.encode(RollCall(scheduler_id=self.scheduler_id)))

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
        await self._fence()
        rid = action.task.spec.request_id
        kind = type(action.task).__name__.removesuffix("Task").lower()
        ctx = tracing.extract(self._trace_headers.get(rid))
        with tracing.tracer().start_as_current_span(f"scheduler.dispatch.{kind}", context=ctx) as span:
            span.set_attribute("switchyard.worker_id", action.worker_id)
            headers = tracing.inject()
        # The ingress hears of the assignment before the worker hears of the task: on one
        # server (and mostly across a cluster) it knows the sender before its first token.
        await self._to_ingress(
            action.task.spec.ingress_id, StreamChunk(request_id=rid, seq=0, assigned=action.worker_id)
        )
        self._remember_placed(rid, action.worker_id, action.task.spec.attempt)
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
        await self._fence()
        log.warning("failing %s: %s", action.request_id, action.error.message)
        await self._to_ingress(action.ingress_id, StreamChunk(request_id=action.request_id, seq=0, error=action.error))

    async def _to_ingress(self, ingress_id: str, chunk: StreamChunk) -> None:
        assert self._nc is not None
        batch = StreamBatch(sender=self.scheduler_id, chunks=[chunk])
        subject = subjects.stream(ingress_id, subjects.SCHEDULER_SENDER)
        await self._nc.publish(subject, codec.STREAM_BATCH.encode(batch))
