"""The scheduler's decisions: a pure, synchronous state machine.

Events in (a submit, a worker's heartbeat or result, a cancel, a dispatch that failed,
the passing of time), actions out (dispatch a task to a worker, fail a stream). Time
is passed in; nothing here does I/O, so the policy is tested with a fake clock and a
benchmark can replay a trace through the very same code.

Life of a request: queued -> prefill -> awaiting_decode -> decode -> (gone).
A request whose prefill worker is lost before it finished prefill is queued again
(nothing but possibly the first token has reached the client, and the ingress drops a
repeated seq 0); one whose decode worker is lost fails with ``worker_lost``: its
tokens so far came from sampling we cannot replay.
"""

from __future__ import annotations

import bisect
import math
from dataclasses import dataclass
from typing import Literal

from scheduler.config import SchedulerConfig
from scheduler.index import PrefixIndex
from scheduler.placement import pick_decode, pick_prefill
from scheduler.state import Tracked, WorkerState
from schemas import (
    Admitted,
    ClusterStatus,
    DecodeTask,
    KvEventBatch,
    KvSnapshot,
    LoadReport,
    PrefillDone,
    PrefillFailed,
    PrefillTask,
    Rejected,
    RequestFinished,
    RequestSpec,
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


Action = Dispatch | FailStream | RequestSnapshot
DispatchOutcome = Literal["refused", "no_responders", "timeout"]


class SchedulerCore:
    def __init__(self, config: SchedulerConfig) -> None:
        self.config = config
        self.workers: dict[str, WorkerState] = {}
        self.requests: dict[str, Tracked] = {}
        # (priority, 0 for re-queued else 1, arrival order, request_id), kept sorted: within a
        # priority, requests that lost their worker go first, each group in arrival order.
        self._queue: list[tuple[int, int, int, str]] = []
        self._queued_tokens = 0
        self._decode_wait: list[str] = []  # prefilled, waiting for decode room, FIFO
        self._sessions: dict[str, tuple[str, float]] = {}  # session -> (worker, expires_at)
        self._arrivals = 0
        self._prefill_rate = config.default_prefill_tokens_per_s  # per worker, EWMA
        self.index = PrefixIndex(config.index_max_entries)
        self._snapshots_asked: set[str] = set()

    # --- inputs ------------------------------------------------------------------

    def submit(self, spec: RequestSpec, now: float) -> tuple[Admitted | Rejected, list[Action]]:
        refusal = self._refusal(spec)
        if refusal is not None:
            return refusal, []
        self._arrivals += 1
        tracked = Tracked(spec=spec, enqueued_at=now, order=self._arrivals)
        self.requests[spec.request_id] = tracked
        self._enqueue(tracked)
        actions = self._drain_prefill(now)
        return Admitted(request_id=spec.request_id, queue_position=self._position(spec)), actions

    def on_event(self, event: WorkerEvent, now: float) -> list[Action]:
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
                tracked = self.requests.get(event.request_id)
                if tracked is None or tracked.worker_id != event.worker_id:
                    return []  # stale: from an attempt that is no longer the request's
                self._forget(event.request_id)
                return self._drain_decode(now) + self._drain_prefill(now)
            case WorkerLeaving():
                return self._remove_worker(event.worker_id, now)
        raise AssertionError(f"unhandled event {event!r}")

    def on_kv_events(self, batch: KvEventBatch, now: float) -> list[Action]:
        """A worker's cache changed. A gap in its seq means we missed some: resync."""
        if self.index.apply(batch):
            return []
        return self._ask_snapshot(batch.worker_id)

    def on_kv_snapshot(self, snapshot: KvSnapshot, now: float) -> list[Action]:
        self._snapshots_asked.discard(snapshot.worker_id)
        if snapshot.worker_id in self.workers:
            self.index.load_snapshot(snapshot)
        return []

    def on_snapshot_failed(self, worker_id: str, now: float) -> list[Action]:
        """The worker did not answer for its snapshot: ask again on its next event."""
        self._snapshots_asked.discard(worker_id)
        return []

    def _ask_snapshot(self, worker_id: str) -> list[Action]:
        if worker_id not in self.workers or worker_id in self._snapshots_asked:
            return []
        self._snapshots_asked.add(worker_id)
        return [RequestSnapshot(worker_id)]

    def on_cancel(self, request_id: str, now: float) -> list[Action]:
        """The client went away; the workers heard the same cancel and stop on their own."""
        self._forget(request_id)
        return self._drain_decode(now) + self._drain_prefill(now)

    def on_dispatch_failed(self, worker_id: str, request_id: str, outcome: DispatchOutcome,
                           now: float) -> list[Action]:
        """A task did not reach its worker.

        ``refused``: the worker said no (full, or it heard the cancel first): try again.
        ``no_responders``: nobody listens on the worker's subject, so the task certainly
        was not delivered: the worker is gone, and this request is retried like a refusal.
        ``timeout``: the worker may or may not have it: the worker is gone, and this
        request goes with the rest of its requests (retried before decode, failed after).
        """
        tracked = self.requests.get(request_id)
        actions: list[Action] = []
        if tracked is not None and tracked.worker_id == worker_id and outcome != "timeout":
            if worker_id in self.workers:
                self.workers[worker_id].release(request_id)
            actions = self._retry_or_fail(tracked, "dispatch_failed", now)
        if outcome != "refused":
            actions += self._remove_worker(worker_id, now)
        return actions + self._drain_decode(now) + self._drain_prefill(now)

    def tick(self, now: float) -> list[Action]:
        actions: list[Action] = []
        for worker in list(self.workers.values()):
            if now - worker.last_seen > self.config.worker_expiry_s:
                actions += self._remove_worker(worker.worker_id, now)
        self._sessions = {s: b for s, b in self._sessions.items() if b[1] > now}
        return actions + self._drain_decode(now) + self._drain_prefill(now)

    # --- queries -----------------------------------------------------------------

    def status(self) -> ClusterStatus:
        workers = [
            WorkerSummary(worker_id=w.worker_id, role=w.role, inflight_tokens=w.load_tokens,
                          running=len(w.assigned))
            for w in sorted(self.workers.values(), key=lambda w: w.worker_id)
        ]
        return ClusterStatus(workers=workers, queued_requests=len(self._queue),
                             queued_tokens=self._queued_tokens)

    def predicted_wait_s(self) -> float:
        """Time for the prefill fleet to work off what is queued and in flight."""
        prefill = [w for w in self.workers.values() if w.role == "prefill"]
        backlog = self._queued_tokens + sum(w.load_tokens for w in prefill)
        return backlog / (self._prefill_rate * max(1, len(prefill)))

    def check_invariants(self) -> None:
        for worker in self.workers.values():
            assert worker.load_tokens == sum(worker.assigned.values()), worker.worker_id
            for rid in worker.assigned:
                assert self.requests[rid].worker_id == worker.worker_id, rid
        queued = [entry[-1] for entry in self._queue]
        assert self._queued_tokens == sum(self.requests[r].prompt_tokens for r in queued)
        assert all(self.requests[r].phase == "queued" for r in queued)
        assert all(self.requests[r].phase == "awaiting_decode" for r in self._decode_wait)

    # --- admission -----------------------------------------------------------------

    def _refusal(self, spec: RequestSpec) -> Rejected | None:
        rid = spec.request_id
        if rid in self.requests:
            return Rejected(request_id=rid, reason="invalid", message=f"duplicate request id {rid}")
        roles = {w.role for w in self.workers.values()}
        if roles != {"prefill", "decode"}:
            missing = " and ".join(sorted({"prefill", "decode"} - roles))
            return Rejected(request_id=rid, reason="no_workers", retry_after_s=1.0,
                            message=f"no {missing} worker is available")
        tokens = len(spec.prompt_tokens)
        if self._queue and self._queued_tokens + tokens > self.config.max_queued_tokens:
            wait = max(1.0, math.ceil(self.predicted_wait_s()))
            return Rejected(request_id=rid, reason="overloaded", retry_after_s=wait,
                            message=f"{self._queued_tokens} prompt tokens are already queued; "
                                    f"retry in about {wait:.0f} s")
        return None

    # --- prefill -------------------------------------------------------------------

    def _enqueue(self, tracked: Tracked, front: bool = False) -> None:
        tracked.requeued = front
        bisect.insort(self._queue, self._queue_key(tracked))
        tracked.phase, tracked.worker_id = "queued", None
        self._queued_tokens += tracked.prompt_tokens

    @staticmethod
    def _queue_key(tracked: Tracked) -> tuple[int, int, int, str]:
        return (tracked.spec.priority, 0 if tracked.requeued else 1, tracked.order, tracked.spec.request_id)

    def _position(self, spec: RequestSpec) -> int:
        tracked = self.requests[spec.request_id]
        if tracked.phase != "queued":
            return 0
        return bisect.bisect_left(self._queue, self._queue_key(tracked)) + 1

    def _drain_prefill(self, now: float) -> list[Action]:
        actions: list[Action] = []
        while self._queue:
            rid = self._queue[0][-1]
            tracked = self.requests[rid]
            worker = pick_prefill(self.workers.values(), tracked, self._bound(tracked, now))
            if worker is None:
                break  # FIFO within a priority: the head waits, nobody jumps it
            self._queue.pop(0)
            self._queued_tokens -= tracked.prompt_tokens
            actions.append(self._place_prefill(tracked, worker, now))
        return actions

    def _place_prefill(self, tracked: Tracked, worker: WorkerState, now: float) -> Dispatch:
        worker.assign(tracked.spec.request_id, tracked.prompt_tokens)
        tracked.phase, tracked.worker_id = "prefill", worker.worker_id
        tracked.attempts += 1
        if tracked.spec.session is not None:
            self._sessions[tracked.spec.session] = (worker.worker_id, now + self.config.session_ttl_s)
        task = PrefillTask(spec=tracked.spec, queued_s=max(0.0, now - tracked.enqueued_at))
        return Dispatch(worker.worker_id, task)

    def _bound(self, tracked: Tracked, now: float) -> str | None:
        session = tracked.spec.session
        binding = self._sessions.get(session) if session is not None else None
        return binding[0] if binding is not None and binding[1] > now else None

    def _on_prefill_done(self, done: PrefillDone, now: float) -> list[Action]:
        tracked = self.requests.get(done.request_id)
        if tracked is None or tracked.phase != "prefill" or tracked.worker_id != done.worker_id:
            return []  # cancelled meanwhile, or a stale result of a retried attempt
        self.workers[done.worker_id].release(done.request_id)
        self._learn_rate(done)
        if done.finished:
            self._forget(done.request_id)
            return self._drain_prefill(now)
        tracked.phase, tracked.worker_id, tracked.prefill = "awaiting_decode", None, done
        tracked.attempts = 0
        self._decode_wait.append(done.request_id)
        return self._drain_decode(now) + self._drain_prefill(now)

    def _on_prefill_failed(self, failed: PrefillFailed, now: float) -> list[Action]:
        tracked = self.requests.get(failed.request_id)
        if tracked is None or tracked.worker_id != failed.worker_id:
            return []
        self._forget(failed.request_id)
        error = StreamError(code="prefill_failed", message=failed.message)
        failure: list[Action] = [FailStream(tracked.spec.ingress_id, failed.request_id, error)]
        return failure + self._drain_decode(now) + self._drain_prefill(now)

    def _learn_rate(self, done: PrefillDone) -> None:
        computed = done.usage.prompt_tokens - done.usage.cached_tokens
        if computed > 0 and done.usage.prefill_s > 0:
            self._prefill_rate = 0.8 * self._prefill_rate + 0.2 * computed / done.usage.prefill_s

    # --- decode ---------------------------------------------------------------------

    def _drain_decode(self, now: float) -> list[Action]:
        actions: list[Action] = []
        while self._decode_wait:
            tracked = self.requests[self._decode_wait[0]]
            worker = pick_decode(self.workers.values(), tracked)
            if worker is None:
                break
            self._decode_wait.pop(0)
            actions.append(self._place_decode(tracked, worker))
        return actions

    def _place_decode(self, tracked: Tracked, worker: WorkerState) -> Dispatch:
        done = tracked.prefill
        assert done is not None
        worker.assign(tracked.spec.request_id, tracked.decode_tokens)
        tracked.phase, tracked.worker_id = "decode", worker.worker_id
        tracked.attempts += 1
        task = DecodeTask(spec=tracked.spec, handle=done.handle, first_token=done.first_token,
                          usage=done.usage)
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
            worker = WorkerState(worker_id=report.worker_id, role=report.role,
                                 token_budget=report.token_budget, block_size=report.block_size,
                                 last_seen=now)
            self.workers[report.worker_id] = worker
            actions += self._ask_snapshot(report.worker_id)  # a full dump when a worker joins
        worker.token_budget, worker.last_seen = report.token_budget, now
        worker.last_seq = report.seq
        return actions + self._drain_decode(now) + self._drain_prefill(now)

    def _touch(self, worker_id: str, now: float) -> None:
        worker = self.workers.get(worker_id)
        if worker is not None:
            worker.last_seen = now

    def _remove_worker(self, worker_id: str, now: float) -> list[Action]:
        worker = self.workers.pop(worker_id, None)
        if worker is None:
            return []
        self.index.forget_worker(worker_id)
        self._snapshots_asked.discard(worker_id)
        actions: list[Action] = []
        for rid in list(worker.assigned):
            actions += self._retry_or_fail(self.requests[rid], "worker_lost", now)
        return actions + self._drain_decode(now) + self._drain_prefill(now)

    def _retry_or_fail(self, tracked: Tracked, code: str, now: float) -> list[Action]:
        rid = tracked.spec.request_id
        can_retry = tracked.attempts < self.config.max_dispatch_attempts
        if tracked.phase == "prefill" and can_retry:
            self._enqueue(tracked, front=True)
            return []
        if tracked.phase == "decode" and code == "dispatch_failed" and can_retry:
            tracked.phase, tracked.worker_id = "awaiting_decode", None
            self._decode_wait.insert(0, rid)  # no token of decode was produced yet
            return []
        self._forget(rid)
        message = f"request {rid} failed in {tracked.phase}: {code.replace('_', ' ')}"
        return [FailStream(tracked.spec.ingress_id, rid, StreamError(code=code, message=message))]

    def _forget(self, request_id: str) -> None:
        tracked = self.requests.pop(request_id, None)
        if tracked is None:
            return
        if tracked.worker_id is not None and tracked.worker_id in self.workers:
            self.workers[tracked.worker_id].release(request_id)
        if tracked.phase == "queued":
            self._queue.remove(self._queue_key(tracked))
            self._queued_tokens -= tracked.prompt_tokens
        elif tracked.phase == "awaiting_decode":
            self._decode_wait.remove(request_id)
