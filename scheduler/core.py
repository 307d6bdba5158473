"""The scheduler's decisions: a pure, synchronous state machine.

Events in (a submit, a worker's heartbeat, result or cache change, a cancel, a
dispatch that failed, the passing of time), actions out (dispatch a task, fail a
stream, ask a worker for its cache, persist a session binding). Time is passed in;
nothing here does I/O, so policies are tested with a fake clock and a discrete-event
benchmark replays whole traces through this very code.

Life of a request: queued -> prefill -> awaiting_decode -> decode -> (gone).
A request sent as a ``LocalTask`` (to a decode worker, or to a colocated ``both`` worker
while none is lent to decoding) goes from prefill to decode on the same worker with no
handoff; a colocated worker's ``PrefillTask`` hands its decode over to a worker lent to
decoding (``scheduler.lending``), as a prefill worker's does to a decode worker.
A request whose task never reached its worker (refused, or nobody listening) is queued
again. One whose worker is lost once it had the task, in prefill or in decode, fails here
with ``worker_lost``: only the ingress knows whether its first token reached the client, so
the ingress submits it again (``attempt``), as a continuation after the tokens it delivered
(prompt + those tokens, ``resume_from``) if there are any. A retried prefill therefore
never samples a second token 0. A resubmitted request was admitted once: it is not refused
for load, and it goes to the head of the queue.

With a TTFT SLO (``ttft_slo_s``) and a policy that asks for it (``slo_aware``: the
``switchyard`` policy), a request predicted to miss the SLO is *late*: it queues behind
every request that can still meet it, runs only on slack (on a lightly loaded fleet, at
once), and is shed (``overloaded``) if no slack comes within a few SLOs and no worker has
nothing to do; see "SLO-aware queueing" below. A prompt larger than
every worker's budget keeps the worker that frees up first, and requests behind it may
go to the others meanwhile (``_backfill``), instead of the fleet draining for it.

A scheduler that takes over from another (``scheduler.lease``) rolls call; each worker
answers with the requests it holds, as the old scheduler charged them
(``LoadReport.held``), and the core adopts them: the ledger, the decode claims and the
phases come back as they were, with nothing placed again. An adopted request lacks its
prompt until its prefill worker sends it with ``PrefillDone``; one that needs placing
again without it (its worker lost before then) fails with ``scheduler_failover``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

import numpy as np

from switchyard.scheduler.config import SchedulerConfig
from switchyard.scheduler.index import PrefixIndex
from switchyard.scheduler.lending import Lending, lane_worker
from switchyard.scheduler.placement import Placement, Placer
from switchyard.scheduler.queue import FairQueue
from switchyard.scheduler.sessions import Binding, SessionTable
from switchyard.scheduler.state import Fleet, Phase, Tracked, WorkerState, shareable_keys
from switchyard.schemas import (
    DEVICE_CLASS_MAX,
    Admitted,
    ClusterStatus,
    DecodeTask,
    HeldRequest,
    KvEventBatch,
    KvSnapshot,
    LoadReport,
    LocalTask,
    PrefillDone,
    PrefillFailed,
    PrefillTask,
    RegionSummary,
    Rejected,
    RequestFinished,
    RequestSpec,
    SamplingParams,
    StreamError,
    WorkerEvent,
    WorkerLeaving,
    WorkerSummary,
    WorkerTask,
)


@dataclass(frozen=True)
class Dispatch:
    worker_id: str
    task: WorkerTask


@dataclass(frozen=True)
class FailStream:
    ingress_id: str
    request_id: str
    error: StreamError


@dataclass(frozen=True)
class RequestSnapshot:
    """Ask a worker for everything its KV cache holds (it joined, or its events had a gap)."""

    worker_id: str


@dataclass(frozen=True)
class BindSession:
    """A session binding changed: persist it, so it outlives this scheduler."""

    binding: Binding


Action = Dispatch | FailStream | RequestSnapshot | BindSession
DispatchOutcome = Literal["refused", "no_responders", "timeout"]

# A refused dispatch (the worker's budget or KV is fuller than the ledger knows, or it heard
# the request's cancel first) goes back to its queue after a pause, this long and doubling
# with each refusal of the request up to ``_REFUSED_PAUSE_MAX_S``: retried at once, it mostly
# went to the same worker, which refused again within milliseconds. A refusal spends none of
# its dispatches (``max_dispatch_attempts``: the worker is there and lost nothing); it fails
# once it has been refused for ``refused_retry_s``.
_REFUSED_PAUSE_S = 0.1
_REFUSED_PAUSE_MAX_S = 2.0

# SLO-aware queueing (``_misses_slo``): a late request runs only on a worker whose queue
# drains within this share of the TTFT SLO, and only if the prefill fleet's whole queue
# does too or the fleet has had spare capacity lately; one still waiting after this many
# SLOs takes a worker with nothing at all to do, or is shed if there is none.
_LATE_SLACK = 0.1
_LATE_WAIT_SLOS = 2.0
# ...except where it computes so little that it takes nobody's capacity: at most this share
# of the TTFT SLO of prefill at the worker's rate (the same slack a worker about to run dry
# has), its prefix cached there. There it runs at once, slack or not, on the worker where it
# computes least: sent to a worker with slack instead, it would recompute that prefix and
# evict others' to hold it (on long shared documents, the most a late request costs). Only
# if it would have its first token there, behind that worker's queue, before it would be
# shed (``_LATE_WAIT_SLOS`` SLOs after arriving): later than that, the client is better off
# with a 429 now than an answer after the whole queue.
_LATE_CHEAP = _LATE_SLACK
# The short-prompt lane (``_lent_lane``) also takes a prompt whose prefix a lent worker holds,
# if it computes at most this many TPOT SLOs there (one stall of the lent decodes, once;
# ``Lending.lane_open`` closes the lane if they add up). 2 and 4 tried on the tool-agent
# trace, colocated (docs/bench-sim.md): 4 kept the most goodput.
_LANE_CACHED_TPOTS = 4.0
# Spare capacity lately: the prefill fleet's busy share (workers with work on their
# ledger), averaged over about this window, below this...
_BUSY_WINDOW_S = 20.0
_BUSY_SPARE = 0.7
# ...or below this, for a colocated worker that decodes: while a prompt runs there every
# sequence it decodes waits a whole prefill iteration a token (vLLM's chunked prefill), so
# time per output token grows with the worker's prefill share. At this share decoding keeps
# most of each worker's time even with the late work added.
_BUSY_SPARE_DECODING = 0.4
# Decodes that have run within this share of the TPOT SLO lately keep it with room to spare:
# then the switchyard policy breaks ties by the KV a colocated worker decodes, least first
# (``Fleet.decode_slack``; the note below ``policies._QUEUE_WEIGHT``).
_DECODE_SLACK = 0.5
# Decode workers whose finished decodes have stepped slower than this share of the TPOT SLO
# lately (their ``step_s``, averaged over about ``1 / _DECODE_TPOT_WEIGHT`` decodes of two
# steps or more) take no new decode but on an idle worker: prefilled requests wait, and new
# ones get 429 up front (``_decode_refusal``), until the running decodes step faster. Their
# memory is no bound on their step time: a step reads every sequence's KV, shared blocks
# each time (see ``SharedBlocks``).
_DECODE_FULL = 0.9
_DECODE_TPOT_WEIGHT = 0.05
# Shortest first, while the prefill fleet is busy: from this busy share on, a worker that
# hands its prompts over holds at most ``_HOLD_S`` of prefill at its rate (or one prompt,
# alone: ``Fleet.fit_budget``), so the rest waits in the queue, where the prompts are in
# order of virtual start plus ``_SIZE_WEIGHT`` times their tokens (``FairQueue``). Queued at
# a worker, a short prompt waits through the long ones before it; queued here, it passes
# them, and a long one waits for a worker to drain. Off on a fleet not busy lately, and for a
# prompt the policy would place, unheld, on a worker that holds at least ``_HOLD_REUSE`` of
# it: held from there it would go to an idle worker and recompute its prefix.
_HOLD_BUSY = 0.5
_HOLD_REUSE = 0.5
_HOLD_S = 0.15
_SIZE_WEIGHT = 64.0
_RATE_MIN_TOKENS = 2048  # a worker's rate sums give a sample once they hold this many tokens
_RATE_DECAY = 0.05  # ...and decay by this share with each prompt done there (``_learn_rate``)
_RATE_WEIGHT = 0.2  # EWMA weight of a new prefill rate (or decode duration) sample
_OWN_RATE_WEIGHT = 0.02  # ...and of a worker's own factor over its role's rate (``Fleet.learn_rate``)


class SchedulerCore:
    def __init__(self, config: SchedulerConfig) -> None:
        self.config = config
        # The workers, with counters and arrays placement reads instead of a pass over them
        # per request (``Fleet``); ``workers`` is its dict, read-only here: joins and
        # departures go through ``fleet.add`` and ``fleet.remove``.
        self.fleet = Fleet()
        self.workers: dict[str, WorkerState] = self.fleet.workers
        self.requests: dict[str, Tracked] = {}
        self.index = PrefixIndex(config.index_max_entries)
        self.sessions = SessionTable(config.session_ttl_s)
        self.placer = Placer(config, self.index)
        self._slo_aware_on = config.ttft_slo_s > 0 and self.placer.policy.slo_aware  # fixed: read per request
        self.fleet.lends = self._slo_aware_on and config.tpot_slo_s > 0  # (``Lending``; before any worker joins)
        self._queue = FairQueue(_SIZE_WEIGHT if self._slo_aware_on else 0.0)
        self._decode_wait: list[str] = []  # prefilled, waiting for decode room, FIFO
        # Decode admission: the KV tokens (prompt + max_tokens) every request in flight can
        # come to hold on a decode worker, whatever its phase, against the decode fleet's
        # capacity; and how long a decode lasts (learned), for the Retry-After.
        self._decode_demand = 0
        self._decode_s = config.default_decode_s
        self._decode_tpot: float | None = None  # decode workers' decodes lately (``_DECODE_FULL``)
        self._arrivals = 0
        self.reclaimed = 0  # requests forgotten by an audit (scheduler.audit): stranded otherwise
        # Stranded state, counted: session bindings dropped because their worker is gone, and
        # prefills whose handoff never came (their request ended before a decode took the KV).
        self.sessions_dropped = 0
        self.abandoned_handoffs = 0
        self._started: float | None = None  # the first tick
        # The prefill fleet's recent busy share (workers with work on their ledger, sampled
        # each tick, averaged over about ``_BUSY_WINDOW_S``), and when it was last sampled.
        self._busy = 0.0
        self._busy_at: float | None = None
        self._lending = Lending(config)
        self._snapshots_asked: set[str] = set()
        self._snapshot_retry_at: dict[str, float] = {}  # worker -> when to ask again
        # Placing the queue's head costs a pass over the fleet. When it fails, nothing can
        # change the answer until capacity is freed or added, the head changes or the
        # index learns something: those bump the epoch; the same epoch skips the pass.
        self._epoch = 0
        self._blocked_at: int | None = None
        # Paused after a refusal: request -> (when it goes back, the phase it goes back to).
        self._paused: dict[str, tuple[float, Phase]] = {}

    # --- inputs ------------------------------------------------------------------

    def submit(self, spec: RequestSpec, now: float) -> tuple[Admitted | Rejected, list[Action]]:
        held = self.requests.get(spec.request_id)
        if held is not None and held.spec.attempt < spec.attempt:
            # A newer run of it: its ingress gave the one we hold up (its cancel may still be
            # on the way, or a roll call brought the old run back). The old one is forgotten.
            self._forget(spec.request_id)
        refusal = self._refusal(spec)
        if refusal is not None:
            return refusal, []
        self._arrivals += 1
        tracked = Tracked(spec=spec, enqueued_at=now, order=self._arrivals)
        self.requests[spec.request_id] = tracked
        self._decode_demand += tracked.decode_tokens
        self._queue.push(tracked, front=spec.attempt > 0)
        self._epoch += 1  # it may be the new head
        tracked.phase = "queued"
        actions = self._drain_prefill(now)
        position = self._queue.position(tracked) if tracked.phase == "queued" else 0
        return Admitted(request_id=spec.request_id, queue_position=position), actions

    def on_event(self, event: WorkerEvent, now: float) -> list[Action]:
        if isinstance(event, PrefillDone | RequestFinished):  # every request's two, before the match below
            worker = self.workers.get(event.worker_id)
            if worker is not None:
                worker.touch(now)
            if isinstance(event, PrefillDone):
                return self._on_prefill_done(event, now)
            return self._on_finished(event, now)
        match event:
            case LoadReport():
                return self._on_report(event, now)
            case PrefillDone():
                self._touch(event.worker_id, now)
                return self._on_prefill_done(event, now)
            case PrefillFailed():
                self._touch(event.worker_id, now)
                return self._on_prefill_failed(event, now)
            case RequestFinished():
                self._touch(event.worker_id, now)
                return self._on_finished(event, now)
            case WorkerLeaving():
                return self._remove_worker(event.worker_id, now)
        raise AssertionError(f"unhandled event {event!r}")

    def _on_finished(self, finished: RequestFinished, now: float) -> list[Action]:
        tracked = self.requests.get(finished.request_id)
        if tracked is None or tracked.worker_id != finished.worker_id:
            return []  # stale: from an attempt that is no longer the request's
        self._learn_decode(tracked, now)
        self._learn_tpot(tracked, finished)
        self._lend(tracked, finished, now)
        self._forget(finished.request_id)
        return self._drain(now)

    def on_kv_events(self, batch: KvEventBatch, now: float) -> list[Action]:
        """A worker's cache changed. A gap in its seq means we missed some: resync."""
        if self.index.apply(batch):
            self._epoch += 1  # a prompt may now fit where its prefix is
            return []
        return self._ask_snapshot(batch.worker_id)

    def on_kv_snapshot(self, snapshot: KvSnapshot, now: float) -> list[Action]:
        self._snapshots_asked.discard(snapshot.worker_id)
        if snapshot.worker_id in self.workers:
            self.index.load_snapshot(snapshot)
            self._epoch += 1
        return []

    def on_snapshot_failed(self, worker_id: str, now: float) -> list[Action]:
        """The worker did not answer for its snapshot. Until it does, the index knows
        nothing of it (under-reporting a cache costs a recompute; over-reporting it would
        send prompts where their prefix is not), and the tick asks again."""
        self._snapshots_asked.discard(worker_id)
        self.index.forget_worker(worker_id)
        self._snapshot_retry_at[worker_id] = now + self.config.snapshot_retry_s
        return []

    def restore_session(self, binding: Binding, now: float) -> None:
        """A binding persisted by an earlier scheduler."""
        self.sessions.restore(binding, now)
        self._epoch += 1

    def reclaim(self, request_id: str, worker_id: str, now: float) -> list[Action]:
        """The worker no longer holds a request we placed on it, and the message saying how
        it ended was lost (``scheduler.audit``): forget it, release what it held, and hand it
        to its ingress, which continues it if its stream had not ended."""
        tracked = self.requests.get(request_id)
        if tracked is None or tracked.worker_id != worker_id:
            return []  # its news arrived meanwhile
        self.reclaimed += 1
        self._forget(request_id)
        message = f"request {request_id} was lost in {tracked.phase} on {worker_id} (its messages were lost)"
        error = StreamError(code="worker_lost", message=message)
        return [FailStream(tracked.spec.ingress_id, request_id, error), *self._drain(now)]

    def placed(self) -> dict[str, str]:
        """Request -> worker, for every request on a worker."""
        return {rid: t.worker_id for rid, t in self.requests.items() if t.worker_id is not None}

    def on_cancel(self, request_id: str, now: float, attempt: int | None = None) -> list[Action]:
        """The client went away (or the ingress ended runs up to ``attempt`` of it, to submit
        the next one); the workers heard the same cancel and stop on their own."""
        tracked = self.requests.get(request_id)
        if tracked is not None and (attempt is None or tracked.spec.attempt <= attempt):
            self._forget(request_id)
        return self._drain(now)

    def on_dispatch_failed(self, worker_id: str, request_id: str, outcome: DispatchOutcome, now: float) -> list[Action]:
        """A task did not reach its worker.

        ``refused``: the worker said no (full, or it heard the cancel first): try again.
        ``no_responders``: nobody listens on the worker's subject, so the task certainly
        was not delivered: the worker is gone, and this request is retried like a refusal.
        ``timeout``: the worker may or may not have it: the worker is gone, and this
        request goes with the rest of its requests (retried before decode, failed after).
        """
        tracked = self.requests.get(request_id)
        actions: list[Action] = []
        self._epoch += 1
        if tracked is not None and tracked.worker_id == worker_id and outcome != "timeout":
            if worker_id in self.workers:
                self.workers[worker_id].release(request_id)
            if outcome == "refused":
                tracked.refused_by += (worker_id,)
                tracked.attempts -= 1  # it reached a worker that is there, and nothing was lost
                if tracked.refused_since is None:
                    tracked.refused_since = now
                pause_s = min(_REFUSED_PAUSE_MAX_S, _REFUSED_PAUSE_S * 2 ** min(30, len(tracked.refused_by) - 1))
                actions = self._retry_or_fail(tracked, "dispatch_failed", now, pause_s)
            else:
                actions = self._retry_or_fail(tracked, "dispatch_failed", now)
        if outcome != "refused":
            actions += self._remove_worker(worker_id, now)
        return actions + self._drain(now)

    def tick(self, now: float, unheard_s: float = 0.0) -> list[Action]:
        """The timer. ``unheard_s``: time just past in which this scheduler read nothing (its
        event loop stalled); what workers said then still waits in its inbox, so it is no
        worker's silence (``Fleet.excuse``) and none expires for it."""
        actions: list[Action] = []
        if unheard_s > 0:
            self.fleet.excuse(unheard_s, now)
        for worker in self.fleet.expired(now, self.config.worker_expiry_s):
            actions += self._remove_worker(worker.worker_id, now)
        self.sessions.expire(now)
        if self._started is None:
            self._started = now
        elif now - self._started > self.config.worker_expiry_s:
            # Every worker that is up has registered by now: a restored binding to any other
            # names a worker that is gone (its owner check; the TTL bounds the rest).
            self.sessions_dropped += self.sessions.keep_only(self.workers.__contains__)
        self._sample_busy(now)
        self._resume_paused(now)
        expired = self._expire_deadlines(now) + self._shed_late(now)
        return actions + self._retry_snapshots(now) + expired + self._drain(now)

    def _retry_snapshots(self, now: float) -> list[Action]:
        due = [w for w, at in self._snapshot_retry_at.items() if at <= now]
        actions: list[Action] = []
        for worker_id in due:
            del self._snapshot_retry_at[worker_id]
            actions += self._ask_snapshot(worker_id)
        return actions

    # --- queries -----------------------------------------------------------------

    def status(self) -> ClusterStatus:
        workers = [
            WorkerSummary(
                worker_id=w.worker_id,
                role=w.role,
                inflight_tokens=w.load_tokens,
                running=len(w.assigned),
                engine=w.last_report.engine if w.last_report else "",
                boot_s=w.last_report.boot_s if w.last_report else 0.0,
                stats=w.last_report.stats if w.last_report else None,
                token_budget=w.token_budget,
            )
            for w in sorted(self.workers.values(), key=lambda w: w.worker_id)
        ]
        return ClusterStatus(
            workers=workers,
            queued_requests=len(self._queue),
            queued_tokens=self._queue.tokens,
            awaiting_decode=len(self._decode_wait),
            paused_requests=len(self._paused),
            reclaimed_requests=self.reclaimed,
            session_bindings=len(self.sessions),
            sessions_dropped=self.sessions_dropped,
            abandoned_handoffs=self.abandoned_handoffs,
        )

    def region_summary(self, region: str, scheduler_id: str, seq: int, sent_at: float) -> RegionSummary:
        """What this region says of itself to the others (``scheduler.regions``)."""
        prefill, rate = self._prefill_fleet()
        wait = self.predicted_start_s()
        capacity = self.decode_capacity()
        decode_full = self._claimed() > self.config.decode_overcommit * capacity
        queue_full = self._queue.tokens > 0.9 * self.config.max_queued_tokens
        return RegionSummary(
            region=region,
            scheduler_id=scheduler_id,
            seq=seq,
            sent_at=sent_at,
            predicted_wait_s=wait,
            prefill_tokens_per_s=rate,
            queued_requests=len(self._queue),
            queued_tokens=self._queue.tokens,
            inflight_tokens=sum(w.load_tokens for w in prefill),
            prefill_budget_tokens=sum(w.token_budget for w in prefill),
            decode_capacity_tokens=capacity,
            decode_demand_tokens=self._claimed(),
            prefill_workers=len(prefill),
            decode_workers=sum(1 for w in self.workers.values() if w.role != "prefill"),
            saturated=not prefill or wait > self.config.spill_wait_s or queue_full or decode_full,
            spill_wait_s=self.config.spill_wait_s,
        )

    def predicted_start_s(self) -> float:
        """When a request arriving now would start its prefill: the queue ahead of it drains
        at the whole fleet's rate, then it goes to the worker that frees up first (not the
        fleet's time to work off everything, ``predicted_wait_s``: a region of 100 workers,
        half busy, starts a request at once)."""
        prefill, rate = self._prefill_fleet()
        if not prefill:
            return 0.0
        soonest = min(w.load_tokens / (w.prefill_rate or self.config.default_prefill_tokens_per_s) for w in prefill)
        return self._queue.tokens / rate + soonest

    def predicted_wait_s(self) -> float:
        """Time for the prefill fleet to work off what is queued and in flight."""
        prefill, rate = self._prefill_fleet()
        return (self._queue.tokens + sum(w.load_tokens for w in prefill)) / rate

    def _prefill_fleet(self) -> tuple[list[WorkerState], float]:
        """The workers that prefill, and their rate together (the configured default before
        any is measured)."""
        prefill = list(self.fleet.prefill.values())  # in the order they joined, as ever
        return prefill, sum(w.prefill_rate for w in prefill) or self.config.default_prefill_tokens_per_s

    def check_invariants(self) -> None:
        self.fleet.check_invariants()
        for tracked in self.requests.values():  # set with the spec (``Tracked.respec``): never stale
            spec = tracked.spec
            assert tracked.prompt_tokens == len(spec.prompt_tokens), spec.request_id
            assert tracked.decode_tokens == spec.sampling.kv_tokens(len(spec.prompt_tokens)), spec.request_id
        for worker in self.workers.values():
            shared = worker.shared
            saved = 0 if shared is None else shared.saved
            colocated = worker.role == "both"
            assert worker.load_tokens == sum(worker.assigned.values()) - (0 if colocated else saved), worker.worker_id
            assert worker.kv_tokens == sum(worker.held.values()) - (saved if colocated else 0), worker.worker_id
            if shared is not None:
                shared.check(worker.held if colocated else worker.assigned)
            for rid in [*worker.assigned, *worker.held]:
                assert self.requests[rid].worker_id == worker.worker_id, rid
        queued = self._queue.request_ids()
        assert self._queue.tokens == sum(self.requests[r].prompt_tokens for r in queued)
        assert all(self.requests[r].phase == "queued" for r in queued)
        assert all(self.requests[r].phase == "awaiting_decode" for r in self._decode_wait)
        assert {r for r, t in self.requests.items() if t.phase == "paused"} == set(self._paused)
        assert self._decode_demand == sum(t.decode_tokens for t in self.requests.values())
        late = [self.requests[r] for r in queued if self.requests[r].late]
        assert self._queue.late_tokens == sum(t.prompt_tokens for t in late)

    # --- admission -----------------------------------------------------------------

    def _refusal(self, spec: RequestSpec) -> Rejected | None:
        rid = spec.request_id
        if rid in self.requests:
            return Rejected(request_id=rid, reason="invalid", message=f"duplicate request id {rid}")
        roles = self.fleet.roles
        both = roles["both"]
        missing = [
            need
            for need, able in (("prefill", both or roles["prefill"]), ("decode", both or roles["decode"]))
            if not able
        ]
        if missing:
            return Rejected(
                request_id=rid,
                reason="no_workers",
                retry_after_s=1.0,
                message=f"no {' and '.join(missing)} worker is available",
            )
        if spec.attempt > 0:
            return None  # admitted once already: its worker was lost, not its place
        tokens = len(spec.prompt_tokens)
        queued = self._queue.tokens - self._queue.late_tokens  # late ones are shed, not waited for
        if len(self._queue) and queued + tokens > self.config.max_queued_tokens:
            return self._overloaded(rid, f"{self._queue.tokens} prompt tokens are already queued")
        if spec.deadline_s is not None and len(self._queue) and self.predicted_wait_s() > spec.deadline_s:
            return self._overloaded(rid, f"the predicted wait exceeds the deadline of {spec.deadline_s:.1f} s")
        return self._decode_refusal(rid, spec.sampling.kv_tokens(tokens))

    def decode_capacity(self) -> int:
        """KV tokens the decode fleet holds at once: decode workers' budgets, colocated
        workers' KV capacity (beside decode workers, the lent ones', ``state.kv_share``)."""
        return self.fleet.decode_capacity  # kept as workers join, leave and report

    def _decode_refusal(self, rid: str, decode_tokens: int) -> Rejected | None:
        """429 up front when the decode fleet cannot give this request room in time: what is
        in flight already claims ``decode_overcommit`` times its KV capacity, or (SLO-aware)
        prefilled requests already wait for room. An empty fleet still takes one request,
        however large (it runs alone, as a prompt over budget does)."""
        capacity = self.decode_capacity()
        if self._slo_aware_on and self._decode_wait:
            # Prefilled requests already wait for decode room: one let in now would wait too,
            # after its first token, and so miss its time per output token.
            waiting = sum(self.requests[r].decode_tokens for r in self._decode_wait)
            return self._decode_full(rid, f"{len(self._decode_wait)} prefilled requests wait for room", waiting)
        limit, demand = self.config.decode_overcommit * capacity, self._claimed()
        if self._decode_demand == 0 or demand + decode_tokens <= limit:
            return None
        why = f"requests in flight claim {demand} KV tokens of {capacity} ({self.config.decode_overcommit:g}x allowed)"
        return self._decode_full(rid, why, demand + decode_tokens - limit)

    def _claimed(self) -> int:
        """KV tokens the requests in flight claim of the decode fleet: each its prompt and
        output, less the prompt blocks a decode shares with another on its worker."""
        return self._decode_demand - self.fleet.decode_saved

    def _decode_full(self, rid: str, why: str, excess_tokens: float) -> Rejected:
        """The 429 of a full decode fleet: retry once decodes have freed ``excess_tokens``."""
        wait = max(1.0, math.ceil(self._decode_s * excess_tokens / max(self.decode_capacity(), 1)))
        return Rejected(
            request_id=rid,
            reason="overloaded",
            retry_after_s=wait,
            message=f"decode is full: {why}; retry in about {wait:.0f} s",
        )

    def _learn_decode(self, tracked: Tracked, now: float) -> None:
        if tracked.decode_started is not None and tracked.phase == "decode":
            self._decode_s = (1 - _RATE_WEIGHT) * self._decode_s + _RATE_WEIGHT * (now - tracked.decode_started)

    def _learn_tpot(self, tracked: Tracked, finished: RequestFinished) -> None:
        """The step time of a decode a decode worker finished, as the worker measured it
        (``RequestFinished.step_s``): what more decodes on those workers would slow. Not its
        time from placement: that adds the KV handoff, a long prompt's transfer spread over a
        short answer, which reads as slow decodes on an idle fleet (it refused requests at
        0.65 req/s on Mooncake's synthetic trace) and which refusing requests cannot shorten."""
        worker = self.workers.get(finished.worker_id)
        tpot = finished.step_s
        if worker is None or worker.role != "decode" or tracked.phase != "decode":
            return
        if not 0 < tpot < math.inf:  # none measured; or a broken worker's NaN or inf, which would stay in the average
            return
        last = self._decode_tpot
        self._decode_tpot = tpot if last is None else (1 - _DECODE_TPOT_WEIGHT) * last + _DECODE_TPOT_WEIGHT * tpot

    def _decodes_slow(self) -> bool:
        """Whether decode workers' decodes have run too slow lately to take more (SLO-aware)."""
        slo, tpot = self.config.tpot_slo_s, self._decode_tpot
        return self._slo_aware_on and slo > 0 and tpot is not None and tpot > _DECODE_FULL * slo

    def _decode_room(self, tracked: Tracked, worker: WorkerState) -> float:
        """Prompt tokens a colocated worker can take beside a decode before it misses the
        TPOT SLO: each prompt token stalls the decode's steps by one token's compute at the
        worker's prefill rate (chunked prefill), and over its tokens after the first (of one
        choice: n choices step together) it can spend the SLO less what decodes have taken
        a token lately; the prompts already on the worker's ledger will stall it too.
        Infinite without a TPOT SLO or before any decode was measured."""
        slo, recent = self.config.tpot_slo_s, self._lending.tpot[worker.worker_id in self.fleet.lent]
        if slo <= 0 or not recent:
            return math.inf
        room = max(0, tracked.spec.sampling.max_tokens - 1) * max(0.0, slo - recent) * worker.prefill_rate
        return room - worker.load_tokens

    def _lend(self, tracked: Tracked, finished: RequestFinished, now: float) -> None:
        """Colocated workers lent to decoding, and back (``Lending``), from the time per
        output token of each finished decode."""
        roles = self.fleet.roles
        lending = roles["both"] > 0 and roles["prefill"] == 0  # colocated workers, and decode ones or none
        if not lending or not self._slo_aware_on or tracked.decode_started is None or tracked.phase != "decode":
            return
        worker = self.workers.get(tracked.worker_id or "")
        if worker is None:
            return
        tpot = (now - tracked.decode_started) / max(1, finished.generated_tokens - 1)
        lent = self.fleet.takes_handovers(worker)
        self._lending.observe(lent, tpot)
        step_s, generated = finished.step_s, finished.generated_tokens
        if lent and not tracked.local and 0 <= step_s < math.inf and (step_s > 0 or generated <= 2):
            # Its steps here took step_s each from the first one on: before it, the handoff.
            # (A step_s of 0 over more steps: a worker that does not measure them.)
            steps = step_s * max(0, generated - 2)
            self._lending.observe_handoff(now - tracked.decode_started - steps, tracked.prompt_tokens)
        self.fleet.decode_slack = self._lending.tpot[False] < _DECODE_SLACK * self.config.tpot_slo_s
        late_waiting = lambda: self._queue.late_tokens > 0  # noqa: E731 (the queue keeps the count)
        if self._lending.decide(self.fleet, late_waiting, max(1.0, self._decode_s), now) is not None:
            self._epoch += 1

    def _overloaded(self, rid: str, why: str) -> Rejected:
        wait = self._retry_after_s()
        return Rejected(
            request_id=rid, reason="overloaded", retry_after_s=wait, message=f"{why}; retry in about {wait:.0f} s"
        )

    def _expire_deadlines(self, now: float) -> list[Action]:
        actions: list[Action] = []
        for rid in self._queue.request_ids():
            tracked = self.requests[rid]
            deadline = tracked.spec.deadline_s
            if deadline is not None and now - tracked.enqueued_at > deadline:
                self._forget(rid)
                error = StreamError(
                    code="deadline_exceeded", message=f"request {rid} waited past its deadline of {deadline:.1f} s"
                )
                actions.append(FailStream(tracked.spec.ingress_id, rid, error))
        return actions

    # --- prefill -------------------------------------------------------------------

    def _drain(self, now: float) -> list[Action]:
        return self._drain_decode(now) + self._drain_prefill(now)

    def _drain_prefill(self, now: float) -> list[Action]:
        actions: list[Action] = []
        if self._blocked_at == self._epoch:
            return actions
        while (rid := self._queue.head()) is not None:
            tracked = self.requests[rid]
            if tracked.late and not self._over_every_budget(tracked):
                placement = self._late_placement(tracked, now)
                if placement is None:
                    self._blocked_at = self._epoch  # only late requests are queued: they wait for slack
                    return actions
            else:
                placement = self._prefill_placement(tracked, now)
                if placement is None:
                    if self._intrinsically_late(tracked, now):
                        self._queue.demote(tracked)  # it waits for an idle worker, but behind those on time
                        continue
                    self._blocked_at = self._epoch
                    return actions + self._backfill(tracked, now)  # the head waits; nobody else jumps it
                if self._misses_slo(tracked, placement, now):
                    self._queue.demote(tracked)  # behind every request that can still make it
                    continue  # whoever heads the queue now goes next (it may be this one, late)
                placement = self._lent_lane(tracked, placement) or placement
                if tracked.late and not self._slack(placement.worker):
                    self._blocked_at = self._epoch  # late and over every budget: it waits for slack
                    return actions
            self._queue.pop_head(tracked)
            actions += self._place_prefill(tracked, placement, now)
        return actions

    # SLO-aware queueing, for a policy that asks for it (``PrefillPolicy.slo_aware``) when a
    # TTFT SLO is set: a request predicted to miss the SLO wherever it goes now is *late*,
    # because of the queue or because its prompt alone takes longer than the SLO (then it
    # is late on arrival, whatever the load). It waits behind every request that can still
    # meet it and runs on capacity nobody else needs (``_slack``): a worker about to run
    # out of work, on a fleet that has had spare capacity lately or is about to run out of
    # work as a whole; of those, the one that decodes fewest sequences (a colocated worker
    # stalls its decodes for the prompt), then the quickest. So on a lightly loaded fleet a
    # late request runs at once. Under overload it would only take capacity from requests
    # that can meet the SLO: one that found no slack within ``_LATE_WAIT_SLOS`` SLOs takes a
    # worker with nothing at all to do if the fleet is not busy right now, and is shed
    # otherwise (Mooncake's early rejection, softened: a fleet with room sheds nothing).

    def _lent_lane(self, tracked: Tracked, placement: Placement) -> Placement | None:
        """The short-prompt lane of a colocated fleet with workers lent to decoding: a
        prompt whose own compute takes at most one TPOT SLO prefills and decodes on a lent
        worker (a ``LocalTask``) if its first token comes sooner there than where the policy
        placed it, while the lent decodes have room (``Lending.lane_open``). Behind a long
        prompt a short one waits through the long one's prefill iterations (vLLM batches
        its tokens with theirs); on a lent worker it waits one decode step (the lent decodes'
        time per token), and those decodes stall once, by at most one token's SLO."""
        if not self.fleet.lent or not self._lending.lane_open():
            return None
        worker = placement.worker
        # Seconds of prefill a lent worker's decodes may stall, in tokens at the rate of the
        # worker chosen: a colocated worker as the lent one is, its rate measured prefilling
        # (a lent worker's own measure is mostly the decode step its prompts wait for).
        most = self.config.tpot_slo_s * worker.prefill_rate
        cached = self._lane_cached(tracked, placement, _LANE_CACHED_TPOTS * most)
        if cached is not None:
            return cached
        if placement.tokens > most:
            return None
        lent = lane_worker(self.fleet, tracked.decode_tokens)
        if lent is None:
            return None
        need = self.placer.need(tracked, lent)  # its own cache may hold more, or less
        there = need / worker.prefill_rate + self._lending.tpot[True]
        here = (worker.load_tokens + placement.tokens) / worker.prefill_rate
        if need > most or there >= here:
            return None
        return Placement(lent, "local", need)

    def _lane_cached(self, tracked: Tracked, placement: Placement, most: float) -> Placement | None:
        """The lane for a prompt whose prefix a lent worker holds: of the lent workers with
        no prompt on their ledger and room for its KV, the one where it computes least, if
        that is at most ``most`` tokens, less than where the policy placed it, and its first
        token comes sooner there. Lending a worker takes its cache out of placement; without
        this, a follow-up turn whose history it holds recomputes all of it elsewhere."""
        rate = placement.worker.prefill_rate
        here = (placement.worker.load_tokens + placement.tokens) / rate
        best: tuple[tuple[int, int, str], WorkerState] | None = None
        for lent in self.fleet.lent.values():
            if lent.load_tokens or not lent.kv_room(tracked.decode_tokens):
                continue
            need = self.placer.need(tracked, lent)
            if need > most or need >= placement.tokens or need / rate + self._lending.tpot[True] >= here:
                continue
            key = (need, len(lent.held), lent.worker_id)
            if best is None or key < best[0]:
                best = (key, lent)
        return None if best is None else Placement(best[1], "local", best[0][0])

    def _prefill_placement(self, tracked: Tracked, now: float) -> Placement | None:
        """The policy's placement; under the hold (``fleet.hold_s``), the one without it if
        the worker holds at least ``_HOLD_REUSE`` of the prompt: held from that worker,
        the prompt would recompute its prefix elsewhere."""
        bound, budget_s = self._bound(tracked, now), self._ttft_budget_s(tracked, now)
        # The head with nobody behind it, on a busy fleet that hands its decodes over
        # (``policies.safe_limits``). Not on colocated workers alone: there a prompt also
        # stalls the decodes beside it, and on the Mooncake conversation trace, colocated,
        # the rule gave TTFT p90 1,818 -> 2,867 ms at scale 1. Not while the fleet has had
        # spare time lately (``Fleet.busy``): then capacity costs nobody anything, and at
        # light load on tool agents 6 + 2 the rule missed 11 more requests of 21,890.
        alone = len(self._queue) <= 1 and bool(self.fleet.decode) and self.fleet.busy
        others = self._not_refused(tracked, self.fleet.prefill) if tracked.refused_by else None
        if others:
            return self.placer.prefill(tracked, others, bound, budget_s, alone)
        hold_s = self.fleet.hold_s
        if hold_s <= 0:
            return self.placer.prefill(tracked, self.fleet, bound, budget_s, alone)
        self.fleet.hold_s = 0.0
        try:
            unheld = self.placer.prefill(tracked, self.fleet, bound, budget_s, alone)
        finally:
            self.fleet.hold_s = hold_s
        # The hold only narrows who fits: nothing fits under it where nothing fits without
        # it, and a choice that fits it anyway is the policy's choice under it too (the
        # least of a key, as ``Placer._prefill_by_slot`` relies on): no second placement.
        if (
            unheld is None
            or unheld.tokens <= (1 - _HOLD_REUSE) * tracked.prompt_tokens
            or (unheld.kind == "prefill" and self.fleet.fits_held(unheld.worker, unheld.tokens))
        ):
            return unheld
        return self.placer.prefill(tracked, self.fleet, bound, budget_s, alone)

    @staticmethod
    def _not_refused(tracked: Tracked, workers: dict[str, WorkerState]) -> list[WorkerState] | None:
        """Of ``workers``, those that have not refused this request, if that leaves any: a
        worker that said no is mostly still the ledger's best pick, and would say no again.
        None: place it as any other."""
        others = [w for w in workers.values() if w.worker_id not in tracked.refused_by]
        return others or None

    def _ttft_budget_s(self, tracked: Tracked, now: float) -> float:
        """Time left before this request misses the TTFT SLO (infinite: none to keep; minus
        infinite: a late request, which it cannot keep)."""
        if not self._slo_aware_on:
            return math.inf
        if tracked.late:
            return -math.inf
        return self.config.ttft_slo_s - (now - tracked.enqueued_at)

    def _misses_slo(self, tracked: Tracked, placement: Placement, now: float) -> bool:
        """Would this request, placed there now, have its first token past the TTFT SLO?
        (Its wait so far, then the worker's queued tokens and its own at the worker's rate.)"""
        if tracked.late or placement.kind == "local" or not self._slo_aware_on:
            return False
        worker = placement.worker
        predicted = (self._backlog(worker, now) + placement.tokens) / worker.prefill_rate
        return now - tracked.enqueued_at + predicted > self.config.ttft_slo_s

    @staticmethod
    def _backlog(worker: WorkerState, now: float) -> float:
        """The uncached tokens still to compute on the worker's ledger: what it holds, less
        what its rate has computed since its last prefill done (``prefill_mark``), keeping
        at least one token while it holds any. The ledger keeps a prompt's tokens until it
        is done; counted whole, a long prompt half computed made the requests behind it
        look late, and they waited behind the ones on time when they could have made it."""
        load = worker.load_tokens
        if load <= 1:
            return load
        return load - min(worker.prefill_rate * max(0.0, now - worker.prefill_mark), load - 1)

    def _intrinsically_late(self, tracked: Tracked, now: float) -> bool:
        """Would this head, which no worker can take now, miss the SLO even on the fastest
        worker idle? Then it goes behind those on time instead of holding them up (a prompt
        over every budget waits for an idle worker). Its whole prompt is counted, cached or
        not: it only reorders a head that cannot run yet anyway."""
        if tracked.late or not self._slo_aware_on or not self.fleet.prefill:
            return False
        fastest = max(w.prefill_rate for w in self.fleet.prefill.values())
        return now - tracked.enqueued_at + tracked.prompt_tokens / fastest > self.config.ttft_slo_s

    def _late_placement(self, tracked: Tracked, now: float) -> Placement | None:
        """Where the prompt computes least, if that is at most ``_LATE_CHEAP`` of the SLO
        there and its first token comes before it would be shed (``Placer.cheap``); else of
        the workers with slack (any of them, not only the policy's first choice, which may
        be the one without), those decoding fewest sequences, and of those the quickest;
        None while there is no slack."""
        slo = self.config.ttft_slo_s
        shed_in = _LATE_WAIT_SLOS * slo - (now - tracked.enqueued_at)
        cheap = self.placer.cheap(tracked, self.fleet.prefill.values(), _LATE_CHEAP * slo, shed_in)
        if cheap is not None:
            return cheap
        slack = self._slack_workers()
        if not slack and self._overdue(tracked, now):
            slack = self._spare_now()
        if not slack:
            return None
        fewest = min(len(w.held) for w in slack)
        slack = [w for w in slack if len(w.held) == fewest]
        return self.placer.prefill(tracked, slack, self._bound(tracked, now), self._ttft_budget_s(tracked, now))

    def _slack_workers(self) -> list[WorkerState]:
        """The prefill workers where ``_slack`` holds; the fleet's queue summed once, and
        only when it decides something."""
        idle = [w for w in self.fleet.prefill.values() if self._worker_slack(w)]
        spare = [w for w in idle if self._spare_lately(w)]
        return idle if len(spare) < len(idle) and self._fleet_drains() else spare

    def _spare_now(self) -> list[WorkerState]:
        """For a late request that has waited ``_LATE_WAIT_SLOS`` SLOs: the workers with
        nothing at all to do (about to run out of prompts, no sequence to decode), if the
        fleet's busy share right now, not lately, is below ``_BUSY_SPARE``. The share lately
        lags a fleet that just freed up; capacity idle now is not overload."""
        if self._busy_now() >= _BUSY_SPARE:
            return []
        return [w for w in self.fleet.prefill.values() if self._worker_slack(w) and not w.held]

    def _slack(self, worker: WorkerState) -> bool:
        """Capacity nobody else needs: this worker is about to run out of work, and the
        fleet has had spare capacity lately or is about to run out of work as a whole."""
        return self._worker_slack(worker) and (self._spare_lately(worker) or self._fleet_drains())

    def _worker_slack(self, worker: WorkerState) -> bool:
        return worker.load_tokens / worker.prefill_rate <= _LATE_SLACK * self.config.ttft_slo_s

    def _spare_lately(self, worker: WorkerState) -> bool:
        """The fleet has had spare capacity lately: late work there crowds nobody out. On a
        colocated worker that decodes, the prompt would also stall those decodes: there the
        fleet's busy share must be lower (``_BUSY_SPARE_DECODING``). A colocated worker with
        nothing to decode is a prefill worker for this."""
        return self._busy < (_BUSY_SPARE_DECODING if worker.held else _BUSY_SPARE)

    def _fleet_drains(self) -> bool:
        prefill, rate = self._prefill_fleet()
        return sum(w.load_tokens for w in prefill) / rate <= _LATE_SLACK * self.config.ttft_slo_s

    def _sample_busy(self, now: float) -> None:
        if not self.fleet.prefill or not self._slo_aware_on:
            return  # read only by the late lane and the hold (``fleet.hold_s``)
        busy = self._busy_now()
        # No history yet reads as idle, not as this instant's share: a burst that finds a
        # fresh scheduler is not a busy past.
        weight = 0.0 if self._busy_at is None else min(1.0, (now - self._busy_at) / _BUSY_WINDOW_S)
        before = self._spare_lately_states()
        self._busy, self._busy_at = (1 - weight) * self._busy + weight * busy, now
        self.fleet.busy = self._busy >= _HOLD_BUSY
        hold_s = _HOLD_S if self.fleet.busy else 0.0
        if self._spare_lately_states() != before or hold_s != self.fleet.hold_s:
            self.fleet.hold_s = hold_s
            self._epoch += 1  # a late head blocked for want of slack may find it now

    def _busy_now(self) -> float:
        """The prefill fleet's busy share at this instant: workers with work on their ledger
        (from the fleet's arrays: no pass over the workers in Python)."""
        slots = self.fleet.slots("prefill")
        return int(np.count_nonzero(self.fleet.load[slots])) / max(1, len(slots))

    def _spare_lately_states(self) -> tuple[bool, bool]:
        return self._busy < _BUSY_SPARE, self._busy < _BUSY_SPARE_DECODING

    def _overdue(self, tracked: Tracked, now: float) -> bool:
        return now - tracked.enqueued_at > _LATE_WAIT_SLOS * self.config.ttft_slo_s

    def _shed_late(self, now: float) -> list[Action]:
        """Late requests that found no slack within ``_LATE_WAIT_SLOS`` SLOs of arriving, now
        that no worker has nothing to do either (``_spare_now``): the fleet is overloaded.
        While one has, nothing is shed and the head may take it."""
        if not self._queue.late_tokens:
            return []
        overdue = [
            r for r in self._queue.request_ids() if self.requests[r].late and self._overdue(self.requests[r], now)
        ]
        if not overdue:
            return []
        if self._spare_now():
            self._epoch += 1  # an overdue late head may take a worker it could not before
            return []
        slo = self.config.ttft_slo_s
        wait = _LATE_WAIT_SLOS * slo
        shed = [self.requests[rid] for rid in overdue]
        for tracked in shed:
            self._forget(tracked.spec.request_id)
        retry_after_s = self._retry_after_s()  # what is left once they are gone
        actions: list[Action] = []
        for tracked in shed:
            rid = tracked.spec.request_id
            message = (
                f"request {rid} was shed: overloaded, it could not meet the {slo:g} s time to first token "
                f"and no capacity came free for it in {wait:g} s"
            )
            error = StreamError(code="overloaded", message=message, retry_after_s=retry_after_s)
            actions.append(FailStream(tracked.spec.ingress_id, rid, error))
        return actions

    def _retry_after_s(self) -> float:
        """When an overloaded request may try again: once the prefill fleet has worked off
        what it has now (at least a second), as an admission refusal says."""
        return max(1.0, math.ceil(self.predicted_wait_s()))

    def _over_every_budget(self, tracked: Tracked) -> bool:
        capable = self.fleet.prefill.values()
        return bool(capable) and all(tracked.prompt_tokens > w.token_budget for w in capable)

    def _backfill(self, head: Tracked, now: float) -> list[Action]:
        """A head larger than every worker's budget fits only an idle worker. Rather than
        leave the whole fleet to drain for it, the worker that frees up first is kept for
        it and the requests behind it (a bounded look-ahead, in order) may go to the others."""
        if not self._over_every_budget(head):
            return []
        kept = min(self.fleet.prefill.values(), key=lambda w: (w.load_tokens / w.prefill_rate, w.worker_id))
        others = [w for w in self.workers.values() if w is not kept and w.worker_id not in self.fleet.lent]
        actions: list[Action] = []
        for rid in self._queue.behind_head(self.config.backfill_lookahead):
            tracked = self.requests[rid]
            placement = self.placer.prefill(
                tracked, others, self._bound(tracked, now), self._ttft_budget_s(tracked, now)
            )
            if placement is None or self._misses_slo(tracked, placement, now):
                continue
            self._queue.remove(tracked)
            actions += self._place_prefill(tracked, placement, now)
        return actions

    def _decodes_in_place(self, tracked: Tracked, worker: WorkerState) -> bool:
        """Whether a colocated worker decodes what it prefills: always while it hands nothing
        over (none lent, no decode workers); never on a lent one; beside decode workers only a
        one-step answer that is all its worker has, on a fleet with spare time, whose handoff
        would cost its TPOT (``Lending.keeps_idle_local``); else unless the request's handoff
        is cheap for its answer (``Lending.keeps_local``)."""
        if not self.fleet.hands_over:
            return True
        if worker.worker_id in self.fleet.lent:
            return False
        if self.fleet.decode:
            # Beside decode workers it prefills as a prefill worker does: a decode kept here
            # would wait through its prefill iterations (on tool agents, 6 + 2, at the best
            # peer's peak: 480 ms a token against 26 on the decode workers). Unless the fleet
            # has had spare time lately and this prompt is all it has: then its decode steps
            # at once, and a short answer is spared a handoff that would cost it its TPOT.
            alone = worker.assigned.keys() == {tracked.spec.request_id} and not worker.held
            return (
                alone
                and tracked.spec.sampling.max_tokens <= 2
                and self._busy < _BUSY_SPARE_DECODING
                and self._lending.keeps_idle_local(tracked.prompt_tokens, tracked.spec.sampling.max_tokens)
            )
        return self._lending.keeps_local(tracked.prompt_tokens, tracked.spec.sampling.max_tokens)

    def _place_prefill(self, tracked: Tracked, placement: Placement, now: float) -> list[Action]:
        worker, spec = placement.worker, tracked.spec
        tracked.dispatched_at = now
        if not worker.assigned:  # an idle worker starts a stretch of prefill now (``_learn_rate``)
            worker.prefill_mark = now
        worker.assign(spec.request_id, placement.tokens)
        if placement.tokens >= spec.block_size and worker.fleet is self.fleet:
            self.fleet.mark_filled(worker)
        if worker.role == "both":
            worker.placed_tokens += placement.tokens
        local = placement.kind == "local" or (worker.role == "both" and self._decodes_in_place(tracked, worker))
        tracked.phase, tracked.worker_id, tracked.local = "prefill", worker.worker_id, local
        tracked.attempts += 1
        queued_s = max(0.0, now - tracked.enqueued_at)
        kind = LocalTask if tracked.local else PrefillTask
        task = kind(spec=spec, queued_s=queued_s, charged_tokens=placement.tokens)
        actions: list[Action] = [Dispatch(worker.worker_id, task)]
        if spec.session is not None and (not tracked.local or worker.role == "both"):
            actions.append(BindSession(self.sessions.bind(spec.tenant, spec.session, worker.worker_id, now)))
        return actions

    def _bound(self, tracked: Tracked, now: float) -> str | None:
        spec = tracked.spec
        return self.sessions.lookup(spec.tenant, spec.session, now) if spec.session is not None else None

    def _on_prefill_done(self, done: PrefillDone, now: float) -> list[Action]:
        tracked = self.requests.get(done.request_id)
        if tracked is None or tracked.phase != "prefill" or tracked.worker_id != done.worker_id:
            return []  # cancelled meanwhile, or a stale result of a retried attempt
        if tracked.adopted and done.spec is not None:
            self._learn_spec(tracked, done.spec)
        worker = self.workers[done.worker_id]
        worker.release(done.request_id)
        self._epoch += 1
        self._learn_rate(worker, tracked, done, now)
        if done.finished:
            self._forget(done.request_id)
            return self._drain_prefill(now)
        tracked.prefill, tracked.attempts, tracked.refused_since = done, 0, None
        if tracked.local:  # decodes where it prefilled
            keys = shareable_keys(tracked.spec, worker)
            if worker.role == "both":
                worker.hold_decode(done.request_id, tracked.decode_tokens, self._decode_room(tracked, worker), keys)
            else:
                worker.assign_decode(done.request_id, tracked.decode_tokens, keys)
            tracked.phase, tracked.decode_started = "decode", now
            return self._drain_prefill(now)
        if tracked.adopted:  # nothing to hand a decode worker: the prompt never came
            return self._retry_or_fail(tracked, "scheduler_failover", now) + self._drain(now)
        tracked.phase, tracked.worker_id = "awaiting_decode", None
        self._decode_wait.append(done.request_id)
        return self._drain(now)

    def resume_decode(self, spec: RequestSpec, done: PrefillDone, now: float) -> list[Action]:
        """A request the scheduler before us had prefilled and not yet placed on a decode
        worker (a standby heard both): it waits for decode room here, from the same handle
        and token 0, as it did there. Admitted already: no admission check."""
        if spec.request_id in self.requests:
            return []
        self._arrivals += 1
        tracked = Tracked(spec=spec, enqueued_at=now, order=self._arrivals, prefill=done, attempts=0)
        tracked.phase = "awaiting_decode"
        self.requests[spec.request_id] = tracked
        self._decode_demand += tracked.decode_tokens
        self._decode_wait.append(spec.request_id)
        return self._drain(now)

    def requeue(self, spec: RequestSpec, enqueued_at: float, now: float) -> list[Action]:
        """A request the scheduler before us had admitted and queued (a standby heard its
        submit and the answer): queued here in its turn (``enqueued_at``, so a deadline
        counts from its arrival), with no second admission."""
        if spec.request_id in self.requests:
            return []
        self._arrivals += 1
        tracked = Tracked(spec=spec, enqueued_at=enqueued_at, order=self._arrivals)
        self.requests[spec.request_id] = tracked
        self._decode_demand += tracked.decode_tokens
        self._queue.push(tracked)
        self._epoch += 1
        return self._drain(now)

    def learn_spec(self, spec: RequestSpec) -> None:
        """The prompt of a request adopted without it (a standby had kept its submit)."""
        tracked = self.requests.get(spec.request_id)
        if tracked is not None and tracked.adopted:
            self._learn_spec(tracked, spec)

    def _learn_spec(self, tracked: Tracked, spec: RequestSpec) -> None:
        self._decode_demand -= tracked.decode_tokens
        tracked.respec(spec)
        tracked.adopted = False
        self._decode_demand += tracked.decode_tokens

    def _on_prefill_failed(self, failed: PrefillFailed, now: float) -> list[Action]:
        tracked = self.requests.get(failed.request_id)
        if tracked is None or tracked.worker_id != failed.worker_id:
            return []
        self._forget(failed.request_id)
        error = StreamError(code="prefill_failed", message=failed.message)
        failure: list[Action] = [FailStream(tracked.spec.ingress_id, failed.request_id, error)]
        return failure + self._drain(now)

    @staticmethod
    def _learn_rate(worker: WorkerState, tracked: Tracked, done: PrefillDone, now: float) -> None:
        """The rate placement predicts with: the uncached tokens a worker computes over the
        time it is busy computing them, as seen from here (bus and batching included). A
        prompt done computed its uncached tokens (as the worker reports them) since the later
        of its dispatch and the worker's previous prefill done (``prefill_mark``): a worker
        works through its ledger in order, so those stretches add up to its busy time. Each
        worker keeps both sums, decayed by ``_RATE_DECAY`` a prompt, and their ratio, once
        they hold ``_RATE_MIN_TOKENS``, is a sample. A ratio of sums, not a mean of ratios:
        prompts done in one batch come, all but the first, with no time of their own, and a
        small prompt alone is mostly fixed costs; summed, each weighs what it computed.

        It was the tokens ahead of the prompt on the ledger at its dispatch, its own
        included, over the time to its done. But the ledger holds a prompt's tokens until it
        is done, so the one ahead was counted whole when part of it was already computed:
        on long shared documents (6 + 2, at the best peer's peak) the samples spread from
        8,400 to 38,000 tokens/s (10th to 90th percentile) against the 10,800 the workers
        did (``docs/bench-sim.md``, "The prefill rate is measured over busy time")."""
        dispatched_at = tracked.dispatched_at
        worker.prefill_mark, mark = now, worker.prefill_mark
        if dispatched_at is None:
            return  # adopted from the scheduler before us: when its stretch began is not known
        computed = max(0, done.usage.prompt_tokens - done.usage.cached_tokens)
        busy_s = max(0.0, now - max(mark, dispatched_at))
        keep = 1 - _RATE_DECAY
        worker.rate_tokens = keep * worker.rate_tokens + computed
        worker.rate_busy_s = keep * worker.rate_busy_s + busy_s
        if worker.rate_tokens < _RATE_MIN_TOKENS or worker.rate_busy_s <= 0:
            return
        sample = worker.rate_tokens / worker.rate_busy_s
        if worker.fleet is None:
            worker.prefill_rate = (1 - _RATE_WEIGHT) * worker.prefill_rate + _RATE_WEIGHT * sample
        else:
            worker.fleet.learn_rate(worker, sample, _RATE_WEIGHT, _OWN_RATE_WEIGHT)

    # --- decode ---------------------------------------------------------------------

    def _drain_decode(self, now: float) -> list[Action]:
        actions: list[Action] = []
        while self._decode_wait:
            tracked = self.requests[self._decode_wait[0]]
            decoders = None
            if tracked.refused_by and self.fleet.decode and not self.fleet.lent:  # (with some lent: ``pick_decode``)
                decoders = self._not_refused(tracked, self.fleet.decode)
            worker = self.placer.decode(tracked, decoders or self.fleet, idle_only=self._decodes_slow())
            if worker is None:
                break
            self._decode_wait.pop(0)
            if self.fleet.hands_over:
                self._lending.observe_handover(self.fleet.takes_handovers(worker))
            actions.append(self._place_decode(tracked, worker, now))
        return actions

    def _place_decode(self, tracked: Tracked, worker: WorkerState, now: float) -> Dispatch:
        done = tracked.prefill
        assert done is not None
        spec = tracked.spec
        if worker.role == "both":
            room, keys = self._decode_room(tracked, worker), shareable_keys(spec, worker)
            worker.hold_decode(spec.request_id, tracked.decode_tokens, room, keys)
        else:
            worker.assign_decode(spec.request_id, tracked.decode_tokens, shareable_keys(spec, worker))
        tracked.phase, tracked.worker_id = "decode", worker.worker_id
        tracked.decode_started = now
        tracked.attempts += 1
        task = DecodeTask(
            spec=tracked.spec,
            handle=done.handle,
            first_token=done.first_token,
            usage=done.usage,
            # In full, less nothing it shares: a scheduler taking over knows no block keys
            # of what it adopts, so it charges each in full (more than the engine holds).
            charged_tokens=tracked.decode_tokens,
        )
        return Dispatch(worker.worker_id, task)

    # --- workers ---------------------------------------------------------------------

    def _on_report(self, report: LoadReport, now: float) -> list[Action]:
        worker = self.workers.get(report.worker_id)
        actions: list[Action] = []
        if worker is not None and report.seq <= worker.last_seq:
            # Heartbeats of one worker arrive in order: a smaller seq is a restarted
            # worker under the same id, which holds none of what we placed on it.
            actions = self._remove_worker(report.worker_id, now)
            worker = None
        if worker is None:
            worker = WorkerState(
                worker_id=report.worker_id,
                role=report.role,
                token_budget=report.token_budget,
                block_size=report.block_size,
                last_seen=now,
                own_rate=self.config.default_prefill_tokens_per_s,
                device_class=report.device_class[:DEVICE_CLASS_MAX],
            )
            self._epoch += 1
            self.fleet.add(worker)
            actions += self._ask_snapshot(report.worker_id)  # a full dump when a worker joins
        kv_capacity = report.kv_capacity_tokens or report.token_budget
        if (report.token_budget, kv_capacity) != (worker.token_budget, worker.kv_capacity):
            self._epoch += 1
        worker.token_budget, worker.last_seen = report.token_budget, now
        worker.kv_capacity = kv_capacity
        worker.last_seq = report.seq
        worker.last_report = report
        known = self.index.last_seq(report.worker_id)
        if known is not None and report.kv_seq > known:  # its last batch never reached us
            actions += self._ask_snapshot(report.worker_id)
        for held in report.held or []:
            self._adopt(worker, held, now)
        return actions + self._drain(now)

    def _adopt(self, worker: WorkerState, held: HeldRequest, now: float) -> None:
        """A request the worker holds for the scheduler before us (see the module's note)."""
        rid = held.request_id
        if rid in self.requests:
            return  # ours already: placed since we rolled call
        # What the ledger and the stream need; its prompt comes with its PrefillDone.
        spec = RequestSpec(
            request_id=rid,
            ingress_id=held.ingress_id,
            model="",
            prompt_tokens=[],
            block_size=worker.block_size,
            block_keys=[],
            sampling=SamplingParams(max_tokens=held.decode_tokens),
            attempt=held.attempt,
        )
        self._arrivals += 1
        tracked = Tracked(spec=spec, enqueued_at=now, order=self._arrivals, adopted=True)
        tracked.phase, tracked.worker_id, tracked.local, tracked.attempts = held.phase, worker.worker_id, held.local, 1
        if held.phase == "decode":
            tracked.decode_started = now
        self.requests[rid] = tracked
        self._decode_demand += tracked.decode_tokens
        worker.assign(rid, held.tokens)
        self._epoch += 1

    def ledger(self) -> dict[str, dict[str, int]]:
        """Each worker's ledger: request -> tokens charged (for tests and diagnostics)."""
        return {w.worker_id: {**w.assigned, **w.held} for w in self.workers.values() if w.assigned or w.held}

    def _ask_snapshot(self, worker_id: str) -> list[Action]:
        if worker_id not in self.workers or worker_id in self._snapshots_asked:
            return []
        self._snapshots_asked.add(worker_id)
        return [RequestSnapshot(worker_id)]

    def _touch(self, worker_id: str, now: float) -> None:
        worker = self.workers.get(worker_id)
        if worker is not None:
            worker.touch(now)

    def _remove_worker(self, worker_id: str, now: float) -> list[Action]:
        worker = self.fleet.remove(worker_id)
        if worker is None:
            return []
        self.index.forget_worker(worker_id)
        self.sessions_dropped += self.sessions.forget_worker(worker_id)
        self._snapshots_asked.discard(worker_id)
        self._snapshot_retry_at.pop(worker_id, None)
        self._epoch += 1
        actions: list[Action] = []
        for rid in [*worker.assigned, *worker.held]:
            actions += self._retry_or_fail(self.requests[rid], "worker_lost", now)
        return actions + self._drain(now)

    def _retry_or_fail(self, tracked: Tracked, code: str, now: float, pause_s: float = 0.0) -> list[Action]:
        """A request that lost its worker (its ledger entry released): back to the front of
        its queue, after ``pause_s`` (``_paused``) if any, while it has dispatches left
        (refused: while it has been refused for less than ``refused_retry_s``); else failed."""
        rid = tracked.spec.request_id
        can_retry = tracked.attempts < self.config.max_dispatch_attempts and not tracked.adopted
        refused_s = 0.0 if pause_s <= 0 or tracked.refused_since is None else now - tracked.refused_since
        gave_up = pause_s > 0 and refused_s + pause_s > self.config.refused_retry_s
        can_retry = can_retry and not gave_up  # refused as long as a request may be: fuller than it says
        back: Phase | None = None
        if tracked.phase == "prefill" and code == "dispatch_failed" and can_retry:
            back = "queued"
        elif tracked.phase == "decode" and code == "dispatch_failed" and can_retry and not tracked.local:
            back = "awaiting_decode"  # no token of decode was produced yet
        if back is not None and pause_s > 0:
            tracked.phase, tracked.worker_id = "paused", None
            self._paused[rid] = (now + pause_s, back)
            return []
        if back is not None:
            self._requeue(tracked, back)
            return []
        self._forget(rid)
        message = f"request {rid} failed in {tracked.phase}: {code.replace('_', ' ')}"
        if gave_up:
            message += f" (its workers refused it for {refused_s:.1f} s: fuller than they said)"
        return [FailStream(tracked.spec.ingress_id, rid, StreamError(code=code, message=message))]

    def _requeue(self, tracked: Tracked, back: Phase) -> None:
        if back == "queued":
            self._queue.push(tracked, front=True)
            self._epoch += 1  # a new head
            tracked.phase, tracked.worker_id, tracked.local = "queued", None, False
        else:
            tracked.phase, tracked.worker_id = "awaiting_decode", None
            self._decode_wait.insert(0, tracked.spec.request_id)

    def _resume_paused(self, now: float) -> None:
        """Requests whose pause after a refusal is over go back to the front of their queue."""
        for rid in [r for r, (at, _) in self._paused.items() if at <= now]:
            _, back = self._paused.pop(rid)
            self._requeue(self.requests[rid], back)

    def _forget(self, request_id: str) -> None:
        tracked = self.requests.pop(request_id, None)
        if tracked is None:
            return
        self._decode_demand -= tracked.decode_tokens
        self._epoch += 1
        if tracked.worker_id is not None and tracked.worker_id in self.workers:
            self.workers[tracked.worker_id].release(request_id)
        if tracked.phase == "queued":
            self._queue.remove(tracked)
        elif tracked.phase == "awaiting_decode":
            self._decode_wait.remove(request_id)
            self.abandoned_handoffs += 1
        elif tracked.phase == "paused":
            _, back = self._paused.pop(request_id)
            self.abandoned_handoffs += back == "awaiting_decode"
