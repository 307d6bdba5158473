"""SchedulerCore: admission, placement, queueing and failure handling, with a fake clock.

Each test drives the core through a ``Harness`` that checks the core's own invariants
and a few of ours (the ledger and the phases agree) after every single step.
"""

from __future__ import annotations

import os
import random
from collections import deque
from typing import Any

import msgspec
import pytest

from switchyard.scheduler import BindSession, Dispatch, FailStream, RequestSnapshot, SchedulerConfig, SchedulerCore
from switchyard.scheduler.sessions import Binding
from switchyard.schemas import Admitted, DecodeTask, PrefillTask, Rejected, RequestSpec, WorkerEvent
from tests.support.factories import (
    FakeClock,
    load_report,
    make_spec,
    prefill_done,
    prefill_failed,
    request_finished,
    worker_leaving,
)


class Harness:
    """The core, a fake clock, and checks after every step."""

    def __init__(self, **config: Any) -> None:
        self.core = SchedulerCore(SchedulerConfig(**config))
        self.clock = FakeClock()
        self._seqs: dict[str, int] = {}
        self.snapshots_asked: list[str] = []

    def check(self) -> None:
        self.core.check_invariants()
        check_ledger(self.core)

    def submit(self, spec: RequestSpec) -> tuple[Admitted | Rejected, list]:
        reply, actions = self.core.submit(spec, self.clock.now)
        self.check()
        return reply, actions

    def admit(self, spec: RequestSpec) -> list:
        reply, actions = self.submit(spec)
        assert isinstance(reply, Admitted), reply
        return actions

    def event(self, event: WorkerEvent) -> list:
        actions = self.core.on_event(event, self.clock.now)
        self.check()
        return actions

    def report(self, worker_id: str, role: str = "prefill", budget: int = 1000, seq: int | None = None) -> list:
        """A heartbeat; each worker's seq counts up, as a live worker's does."""
        if seq is None:
            seq = self._seqs.get(worker_id, 0) + 1
        self._seqs[worker_id] = seq
        actions = self.event(load_report(worker_id, role, budget=budget, seq=seq))  # type: ignore[arg-type]
        self.snapshots_asked += [a.worker_id for a in actions if isinstance(a, RequestSnapshot)]
        return [a for a in actions if not isinstance(a, RequestSnapshot)]

    def cancel(self, request_id: str) -> list:
        actions = self.core.on_cancel(request_id, self.clock.now)
        self.check()
        return actions

    def dispatch_failed(self, worker_id: str, request_id: str, outcome: str = "refused") -> list:
        actions = self.core.on_dispatch_failed(worker_id, request_id, outcome, self.clock.now)
        self.check()
        return actions

    def tick(self, advance: float = 0.0) -> list:
        self.clock.advance(advance)
        actions = self.core.tick(self.clock.now)
        self.check()
        return actions

    def phase(self, request_id: str) -> str | None:
        tracked = self.core.requests.get(request_id)
        return tracked.phase if tracked else None

    def load(self, worker_id: str) -> int:
        return self.core.workers[worker_id].load_tokens


def check_ledger(core: SchedulerCore) -> None:
    """No request is both queued and placed; every placed request is on its worker's ledger."""
    placed: dict[str, str] = {}
    for worker in core.workers.values():
        for rid in worker.assigned:
            assert rid not in placed, f"{rid} on both {placed[rid]} and {worker.worker_id}"
            placed[rid] = worker.worker_id
    for rid, tracked in core.requests.items():
        if tracked.phase in ("prefill", "decode"):
            assert placed.get(rid) == tracked.worker_id, (rid, tracked.phase, tracked.worker_id)
        else:
            assert tracked.worker_id is None and rid not in placed, (rid, tracked.phase)
    for rid, wid in placed.items():
        role = core.workers[wid].role
        phase = core.requests[rid].phase
        assert (role, phase) in {("prefill", "prefill"), ("decode", "decode")}, (rid, wid, phase)
    status = core.status()
    queued = [t for t in core.requests.values() if t.phase == "queued"]
    assert status.queued_requests == len(queued)
    assert status.queued_tokens == sum(t.prompt_tokens for t in queued)


def dispatches(actions: list, kind: type | None = None) -> list[Dispatch]:
    found = [a for a in actions if isinstance(a, Dispatch)]
    return [a for a in found if kind is None or isinstance(a.task, kind)]


def dispatched(actions: list, kind: type = PrefillTask) -> list[tuple[str, str]]:
    """(request_id, worker_id) of each dispatch of ``kind``, in order."""
    return [(a.task.spec.request_id, a.worker_id) for a in dispatches(actions, kind)]


def failures(actions: list) -> list[FailStream]:
    return [a for a in actions if isinstance(a, FailStream)]


def cluster(h: Harness, prefill: dict[str, int], decode: dict[str, int]) -> None:
    for wid, budget in prefill.items():
        assert h.report(wid, "prefill", budget) == []
    for wid, budget in decode.items():
        assert h.report(wid, "decode", budget) == []


# --- admission ---------------------------------------------------------------------------


def test_decode_admission_refuses_up_front_what_decode_cannot_hold_in_time() -> None:
    # One decode worker holding 1,000 KV tokens, at most 1.5x claimed in flight: each request
    # claims 100 prompt + 200 max_tokens = 300, so five fit (1,500) and the sixth is a 429.
    h = Harness(decode_overcommit=1.5, default_decode_s=8.0)
    cluster(h, {"p1": 100_000}, {"d1": 1000})
    specs = [make_spec(f"r{i}", prompt_len=100, max_tokens=200) for i in range(6)]
    for spec in specs[:5]:
        h.admit(spec)
    reply, actions = h.submit(specs[5])
    assert isinstance(reply, Rejected) and reply.reason == "overloaded" and actions == []
    assert "decode is full" in reply.message and reply.retry_after_s >= 1.0
    # Room comes back when a request ends (here: one is cancelled), and the ledger follows.
    h.core.on_cancel("r0", h.clock.now)
    h.check()
    h.admit(specs[5])


def test_decode_admission_learns_how_long_a_decode_lasts_for_its_retry_after() -> None:
    h = Harness(decode_overcommit=1.0, default_decode_s=1.0)
    cluster(h, {"p1": 100_000}, {"d1": 1000})
    first = make_spec("first", prompt_len=500, max_tokens=500)
    h.admit(first)
    assert dispatched(h.event(prefill_done(first, "p1")), DecodeTask) == [("first", "d1")]
    h.clock.advance(100.0)  # a slow decode: the estimate moves from 1 s towards 100 s
    h.event(request_finished(first, "d1"))
    h.admit(make_spec("a", prompt_len=500, max_tokens=500))
    reply, _ = h.submit(make_spec("b", prompt_len=500, max_tokens=500))
    assert isinstance(reply, Rejected) and reply.retry_after_s > 5.0


def test_an_idle_decode_fleet_takes_one_request_larger_than_its_capacity() -> None:
    h = Harness(decode_overcommit=1.0)
    cluster(h, {"p1": 100_000}, {"d1": 100})
    h.admit(make_spec("huge", prompt_len=500, max_tokens=500))  # runs alone, as an oversized prompt does
    reply, _ = h.submit(make_spec("next", prompt_len=10, max_tokens=10))
    assert isinstance(reply, Rejected)


def test_submit_with_no_workers_is_rejected() -> None:
    h = Harness()
    spec = make_spec("r1")
    reply, actions = h.submit(spec)
    assert isinstance(reply, Rejected)
    assert reply.reason == "no_workers" and reply.retry_after_s >= 1
    assert actions == [] and "r1" not in h.core.requests


def test_submit_with_only_prefill_workers_names_the_missing_role() -> None:
    h = Harness()
    h.report("p1", "prefill")
    reply, _ = h.submit(make_spec("r1"))
    assert isinstance(reply, Rejected) and reply.reason == "no_workers"
    assert "decode" in reply.message and "prefill" not in reply.message


def test_duplicate_request_id_is_invalid() -> None:
    h = Harness()
    cluster(h, {"p1": 1000}, {"d1": 1000})
    h.admit(make_spec("r1"))
    reply, actions = h.submit(make_spec("r1"))
    assert isinstance(reply, Rejected) and reply.reason == "invalid"
    assert actions == []


def test_queued_tokens_over_the_limit_are_rejected_as_overloaded() -> None:
    h = Harness(max_queued_tokens=100, default_prefill_tokens_per_s=10.0)
    cluster(h, {"p1": 50}, {"d1": 10_000})
    assert dispatched(h.admit(make_spec("r1", prompt_len=50))) == [("r1", "p1")]
    reply, actions = h.submit(make_spec("r2", prompt_len=60))
    assert reply == Admitted(request_id="r2", queue_position=1) and actions == []
    reply, actions = h.submit(make_spec("r3", prompt_len=41))
    assert isinstance(reply, Rejected) and reply.reason == "overloaded"
    # backlog = 60 queued + 50 in flight, at 10 tokens/s on one worker: 11 s
    assert reply.retry_after_s == 11.0
    assert actions == [] and "r3" not in h.core.requests
    reply, _ = h.submit(make_spec("r4", prompt_len=40))  # exactly at the limit: admitted
    assert reply == Admitted(request_id="r4", queue_position=2)


def test_retry_after_is_at_least_one_second() -> None:
    h = Harness(max_queued_tokens=10, default_prefill_tokens_per_s=1e9)
    cluster(h, {"p1": 5}, {"d1": 10_000})
    h.admit(make_spec("r1", prompt_len=5))
    h.admit(make_spec("r2", prompt_len=5))
    reply, _ = h.submit(make_spec("r3", prompt_len=6))
    assert isinstance(reply, Rejected) and reply.reason == "overloaded"
    assert reply.retry_after_s >= 1


def test_a_big_prompt_is_admitted_when_nothing_is_queued() -> None:
    h = Harness(max_queued_tokens=100)
    cluster(h, {"p1": 50}, {"d1": 10_000})
    assert dispatched(h.admit(make_spec("r1", prompt_len=500))) == [("r1", "p1")]


# --- prefill placement -------------------------------------------------------------------


def test_submit_dispatches_prefill_to_least_loaded_worker() -> None:
    h = Harness()
    cluster(h, {"p1": 1000, "p2": 1000, "p3": 1000}, {"d1": 10_000})
    a, b, c = make_spec("a", prompt_len=100), make_spec("b", prompt_len=50), make_spec("c", prompt_len=70)
    assert h.admit(a) == [Dispatch("p1", PrefillTask(spec=a, queued_s=0.0, charged_tokens=100))]
    assert dispatched(h.admit(b)) == [("b", "p2")]
    assert dispatched(h.admit(c)) == [("c", "p3")]
    assert dispatched(h.admit(make_spec("d", prompt_len=10))) == [("d", "p2")]  # 50 < 70 < 100
    assert (h.load("p1"), h.load("p2"), h.load("p3")) == (100, 60, 70)


def test_admitted_and_dispatched_at_once_has_queue_position_zero() -> None:
    h = Harness()
    cluster(h, {"p1": 1000}, {"d1": 1000})
    reply, _ = h.submit(make_spec("r1"))
    assert reply == Admitted(request_id="r1", queue_position=0)


def test_budget_is_respected_and_the_queue_drains_fifo() -> None:
    h = Harness()
    cluster(h, {"p1": 100}, {"d1": 10_000})
    r1, r2, r3 = (make_spec(f"r{i}", prompt_len=n) for i, n in ((1, 60), (2, 60), (3, 30)))
    assert dispatched(h.admit(r1)) == [("r1", "p1")]
    reply, actions = h.submit(r2)
    assert reply == Admitted(request_id="r2", queue_position=1) and actions == []
    # r3 would fit beside r1, but it does not jump the head of the queue.
    reply, actions = h.submit(r3)
    assert reply == Admitted(request_id="r3", queue_position=2) and actions == []
    assert h.load("p1") == 60 and h.phase("r3") == "queued"

    h.clock.advance(1.5)
    actions = h.event(prefill_done(r1, "p1"))
    assert dispatched(actions) == [("r2", "p1"), ("r3", "p1")]
    assert dispatches(actions, PrefillTask)[0].task.queued_s == pytest.approx(1.5)
    assert h.load("p1") == 90


def test_prompt_larger_than_the_budget_runs_alone_on_an_idle_worker() -> None:
    h = Harness()
    cluster(h, {"p1": 100}, {"d1": 10_000})
    big, small = make_spec("big", prompt_len=500), make_spec("small", prompt_len=10)
    assert dispatched(h.admit(big)) == [("big", "p1")]
    assert h.admit(small) == []  # the worker is over budget: nothing joins
    assert dispatched(h.event(prefill_done(big, "p1"))) == [("small", "p1")]


def test_lower_priority_number_is_dispatched_first() -> None:
    h = Harness()
    cluster(h, {"p1": 100}, {"d1": 10_000})
    blocker = make_spec("blocker", prompt_len=100)
    h.admit(blocker)
    for rid, prio in (("batch-1", 5), ("batch-2", 5), ("chat-1", 0), ("mid", 2), ("chat-2", 0)):
        h.admit(make_spec(rid, prompt_len=100, priority=prio))
    order = []
    done = blocker
    for _ in range(5):
        ((rid, _wid),) = dispatched(h.event(prefill_done(done, "p1")))
        order.append(rid)
        done = h.core.requests[rid].spec
    assert order == ["chat-1", "chat-2", "mid", "batch-1", "batch-2"]


def test_queue_position_counts_higher_priority_requests_ahead() -> None:
    h = Harness()
    cluster(h, {"p1": 10}, {"d1": 10_000})
    h.admit(make_spec("running", prompt_len=10))
    h.admit(make_spec("low", prompt_len=10, priority=3))
    reply, _ = h.submit(make_spec("high", prompt_len=10, priority=0))
    assert reply == Admitted(request_id="high", queue_position=1)


# --- session affinity ----------------------------------------------------------------------


def test_session_returns_to_its_prefill_worker_while_it_has_room() -> None:
    h = Harness()
    cluster(h, {"p1": 100, "p2": 100}, {"d1": 10_000})
    assert dispatched(h.admit(make_spec("s1", prompt_len=40, session="chat"))) == [("s1", "p1")]
    assert dispatched(h.admit(make_spec("x", prompt_len=10))) == [("x", "p2")]
    # p2 is less loaded (10 < 40), but the session's prefix is warm on p1.
    assert dispatched(h.admit(make_spec("s2", prompt_len=20, session="chat"))) == [("s2", "p1")]
    # p1 (60) has no room for 50 more: the session moves, and stays where it moved.
    assert dispatched(h.admit(make_spec("s3", prompt_len=50, session="chat"))) == [("s3", "p2")]
    assert dispatched(h.admit(make_spec("y", prompt_len=1))) == [("y", "p1")]
    assert dispatched(h.admit(make_spec("s4", prompt_len=1, session="chat"))) == [("s4", "p2")]


def test_session_binding_expires_after_its_ttl() -> None:
    h = Harness(session_ttl_s=10.0, worker_expiry_s=100.0)
    cluster(h, {"p1": 100, "p2": 100}, {"d1": 10_000})
    h.admit(make_spec("s1", prompt_len=40, session="chat"))
    h.admit(make_spec("x", prompt_len=10))
    assert dispatched(h.admit(make_spec("s2", prompt_len=1, session="chat"))) == [("s2", "p1")]
    h.tick(advance=10.5)
    assert dispatched(h.admit(make_spec("s3", prompt_len=1, session="chat"))) == [("s3", "p2")]


# --- decode ----------------------------------------------------------------------------------


def test_prefill_done_dispatches_decode_to_the_worker_holding_fewest_tokens() -> None:
    h = Harness()
    cluster(h, {"p1": 10_000}, {"d1": 10_000, "d2": 10_000})
    first, second = make_spec("r1", prompt_len=100, max_tokens=50), make_spec("r2", prompt_len=30)
    h.admit(first)
    h.admit(second)
    assert dispatched(h.event(prefill_done(first, "p1")), DecodeTask) == [("r1", "d1")]
    done = prefill_done(second, "p1", first_token=4321, cached=16, prefill_s=0.2)
    actions = h.event(done)
    decode = DecodeTask(spec=second, handle=done.handle, first_token=4321, usage=done.usage, charged_tokens=38)
    assert actions == [Dispatch("d2", decode)]
    assert (h.load("d1"), h.load("d2")) == (150, 30 + second.sampling.max_tokens)
    assert h.load("p1") == 0
    assert h.phase("r2") == "decode"


def test_prefill_done_finished_does_not_decode_and_frees_prefill() -> None:
    h = Harness()
    cluster(h, {"p1": 100}, {"d1": 10_000})
    one, waiting = make_spec("one", prompt_len=100, max_tokens=1), make_spec("w", prompt_len=100)
    h.admit(one)
    h.admit(waiting)
    actions = h.event(prefill_done(one, "p1", finished=True))
    assert dispatches(actions, DecodeTask) == []
    assert dispatched(actions) == [("w", "p1")]
    assert "one" not in h.core.requests and h.load("d1") == 0


def test_request_finished_frees_decode_capacity() -> None:
    h = Harness()
    cluster(h, {"p1": 10_000}, {"d1": 100})
    a, b = make_spec("a", prompt_len=60, max_tokens=20), make_spec("b", prompt_len=60, max_tokens=20)
    h.admit(a)
    h.admit(b)
    assert dispatched(h.event(prefill_done(a, "p1")), DecodeTask) == [("a", "d1")]
    assert h.event(prefill_done(b, "p1")) == []  # 80 + 80 > 100: b waits for room
    assert h.phase("b") == "awaiting_decode"
    assert dispatched(h.event(request_finished(a, "d1")), DecodeTask) == [("b", "d1")]
    assert "a" not in h.core.requests and h.load("d1") == 80


def test_decode_larger_than_the_budget_runs_alone_on_an_idle_decode_worker() -> None:
    h = Harness(decode_overcommit=100.0)  # admission aside: this is about placement
    cluster(h, {"p1": 10_000}, {"d1": 10})
    big, small = make_spec("big", prompt_len=30), make_spec("small", prompt_len=1, max_tokens=1)
    h.admit(big)
    h.admit(small)
    assert dispatched(h.event(prefill_done(big, "p1")), DecodeTask) == [("big", "d1")]
    assert h.event(prefill_done(small, "p1")) == []  # d1 is over budget: nothing joins
    assert dispatched(h.event(request_finished(big, "d1")), DecodeTask) == [("small", "d1")]


# --- worker loss -----------------------------------------------------------------------------


def again(spec: RequestSpec, attempt: int = 1) -> RequestSpec:
    """``spec`` as its ingress submits it again after its worker was lost."""
    return msgspec.structs.replace(spec, attempt=attempt)


def lost(actions: list) -> list[tuple[str, str]]:
    return [(f.request_id, f.error.code) for f in failures(actions)]


def test_silent_prefill_worker_is_removed_and_its_requests_run_elsewhere() -> None:
    h = Harness(worker_expiry_s=2.0)
    cluster(h, {"p1": 1000}, {"d1": 10_000})
    r = make_spec("r", prompt_len=40)
    assert dispatched(h.admit(r)) == [("r", "p1")]
    h.report("p2", "prefill")
    h.clock.advance(1.5)
    h.report("p2", "prefill")
    h.report("d1", "decode", 10_000)
    assert h.tick(advance=0.0) == []  # 1.5 s of silence is within the expiry
    h.clock.advance(1.0)
    h.report("p2", "prefill")
    h.report("d1", "decode", 10_000)
    actions = h.tick()
    assert "p1" not in h.core.workers
    # Whether token 0 reached the client only the ingress knows: it submits r again.
    assert dispatched(actions) == [] and lost(actions) == [("r", "worker_lost")]
    assert "r" not in h.core.requests
    assert dispatched(h.admit(again(r))) == [("r", "p2")]


def test_a_stall_of_the_scheduler_itself_is_no_workers_silence() -> None:
    """A tick after the scheduler read nothing for 1.6 s (its loop stalled; what the workers
    said meanwhile is still in its inbox) expires no worker and fails no stream. The stall is
    credited, never past now: a worker still silent an expiry after it is removed."""
    h = Harness(worker_expiry_s=1.0)
    cluster(h, {"p1": 10_000}, {"d1": 10_000})
    spec = make_spec("r", ingress_id="ing-A")
    h.admit(spec)
    h.event(prefill_done(spec, "p1"))
    assert h.phase("r") == "decode"
    h.clock.advance(1.7)
    actions = h.core.tick(h.clock.now, unheard_s=1.6)
    assert actions == [] and set(h.core.workers) == {"p1", "d1"} and h.phase("r") == "decode"
    h.report("p1", "prefill", 10_000)  # the inbox is read: p1 spoke during the stall, d1 did not
    assert h.tick(advance=0.8) == [] and "d1" in h.core.workers  # 0.9 s since the stall ended
    h.report("p1", "prefill", 10_000)
    assert lost(h.tick(advance=0.2)) == [("r", "worker_lost")]
    assert set(h.core.workers) == {"p1"}


def test_the_service_credits_a_stall_not_a_loop_that_runs_a_little_late(caplog: pytest.LogCaptureFixture) -> None:
    """``SchedulerService._unheard``: a tick 0.3 s late (a busy loop that still reads its
    inbox) credits nothing; 1.5 s late (a stall) credits 1.5 s, moves the unanswered
    dispatches' ack deadlines by as much and says so; with a 1 s expiry, 0.3 s is a stall."""
    from switchyard.scheduler.config import SchedulerServiceConfig
    from switchyard.scheduler.service import SchedulerService, _PendingAck

    service = SchedulerService(SchedulerServiceConfig(tick_s=0.1, core=SchedulerConfig(worker_expiry_s=2.0)))
    service._pending = {"t1": _PendingAck("p1", "r", deadline=10.0)}
    assert service._unheard(0.4) == 0.0 and service._pending["t1"].deadline == 10.0
    assert "stalled" not in caplog.text
    assert service._unheard(1.6) == pytest.approx(1.5)
    assert service._pending["t1"].deadline == pytest.approx(11.5)
    assert "the scheduler's loop stalled 1.5 s" in caplog.text
    quick = SchedulerService(SchedulerServiceConfig(tick_s=0.1, core=SchedulerConfig(worker_expiry_s=1.0)))
    assert quick._unheard(0.4) == pytest.approx(0.3)


def test_without_the_credit_the_same_silence_removes_every_worker() -> None:
    """The same 1.7 s with nothing heard, as a plain tick: every worker is gone, its stream failed."""
    h = Harness(worker_expiry_s=1.0)
    cluster(h, {"p1": 10_000}, {"d1": 10_000})
    spec = make_spec("r", ingress_id="ing-A")
    h.admit(spec)
    h.event(prefill_done(spec, "p1"))
    assert lost(h.tick(advance=1.7)) == [("r", "worker_lost")] and h.core.workers == {}


def test_silent_decode_worker_fails_its_streams_with_worker_lost() -> None:
    h = Harness(worker_expiry_s=2.0)
    cluster(h, {"p1": 10_000}, {"d1": 10_000, "d2": 10_000})
    a = make_spec("a", ingress_id="ing-A")
    b = make_spec("b", ingress_id="ing-B")
    for spec in (a, b):
        h.admit(spec)
        h.event(prefill_done(spec, "p1"))
    assert {h.core.requests["a"].worker_id, h.core.requests["b"].worker_id} == {"d1", "d2"}
    victim = h.core.requests["b"].worker_id
    survivor = ({"d1", "d2"} - {victim}).pop()
    h.clock.advance(3.0)
    h.report("p1", "prefill", 10_000)
    h.report(survivor, "decode", 10_000)
    actions = h.tick()
    assert [(f.ingress_id, f.request_id, f.error.code) for f in failures(actions)] == [("ing-B", "b", "worker_lost")]
    assert dispatches(actions) == []
    assert "b" not in h.core.requests and h.phase("a") == "decode"


def test_worker_leaving_is_removed_at_once() -> None:
    h = Harness()
    cluster(h, {"p1": 1000, "p2": 1000}, {"d1": 10_000})
    r = make_spec("r")
    assert dispatched(h.admit(r)) == [("r", "p1")]
    assert lost(h.event(worker_leaving("p1"))) == [("r", "worker_lost")]
    assert set(h.core.workers) == {"p2", "d1"}


def test_a_request_submitted_again_is_refused_while_no_worker_of_a_role_is_left() -> None:
    """The ingress waits a bounded time for one to come back (``migration_wait_s``)."""
    h = Harness()
    cluster(h, {"p1": 1000}, {"d1": 10_000})
    r = make_spec("r", prompt_len=40)
    h.admit(r)
    assert lost(h.event(worker_leaving("p1"))) == [("r", "worker_lost")]
    refused, _ = h.submit(again(r))
    assert isinstance(refused, Rejected) and refused.reason == "no_workers"
    h.report("p9", "prefill")
    assert dispatched(h.admit(again(r, 2))) == [("r", "p9")]


def test_prefill_requests_fail_once_dispatch_attempts_are_spent() -> None:
    h = Harness(max_dispatch_attempts=2)
    cluster(h, {"p1": 1000}, {"d1": 10_000})
    r = make_spec("r", ingress_id="ing-Z")
    h.admit(r)
    h.report("p2", "prefill")
    assert dispatched(h.dispatch_failed("p1", "r", "no_responders")) == [("r", "p2")]
    h.report("p3", "prefill")
    actions = h.dispatch_failed("p2", "r", "no_responders")
    assert [(f.ingress_id, f.request_id, f.error.code) for f in failures(actions)] == [
        ("ing-Z", "r", "dispatch_failed")
    ]
    assert dispatches(actions) == [] and "r" not in h.core.requests


def test_stale_prefill_done_from_a_lost_worker_is_ignored() -> None:
    h = Harness()
    cluster(h, {"p1": 1000, "p2": 1000}, {"d1": 10_000})
    r = make_spec("r", prompt_len=40)
    h.admit(r)
    assert lost(h.event(worker_leaving("p1"))) == [("r", "worker_lost")]
    assert dispatched(h.admit(again(r))) == [("r", "p2")]
    assert h.event(prefill_done(r, "p1")) == []
    assert h.phase("r") == "prefill" and h.core.requests["r"].worker_id == "p2"
    assert h.load("p2") == 40
    # The live attempt's result still counts, exactly once.
    assert dispatched(h.event(prefill_done(r, "p2")), DecodeTask) == [("r", "d1")]
    assert h.event(prefill_done(r, "p2")) == []
    assert h.load("d1") == 40 + r.sampling.max_tokens


def test_prefill_done_for_an_unknown_request_is_ignored() -> None:
    h = Harness()
    cluster(h, {"p1": 1000}, {"d1": 10_000})
    assert h.event(prefill_done(make_spec("ghost"), "p1")) == []
    assert h.load("p1") == 0


# --- dispatch failures -------------------------------------------------------------------------


def test_a_prefill_no_worker_answers_is_retried_then_fails_after_max_attempts() -> None:
    h = Harness(max_dispatch_attempts=3)
    cluster(h, {"p1": 1000, "p2": 1000, "p3": 1000, "p4": 1000}, {"d1": 10_000})
    r = make_spec("r", ingress_id="ing-Q")
    attempts = dispatched(h.admit(r))
    for _ in range(5):
        actions = h.dispatch_failed(attempts[-1][1], "r", "no_responders")
        if failures(actions):
            break
        assert all(h.load(w) in (0, len(r.prompt_tokens)) for w in h.core.workers if w.startswith("p"))
        attempts += dispatched(actions or h.tick(advance=1.0))
    assert len(attempts) == 3 and len({w for _, w in attempts}) == 3  # each worker that did not answer is gone
    assert [(f.ingress_id, f.request_id, f.error.code) for f in failures(actions)] == [
        ("ing-Q", "r", "dispatch_failed")
    ]
    assert "r" not in h.core.requests


def test_refused_decode_is_retried_with_the_same_handle() -> None:
    h = Harness()
    cluster(h, {"p1": 1000}, {"d1": 10_000, "d2": 20_000})
    r = make_spec("r")
    h.admit(r)
    done = prefill_done(r, "p1", first_token=999)
    assert dispatched(h.event(done), DecodeTask) == [("r", "d1")]
    actions = h.dispatch_failed("d1", "r")
    retried = dispatches(actions or h.tick(advance=1.0), DecodeTask)
    assert len(retried) == 1
    assert retried[0].task == DecodeTask(
        spec=r, handle=done.handle, first_token=999, usage=done.usage, charged_tokens=32 + 8
    )


def test_dispatch_failure_of_a_replaced_attempt_is_ignored() -> None:
    h = Harness()
    cluster(h, {"p1": 1000, "p2": 1000}, {"d1": 10_000})
    r = make_spec("r", prompt_len=40)
    h.admit(r)
    h.event(worker_leaving("p1"))
    h.admit(again(r))
    assert h.dispatch_failed("p1", "r") == []
    assert h.core.requests["r"].worker_id == "p2" and h.load("p2") == 40


def test_unreachable_worker_is_removed_and_its_prefill_runs_elsewhere() -> None:
    h = Harness()
    cluster(h, {"p1": 1000, "p2": 1000}, {"d1": 10_000})
    r = make_spec("r")
    h.admit(r)
    assert lost(h.dispatch_failed("p1", "r", "timeout")) == [("r", "worker_lost")]  # it may have run
    assert "p1" not in h.core.workers
    assert dispatched(h.admit(again(r))) == [("r", "p2")]


def test_prefill_failed_fails_the_stream_and_frees_the_worker() -> None:
    h = Harness()
    cluster(h, {"p1": 100}, {"d1": 10_000})
    r = make_spec("r", prompt_len=100, ingress_id="ing-F")
    h.admit(r)
    actions = h.event(prefill_failed(r, "p1", "oom"))
    (fail,) = failures(actions)
    assert (fail.ingress_id, fail.request_id, fail.error.code) == ("ing-F", "r", "prefill_failed")
    assert "oom" in fail.error.message
    assert "r" not in h.core.requests


def test_prefill_failed_dispatches_the_queued_head_at_once() -> None:
    h = Harness()
    cluster(h, {"p1": 100}, {"d1": 10_000})
    r, waiting = make_spec("r", prompt_len=100), make_spec("w", prompt_len=100)
    h.admit(r)
    h.admit(waiting)
    assert dispatched(h.event(prefill_failed(r, "p1"))) == [("w", "p1")]


def test_requests_submitted_again_after_a_worker_loss_go_first_in_their_order() -> None:
    h = Harness(max_queued_tokens=50)
    cluster(h, {"p1": 1000}, {"d1": 10_000})
    older, newer = make_spec("older", prompt_len=30), make_spec("newer", prompt_len=30)
    h.admit(older)
    h.admit(newer)
    assert lost(h.event(worker_leaving("p1"))) == [("older", "worker_lost"), ("newer", "worker_lost")]
    h.report("p2", "prefill", budget=40)  # room for one of them at a time
    h.admit(make_spec("waiting", prompt_len=30))  # queued behind what p2 runs
    assert h.phase("waiting") == "prefill"
    h.admit(make_spec("queued", prompt_len=30))
    assert h.phase("queued") == "queued"
    # Over max_queued_tokens, yet admitted: they were admitted once. Ahead of "queued".
    h.admit(again(older))
    h.admit(again(newer))
    assert [rid for rid in h.core._queue.request_ids()] == ["older", "newer", "queued"]


# --- cancel ------------------------------------------------------------------------------------


def test_cancel_removes_a_queued_request() -> None:
    h = Harness()
    cluster(h, {"p1": 100}, {"d1": 10_000})
    h.admit(make_spec("running", prompt_len=100))
    h.admit(make_spec("queued", prompt_len=70))
    assert h.core.status().queued_tokens == 70
    assert h.cancel("queued") == []
    assert "queued" not in h.core.requests
    assert h.core.status().queued_requests == 0 and h.core.status().queued_tokens == 0


def test_cancel_frees_a_placed_request_and_lets_the_queue_move() -> None:
    h = Harness()
    cluster(h, {"p1": 100}, {"d1": 10_000})
    h.admit(make_spec("running", prompt_len=100))
    h.admit(make_spec("queued", prompt_len=70))
    assert dispatched(h.cancel("running")) == [("queued", "p1")]
    assert h.load("p1") == 70


def test_cancel_in_decode_and_awaiting_decode() -> None:
    h = Harness()
    cluster(h, {"p1": 10_000}, {"d1": 100})
    a, b = make_spec("a", prompt_len=60, max_tokens=20), make_spec("b", prompt_len=60, max_tokens=20)
    for spec in (a, b):
        h.admit(spec)
        h.event(prefill_done(spec, "p1"))
    assert (h.phase("a"), h.phase("b")) == ("decode", "awaiting_decode")
    assert h.cancel("b") == []
    assert dispatched(h.cancel("a"), DecodeTask) == []
    assert h.core.requests == {} and h.load("d1") == 0


def test_cancel_of_an_unknown_request_is_harmless() -> None:
    h = Harness()
    cluster(h, {"p1": 100}, {"d1": 10_000})
    assert h.cancel("nobody") == []


def test_status_reports_workers_and_queue() -> None:
    h = Harness()
    cluster(h, {"p1": 100}, {"d1": 10_000})
    h.admit(make_spec("r1", prompt_len=100))
    h.admit(make_spec("r2", prompt_len=30))
    status = h.core.status()
    assert [(w.worker_id, w.role, w.inflight_tokens, w.running) for w in status.workers] == [
        ("d1", "decode", 0, 0),
        ("p1", "prefill", 100, 1),
    ]
    assert (status.queued_requests, status.queued_tokens) == (1, 30)


# --- seeded property test ------------------------------------------------------------------------


class RandomCluster:
    """Random submits, results, refusals, cancels, ticks and worker deaths against the core.

    The model keeps what each worker is really running (tasks it accepted) and the one
    outcome of every admitted request: completed, cancelled or failed. Dead workers stop
    answering and reporting, but may still deliver late results.
    """

    def __init__(self, seed: int) -> None:
        self.seed = seed
        self.rng = random.Random(seed)
        self.h = Harness(max_queued_tokens=600, worker_expiry_s=2.0, max_dispatch_attempts=2, session_ttl_s=5.0)
        self.budgets: dict[str, int] = {}
        self.live: dict[str, str] = {}  # worker_id -> role
        self.dead: set[str] = set()
        self.running: dict[str, dict[str, PrefillTask | DecodeTask]] = {}
        self.admitted: dict[str, RequestSpec] = {}
        self.outcome: dict[str, str] = {}
        self.refuse_p = 0.08
        self.made = 0
        self.history: list[str] = []

    # --- the harness around one input ---------------------------------------------------------

    def apply(self, op: str, rid: str | None, call) -> None:
        self.history.append(f"{op} {rid or ''}".strip())
        self.process(call(), op, rid)
        self.check()

    def process(self, actions: list, op: str, rid: str | None) -> None:
        pending = deque(actions)
        while pending:
            action = pending.popleft()
            if isinstance(action, FailStream):
                self.fail(action)
            elif isinstance(action, Dispatch):
                pending.extend(self.deliver(action))
            else:  # BindSession, RequestSnapshot: bookkeeping for the service, nothing to simulate
                assert isinstance(action, (BindSession, RequestSnapshot)), action
        for gone in [r for r in self.admitted if r not in self.outcome and r not in self.h.core.requests]:
            if op == "cancel" and gone == rid:
                self.outcome[gone] = "cancelled"
            elif op in ("prefill_done", "finished") and gone == rid:
                self.outcome[gone] = "completed"
            else:
                raise AssertionError(f"{gone} vanished on {op} {rid} without an outcome")

    def fail(self, action: FailStream) -> None:
        rid = action.request_id
        assert rid in self.admitted, f"FailStream for {rid}, never admitted"
        assert rid not in self.outcome, f"FailStream for {rid}, already {self.outcome[rid]}"
        assert rid not in self.h.core.requests, f"{rid} failed but still tracked"
        assert action.ingress_id == self.admitted[rid].ingress_id
        self.outcome[rid] = "failed"

    def deliver(self, action: Dispatch) -> list:
        rid, wid = action.task.spec.request_id, action.worker_id
        assert rid not in self.outcome, f"dispatch of {rid}, already {self.outcome.get(rid)}"
        if wid not in self.live:  # no responders
            return self.h.dispatch_failed(wid, rid, self.rng.choice(["timeout", "no_responders"]))
        assert self.h.core.requests[rid].worker_id == wid, f"stale dispatch of {rid} to {wid}"
        if self.rng.random() < self.refuse_p:
            return self.h.dispatch_failed(wid, rid, "refused")
        tasks = self.running.setdefault(wid, {})
        assert rid not in tasks, f"{rid} dispatched twice to {wid}"
        tasks[rid] = action.task
        return []

    def check(self) -> None:
        for rid, tracked in self.h.core.requests.items():
            assert rid in self.admitted and rid not in self.outcome, rid
            if tracked.phase in ("prefill", "decode"):
                task = self.running.get(tracked.worker_id, {}).get(rid)
                kind = PrefillTask if tracked.phase == "prefill" else DecodeTask
                assert isinstance(task, kind), f"{rid} placed on {tracked.worker_id}, not running there"
        for wid in self.live:
            for rid in self.running.get(wid, {}):
                assert rid not in self.outcome, f"live {wid} still runs {rid} ({self.outcome[rid]})"

    # --- random inputs ----------------------------------------------------------------------

    def step(self) -> None:
        ops = [
            (self.submit, 25),
            (self.add_worker, 4 if len(self.live) < 6 else 1),
            (self.heartbeat, 10),
            (self.complete_prefill, 15),
            (self.fail_prefill, 2),
            (self.finish_decode, 15),
            (self.cancel, 5),
            (self.kill, 2),
            (self.leave, 1),
            (self.late_result, 3),
            (self.tick, 8),
        ]
        op = self.rng.choices([o for o, _ in ops], weights=[w for _, w in ops])[0]
        op()

    def submit(self) -> None:
        self.made += 1
        rng = self.rng
        spec = make_spec(
            f"r{self.made}",
            prompt_len=rng.randint(1, 150),
            max_tokens=rng.randint(1, 30),
            priority=rng.choice([0, 0, 1, 2]),
            session=rng.choice([None, None, "s1", "s2"]),
            ingress_id=rng.choice(["ing-1", "ing-2"]),
        )
        self.history.append(f"submit {spec.request_id} ({len(spec.prompt_tokens)} tokens)")
        reply, actions = self.h.submit(spec)
        if isinstance(reply, Admitted):
            self.admitted[spec.request_id] = spec
            self.process(actions, "submit", spec.request_id)
        else:
            assert actions == [] and spec.request_id not in self.h.core.requests
            roles = {w.role for w in self.h.core.workers.values()}
            assert (reply.reason == "no_workers") == (roles != {"prefill", "decode"}), reply
            assert reply.retry_after_s >= 1
        self.check()

    def add_worker(self, role: str | None = None, budget: int | None = None) -> str:
        self.made += 1
        role = role or self.rng.choice(["prefill", "decode"])
        wid = f"{role[0]}{self.made}"
        self.live[wid] = role
        self.budgets[wid] = budget or self.rng.randint(50, 400 if role == "prefill" else 600)
        self.apply("report", wid, lambda: self.h.report(wid, role, self.budgets[wid]))
        return wid

    def heartbeat(self, advance: float | None = None) -> None:
        self.h.clock.advance(self.rng.uniform(0, 0.4) if advance is None else advance)
        for wid, role in list(self.live.items()):
            self.apply("report", wid, lambda wid=wid, role=role: self.h.report(wid, role, self.budgets[wid]))

    def _pick(self, kind: type, workers) -> tuple[str, str, Any] | None:
        found = [(w, r, t) for w in sorted(workers) for r, t in self.running.get(w, {}).items() if isinstance(t, kind)]
        return self.rng.choice(found) if found else None

    def _result(self, wid: str, rid: str, task: Any, fail: bool = False) -> None:
        del self.running[wid][rid]
        if isinstance(task, DecodeTask):
            self.apply("finished", rid, lambda: self.h.event(request_finished(task.spec, wid)))
        elif fail:
            self.apply("prefill_failed", rid, lambda: self.h.event(prefill_failed(task.spec, wid)))
        else:
            done = prefill_done(task.spec, wid, finished=task.spec.sampling.max_tokens <= 1)
            self.apply("prefill_done", rid, lambda: self.h.event(done))

    def complete_prefill(self) -> None:
        if picked := self._pick(PrefillTask, self.live):
            self._result(*picked)

    def fail_prefill(self) -> None:
        if picked := self._pick(PrefillTask, self.live):
            self._result(*picked, fail=True)

    def finish_decode(self) -> None:
        if picked := self._pick(DecodeTask, self.live):
            self._result(*picked)

    def late_result(self) -> None:
        if picked := self._pick(PrefillTask | DecodeTask, self.dead):
            self._result(*picked)

    def cancel(self) -> None:
        rid = self.rng.choice([*self.admitted, "unknown"]) if self.admitted else "unknown"
        for tasks in self.running.values():  # every worker hears the cancel too
            tasks.pop(rid, None)
        self.apply("cancel", rid, lambda: self.h.cancel(rid))

    def kill(self) -> None:
        if self.live:
            wid = self.rng.choice(sorted(self.live))
            self.history.append(f"kill {wid}")
            del self.live[wid]
            self.dead.add(wid)

    def leave(self) -> None:
        if self.live:
            wid = self.rng.choice(sorted(self.live))
            del self.live[wid]
            self.dead.add(wid)
            self.apply("leaving", wid, lambda: self.h.event(worker_leaving(wid)))

    def tick(self, advance: float | None = None) -> None:
        self.h.clock.advance(self.rng.uniform(0, 2.5) if advance is None else advance)
        self.heartbeat(advance=0.0)  # the living stay alive; only the dead expire
        self.apply("tick", None, lambda: self.h.tick())

    # --- the end: a healthy fleet works everything off ------------------------------------------

    def settle(self) -> None:
        self.refuse_p = 0.0
        self.add_worker("prefill", 500)
        self.add_worker("decode", 500)
        for _ in range(1000):
            self.tick(advance=2.5)
            busy = [(w, r, t) for w in sorted(self.live) for r, t in list(self.running.get(w, {}).items())]
            if not busy and not self.h.core.requests:
                return
            for wid, rid, task in busy:
                if rid in self.running.get(wid, {}):
                    self._result(wid, rid, task)
        raise AssertionError(f"never settled: {sorted(self.h.core.requests)} still tracked")


SEEDS = [int(os.environ["SWITCHYARD_SEED"])] if "SWITCHYARD_SEED" in os.environ else list(range(40))


@pytest.mark.parametrize("seed", SEEDS)
def test_random_traces_keep_invariants_and_end_every_request_once(seed: int) -> None:
    print(f"seed={seed} (rerun one with SWITCHYARD_SEED={seed})")
    sim = RandomCluster(seed)
    try:
        for _ in range(300):
            sim.step()
        sim.settle()
        assert set(sim.outcome) == set(sim.admitted)
    except AssertionError:
        print("last steps:", *sim.history[-25:], sep="\n  ")
        raise
    outcomes = sorted(sim.outcome.values())
    print({k: outcomes.count(k) for k in set(outcomes)})


def test_random_traces_exercise_every_outcome() -> None:
    # Guards the property test against a generator that never reaches the hard paths.
    seen: set[str] = set()
    for seed in range(10):
        sim = RandomCluster(seed)
        for _ in range(300):
            sim.step()
        sim.settle()
        seen |= set(sim.outcome.values())
    assert seen == {"completed", "cancelled", "failed"}


def test_a_worker_restarted_under_the_same_id_loses_what_was_placed_on_it() -> None:
    h = Harness()
    cluster(h, {"p1": 10_000}, {"d1": 10_000})
    spec = make_spec("r")
    h.admit(spec)
    h.event(prefill_done(spec, "p1"))
    assert h.phase("r") == "decode"
    actions = h.report("d1", "decode", 10_000, seq=1)  # its counter started again
    assert [(f.request_id, f.error.code) for f in failures(actions)] == [("r", "worker_lost")]
    assert "d1" in h.core.workers and h.load("d1") == 0


def test_no_responders_for_decode_retries_it_elsewhere() -> None:
    h = Harness()
    cluster(h, {"p1": 10_000}, {"d1": 10_000})
    spec = make_spec("r")
    h.admit(spec)
    first = dispatched(h.event(prefill_done(spec, "p1")), DecodeTask)
    assert first == [("r", "d1")]
    h.report("d2", "decode", 10_000)
    actions = h.dispatch_failed("d1", "r", "no_responders")
    assert dispatched(actions, DecodeTask) == [("r", "d2")] and failures(actions) == []
    assert "d1" not in h.core.workers


def test_a_refused_dispatch_is_retried_after_a_pause_that_doubles_up_to_2_s() -> None:
    """Retried at once, a refused task went straight back to the worker that refused it
    (still the best pick), and three refusals within milliseconds failed the request."""
    h = Harness(max_dispatch_attempts=4, worker_expiry_s=60)
    cluster(h, {"p1": 10_000, "p2": 10_000}, {"d1": 10_000})
    spec = make_spec("r")
    ((_, first),) = dispatched(h.admit(spec))
    for pause in (0.1, 0.2, 0.4, 0.8, 1.6, 2.0, 2.0):
        assert h.dispatch_failed(first, "r", "refused") == []
        status = h.core.status()
        assert h.phase("r") == "paused" and (status.queued_requests, status.paused_requests) == (0, 1)
        assert dispatched(h.tick(advance=pause - 0.01)) == []
        ((rid, first),) = dispatched(h.tick(advance=0.02))
        assert rid == "r" and h.phase("r") == "prefill" and h.core.status().paused_requests == 0


def test_refusals_spend_no_dispatch_and_fail_a_request_only_after_refused_retry_s() -> None:
    """One worker a role, full for a while (its ledger behind): the request waits it out. Before,
    its third dispatch refused failed it, 0.3 s after the first (``max_dispatch_attempts``)."""
    h = Harness(max_dispatch_attempts=2, refused_retry_s=8.0, worker_expiry_s=60)
    cluster(h, {"p1": 10_000}, {"d1": 10_000})
    spec = make_spec("r")
    h.admit(spec)
    for pause in (0.1, 0.2, 0.4, 0.8, 1.6, 2.0, 2.0):  # refused for 7.17 s in all
        assert h.dispatch_failed("p1", "r", "refused") == []
        assert dispatched(h.tick(advance=pause + 0.01)) == [("r", "p1")]
    actions = h.dispatch_failed("p1", "r", "refused")  # 7.17 s + a 2 s pause: past 8 s
    (failure,) = failures(actions)
    assert failure.error.code == "dispatch_failed" and "refused it for 7.2 s" in failure.error.message
    assert "r" not in h.core.requests
    # A new stage, a new window: refused through its prefill for 5 s, then through its decode for
    # 6 s more (its pauses 2 s now: they double with every refusal of the request).
    h = Harness(max_dispatch_attempts=2, refused_retry_s=8.0, worker_expiry_s=60)
    cluster(h, {"p1": 10_000}, {"d1": 10_000})
    h.admit(spec)
    for pause in (0.1, 0.2, 0.4, 0.8, 1.6, 2.0):
        h.dispatch_failed("p1", "r", "refused")
        h.tick(advance=pause + 0.01)
    assert dispatched(h.event(prefill_done(spec, "p1")), DecodeTask) == [("r", "d1")]
    for _ in range(3):
        assert h.dispatch_failed("d1", "r", "refused") == [] and h.phase("r") == "paused"
        assert dispatched(h.tick(advance=2.01), DecodeTask) == [("r", "d1")]
    # ...and a refusal spent no dispatch: the worker lost now, it is retried (one dispatch left).
    h.report("d2", "decode", 10_000)
    assert dispatched(h.dispatch_failed("d1", "r", "no_responders"), DecodeTask) == [("r", "d2")]


def test_a_refused_request_goes_to_a_worker_that_has_not_refused_it_while_one_can_take_it() -> None:
    h = Harness(max_dispatch_attempts=5)
    cluster(h, {"p1": 10_000, "p2": 10_000}, {"d1": 10_000, "d2": 10_000})
    r = make_spec("r")
    ((_, first),) = dispatched(h.admit(r))
    h.dispatch_failed(first, "r", "refused")
    ((_, second),) = dispatched(h.tick(advance=0.2))
    assert second != first  # the ledger still ranks both alike: the refusal decides
    h.dispatch_failed(second, "r", "refused")
    ((_, third),) = dispatched(h.tick(advance=0.4))  # both refused: the policy's own pick again
    assert third in (first, second)
    done = prefill_done(r, third)
    ((_, d_first),) = dispatched(h.event(done), DecodeTask)
    # (its fourth refusal: a pause of 0.8 s)
    h.dispatch_failed(d_first, "r", "refused")
    ((_, d_second),) = dispatched(h.tick(advance=1.0), DecodeTask)
    assert {d_first, d_second} == {"d1", "d2"}


def test_a_paused_request_cancelled_is_gone_and_a_decode_pauses_too() -> None:
    h = Harness()
    cluster(h, {"p1": 1000}, {"d1": 10_000})
    h.admit(make_spec("a"))
    h.dispatch_failed("p1", "a", "refused")
    assert h.phase("a") == "paused"
    h.cancel("a")
    assert "a" not in h.core.requests and dispatched(h.tick(advance=1.0)) == []
    b = make_spec("b")
    h.admit(b)
    assert dispatched(h.event(prefill_done(b, "p1")), DecodeTask) == [("b", "d1")]
    assert h.dispatch_failed("d1", "b", "refused") == [] and h.phase("b") == "paused"
    assert dispatched(h.tick(advance=0.2), DecodeTask) == [("b", "d1")]


def test_a_joining_worker_is_asked_for_its_kv_snapshot_once() -> None:
    h = Harness()
    h.report("p1", "prefill")
    h.report("p1", "prefill")
    assert h.snapshots_asked == ["p1"]


# --- lost messages: cancels of one run, audits ---------------------------------------------------


def test_a_cancel_of_an_earlier_run_leaves_the_next_one_alone() -> None:
    h = Harness()
    cluster(h, {"p1": 1000}, {"d1": 10_000})
    r = again(make_spec("r"), 2)
    assert dispatched(h.admit(r)) == [("r", "p1")]
    h.core.on_cancel("r", h.clock.now, attempt=1)
    assert h.phase("r") == "prefill"
    h.core.on_cancel("r", h.clock.now, attempt=2)
    assert "r" not in h.core.requests and h.load("p1") == 0


def test_a_request_its_worker_no_longer_holds_is_reclaimed_and_handed_to_its_ingress() -> None:
    h = Harness()
    cluster(h, {"p1": 1000}, {"d1": 10_000})
    r, s = make_spec("r", ingress_id="ing-A"), make_spec("s")
    h.admit(r)
    h.admit(s)
    h.event(prefill_done(s, "p1"))  # s moved on to decode meanwhile: the audit's view is stale
    assert h.core.placed() == {"r": "p1", "s": "d1"}
    actions = h.core.reclaim("r", "p1", h.clock.now)
    assert [(f.ingress_id, f.request_id, f.error.code) for f in failures(actions)] == [("ing-A", "r", "worker_lost")]
    assert h.core.reclaim("s", "p1", h.clock.now) == []  # not on p1 any more: left alone
    assert "r" not in h.core.requests and h.load("p1") == 0 and h.core.status().reclaimed_requests == 1
    h.check()


def test_a_newer_run_of_a_request_replaces_the_one_held() -> None:
    """A worker taken for dead was alive: a roll call brought its run back before the
    ingress's cancel of it arrived. The ingress's next attempt wins; a repeat does not."""
    h = Harness()
    cluster(h, {"p1": 1000, "p2": 1000}, {"d1": 10_000})
    r = make_spec("r")
    assert dispatched(h.admit(r)) == [("r", "p1")]
    refused, _ = h.submit(r)
    assert isinstance(refused, Rejected) and refused.reason == "invalid"
    h.admit(again(r))
    assert h.core.requests["r"].spec.attempt == 1 and h.load("p1") + h.load("p2") == len(r.prompt_tokens)


def test_stranded_sessions_and_handoffs_are_bounded_and_counted() -> None:
    h = Harness(worker_expiry_s=2.0, decode_overcommit=100.0)
    cluster(h, {"p1": 1000}, {"d1": 10})  # decode too small for r: it waits after prefill
    # A binding restored from the bucket names a worker that never comes back.
    h.core.restore_session(Binding("default", "ghost-session", "p-gone", h.clock.now + 600), h.clock.now)
    busy, r = make_spec("busy"), make_spec("r", session="s1")
    h.admit(busy)
    h.event(prefill_done(busy, "p1"))  # an idle decode worker takes any request: now it is full
    h.admit(r)
    h.event(prefill_done(r, "p1"))
    assert h.phase("busy") == "decode" and h.phase("r") == "awaiting_decode"
    h.cancel("r")  # its client left before decode took the KV: the handoff is abandoned
    h.tick()
    h.clock.advance(1.0)
    h.report("p1", "prefill")
    h.report("d1", "decode", 10)
    h.tick()
    status = h.core.status()
    assert status.session_bindings == 2 and status.abandoned_handoffs == 1  # not yet past expiry
    h.clock.advance(1.5)
    h.report("p1", "prefill")
    h.report("d1", "decode", 10)
    h.tick()
    status = h.core.status()
    assert (status.session_bindings, status.sessions_dropped) == (1, 1)  # the owner check
    h.event(worker_leaving("p1"))
    assert (h.core.status().session_bindings, h.core.status().sessions_dropped) == (0, 2)


# --- the region's summary (federation) ------------------------------------------------------


def test_a_region_summary_says_when_a_new_request_would_start_not_when_all_work_is_done() -> None:
    h = Harness(default_prefill_tokens_per_s=1000.0, spill_wait_s=0.5, max_queued_tokens=10_000)
    for worker in ("p-0", "p-1"):
        h.report(worker, "prefill", budget=1000)
    h.report("d-0", "decode", budget=100_000)
    idle = h.core.region_summary("eu", "s-1", 1, 0.0)
    assert (idle.predicted_wait_s, idle.saturated, idle.prefill_workers, idle.decode_workers) == (0.0, False, 2, 1)
    assert idle.prefill_tokens_per_s == 2000.0 and idle.spill_wait_s == 0.5
    h.admit(make_spec(prompt_len=800))  # one worker busy for 0.8 s, the other idle
    half = h.core.region_summary("eu", "s-1", 2, 0.0)
    assert half.inflight_tokens == 800 and half.predicted_wait_s == 0.0 and not half.saturated
    assert h.core.predicted_wait_s() == pytest.approx(0.4)  # the fleet's backlog: not when the next starts
    h.admit(make_spec(prompt_len=900))  # both busy: the next starts when p-0 frees up
    both = h.core.region_summary("eu", "s-1", 3, 0.0)
    assert both.predicted_wait_s == pytest.approx(0.8) and both.saturated
    h.admit(make_spec(prompt_len=1000))  # queued: it drains at the fleet's rate first
    queued = h.core.region_summary("eu", "s-1", 4, 0.0)
    assert queued.queued_requests == 1 and queued.predicted_wait_s == pytest.approx(1000 / 2000 + 0.8)


def test_a_region_without_prefill_workers_is_saturated() -> None:
    h = Harness()
    h.report("d-0", "decode", budget=1000)
    assert h.core.region_summary("us", "s-1", 1, 0.0).saturated
