"""Scheduler failover, pure parts: the lease's state machine on a fake clock, and a core
that takes over rebuilding the very ledger the one before it kept, from what the
workers' ``HeldLedger`` reports."""

from __future__ import annotations

import msgspec
import pytest

from switchyard.scheduler import Dispatch, FailStream, SchedulerConfig, SchedulerCore
from switchyard.scheduler.lease import LeaseState
from switchyard.scheduler.standby import Shadowed, SubmitShadow, settlement
from switchyard.schemas import Admitted, Cancel, DecodeTask, KvSnapshot, LoadReport, PrefillTask, Rejected
from switchyard.schemas.codec import Codec
from switchyard.workers.runtime import HeldLedger
from tests.support.factories import FakeClock, load_report, make_spec, prefill_done, request_finished

# --- the lease -------------------------------------------------------------------------


def test_a_standby_becomes_active_when_its_create_is_stored():
    lease, clock = LeaseState(ttl_s=1.0, renew_s=0.25), FakeClock()
    assert lease.due(clock.now) and not lease.held(clock.now)
    lease.refused(clock.now)  # someone else holds it
    assert not lease.held(clock.now) and not lease.due(clock.now)
    clock.advance(0.25)
    assert lease.due(clock.now)
    lease.written(revision=7, sent_at=clock.now)
    assert lease.held(clock.now) and lease.revision == 7 and lease.phase == "active"


def test_the_holder_expires_its_lease_from_when_it_sent_the_write():
    lease, clock = LeaseState(ttl_s=1.0, renew_s=0.25), FakeClock()
    sent = clock.now
    clock.advance(0.3)  # the answer took its time: the server stored it later than we sent it
    lease.written(revision=1, sent_at=sent)
    clock.advance(0.69)
    assert lease.held(clock.now)
    clock.advance(0.02)  # 1.01 s after sending: the server's TTL cannot have run out yet, ours has
    assert not lease.held(clock.now) and lease.phase == "lapsed"


def test_renewals_keep_it_and_failed_ones_let_it_lapse():
    lease, clock = LeaseState(ttl_s=1.0, renew_s=0.25), FakeClock()
    lease.written(revision=1, sent_at=clock.now)
    for revision in range(2, 10):
        clock.advance(0.25)
        assert lease.due(clock.now)
        lease.written(revision=revision, sent_at=clock.now)
        assert lease.held(clock.now)
    for _ in range(3):  # NATS does not answer: still ours for a while
        clock.advance(0.25)
        lease.failed(clock.now)
        assert lease.held(clock.now)
    clock.advance(0.25)
    lease.failed(clock.now)
    assert not lease.held(clock.now) and lease.phase == "lapsed" and lease.creating
    # NATS is back and nobody took the key: created again, the same holder carries on.
    clock.advance(0.25)
    lease.written(revision=1, sent_at=clock.now)
    assert lease.held(clock.now) and not lease.creating


def test_a_lapsed_lease_someone_else_took_is_lost_for_good():
    lease, clock = LeaseState(ttl_s=1.0, renew_s=0.25), FakeClock()
    lease.written(revision=1, sent_at=clock.now)
    clock.advance(1.0)
    assert not lease.held(clock.now) and lease.phase == "lapsed"
    lease.refused(clock.now)  # the create found another replica's key
    assert lease.phase == "lost" and not lease.due(clock.now + 10)
    lease.written(revision=99, sent_at=clock.now)
    assert not lease.held(clock.now)


def test_a_holder_whose_key_vanished_creates_it_again_at_once():
    lease, clock = LeaseState(ttl_s=1.0, renew_s=0.25), FakeClock()
    lease.written(revision=5, sent_at=clock.now)
    clock.advance(0.25)
    lease.vanished(clock.now)  # a restarted server lost the bucket: the renewal found no key
    assert lease.phase == "lapsed" and lease.creating and lease.due(clock.now)
    lease.written(revision=1, sent_at=clock.now)
    assert lease.held(clock.now)


def test_a_refused_renewal_ends_the_lease_at_once():
    lease, clock = LeaseState(ttl_s=1.0, renew_s=0.25), FakeClock()
    lease.written(revision=1, sent_at=clock.now)
    clock.advance(0.25)
    lease.refused(clock.now)  # the key has another revision: someone else took it
    assert not lease.held(clock.now) and lease.phase == "lost"


def test_a_lease_renewed_no_more_often_than_it_lasts_is_refused():
    with pytest.raises(ValueError, match="renewed"):
        LeaseState(ttl_s=1.0, renew_s=1.0)


# --- the ledger a new scheduler rebuilds ------------------------------------------------


def _core(clock: FakeClock) -> SchedulerCore:
    core = SchedulerCore(SchedulerConfig(worker_expiry_s=60))
    for seq, (worker, role, budget) in enumerate((("p0", "prefill", 100), ("d0", "decode", 10_000)), start=1):
        core.on_event(load_report(worker, role, budget=budget, seq=seq), clock.now)  # type: ignore[arg-type]
    return core


def _roll_call(core: SchedulerCore, clock: FakeClock, ledgers: dict[str, HeldLedger], seq: int) -> list:
    actions = []
    for worker, role, budget in (("p0", "prefill", 100), ("d0", "decode", 10_000)):
        report = load_report(worker, role, budget=budget, seq=seq)  # type: ignore[arg-type]
        held = ledgers[worker].roll_call("sched-new")
        actions += core.on_event(msgspec.structs.replace(report, held=held), clock.now)
    return actions


def test_a_core_taking_over_counts_what_the_one_before_counted():
    clock = FakeClock()
    old = _core(clock)
    ledgers = {"p0": HeldLedger(), "d0": HeldLedger()}
    # Prefix-cached on p0: the old core charges p0 the uncached tokens only, not the prompt.
    cached = make_spec("cached", prompt_len=64)
    old.index.load_snapshot(KvSnapshot(worker_id="p0", seq=0, blocks={"device": cached.block_keys[:3]}))
    specs = [cached, make_spec("decoding", prompt_len=40), make_spec("b", prompt_len=60), make_spec("q", prompt_len=90)]
    dispatched: dict[str, PrefillTask | DecodeTask] = {}
    for spec in specs:
        reply, actions = old.submit(spec, clock.now)
        assert isinstance(reply, Admitted)
        for action in actions:
            if isinstance(action, Dispatch):
                ledgers[action.worker_id].accepted(action.task)
                dispatched[action.task.spec.request_id] = action.task  # type: ignore[assignment]
    # "decoding" goes on to decode; its prefill worker is done with it.
    done = ledgers["p0"].sent(prefill_done(specs[1], "p0"))
    for action in old.on_event(done, clock.now):
        if isinstance(action, Dispatch):
            ledgers[action.worker_id].accepted(action.task)
    assert dispatched["cached"].charged_tokens == 64 - 3 * 16  # the uncached part
    before = old.ledger()
    assert before["p0"]["cached"] == 16 and before["d0"]["decoding"] == 40 + 8
    assert "q" in old.requests and "q" not in before.get("p0", {})  # over p0's budget: queued

    new = _core(clock)
    assert not [a for a in _roll_call(new, clock, ledgers, seq=2) if isinstance(a, Dispatch)]  # nothing placed again
    assert new.ledger() == before
    new.check_invariants()
    # The adopted prefill finishes: the worker sends the prompt along, and decode is placed.
    finished = ledgers["p0"].sent(prefill_done(specs[0], "p0"))
    assert finished.spec == specs[0]  # type: ignore[union-attr]
    actions = new.on_event(finished, clock.now)
    decodes = [a for a in actions if isinstance(a, Dispatch)]
    assert [d.task.spec for d in decodes] == [specs[0]] and isinstance(decodes[0].task, DecodeTask)
    new.check_invariants()
    new.on_event(request_finished(specs[1], "d0"), clock.now)
    assert "decoding" not in new.requests
    new.check_invariants()


def test_an_adopted_prefill_whose_prompt_never_comes_fails_cleanly():
    clock = FakeClock()
    new = _core(clock)
    ledger = HeldLedger()
    spec = make_spec("orphan", prompt_len=40)
    ledger.accepted(PrefillTask(spec=spec, queued_s=0.0, charged_tokens=40))
    report: LoadReport = load_report("p0", "prefill", budget=100, seq=2)
    new.on_event(msgspec.structs.replace(report, held=ledger.roll_call("sched-new")), clock.now)
    assert new.ledger() == {"p0": {"orphan": 40}}
    actions = new.on_event(prefill_done(spec, "p0"), clock.now)  # no spec: an old worker
    assert [type(a) for a in actions] == [FailStream]
    assert actions[0].error.code == "scheduler_failover" and not new.requests
    new.check_invariants()


def test_an_adopted_prefill_teaches_no_rate_and_starts_the_workers_next_stretch():
    """A scheduler that took over does not know when a prefill it adopted began: it learns
    no rate from it (counted from the clock's zero, it read as days of work)."""
    clock = FakeClock()
    clock.advance(50_000.0)
    new = _core(clock)
    rate = new.workers["p0"].prefill_rate
    ledger = HeldLedger()
    spec = make_spec("adopted", prompt_len=4_000)
    ledger.accepted(PrefillTask(spec=spec, queued_s=0.0, charged_tokens=4_000))
    report: LoadReport = load_report("p0", "prefill", budget=100_000, seq=2)
    new.on_event(msgspec.structs.replace(report, held=ledger.roll_call("sched-new")), clock.now)
    clock.advance(0.5)
    new.on_event(msgspec.structs.replace(prefill_done(spec, "p0"), spec=spec), clock.now)
    assert new.workers["p0"].prefill_rate == rate and new.workers["p0"].rate_busy_s == 0.0
    assert new.workers["p0"].prefill_mark == clock.now
    new.check_invariants()


# --- what a standby keeps ----------------------------------------------------------------


def _kept(rid: str, size: int = 10, at: float = 0.0, attempt: int = 0) -> Shadowed:
    return Shadowed(
        request_id=rid, data=b"x" * size, reply=f"_INBOX.{rid}", headers={}, received_at=at, attempt=attempt
    )


def test_a_standby_keeps_a_later_attempt_through_a_cancel_of_an_earlier_one():
    """The ingress cancels attempt 0 before it submits attempt 1, and the active scheduler's
    audit may cancel a worker's stray run of attempt 0 after that: neither ends attempt 1."""
    shadow = SubmitShadow(max_bytes=1000)
    shadow.submitted(_kept("r", attempt=1))
    shadow.cancelled(Cancel(request_id="r", reason="ended", attempt=0))
    assert shadow.get("r") is not None
    shadow.cancelled(Cancel(request_id="r", reason="client_gone", attempt=1))
    assert shadow.get("r") is None
    shadow.submitted(_kept("s", attempt=3))
    shadow.cancelled(Cancel(request_id="s", reason="client_gone"))  # every attempt
    shadow.cancelled(Cancel(request_id="never-seen", reason="client_gone"))
    assert len(shadow) == 0


def test_a_standby_keeps_submits_until_they_end_within_its_bytes():
    shadow = SubmitShadow(max_bytes=30)
    for rid in ("a", "b", "c"):
        shadow.submitted(_kept(rid))
    shadow.ended("b")
    shadow.ended("never-seen")
    assert [k.entry.request_id for k in shadow.take()] == ["a", "c"] and len(shadow) == 0
    for rid in ("d", "e", "f", "g"):  # 40 bytes in 30: the oldest goes
        shadow.submitted(_kept(rid))
    assert shadow.evicted == 1 and shadow.size == 30
    assert [k.entry.request_id for k in shadow.take()] == ["e", "f", "g"]


def test_a_standby_hears_the_answers_to_the_submits_it_keeps():
    shadow = SubmitShadow(max_bytes=1000)
    for rid in ("admitted", "rejected", "unanswered"):
        shadow.submitted(_kept(rid))
    shadow.answered("_INBOX.admitted", Codec.encode(Admitted(request_id="admitted", queue_position=2)))
    refused = Rejected(request_id="rejected", reason="overloaded", message="busy", retry_after_s=1.0)
    shadow.answered("_INBOX.rejected", Codec.encode(refused))
    shadow.answered("_INBOX.someone-else", b"not a scheduler reply")
    shadow.answered("_INBOX.unanswered", b"\xff garbage")  # not an answer: still waiting
    kept = {k.entry.request_id: k.admitted for k in shadow.take()}
    assert kept == {"admitted": True, "unanswered": False}  # a refused one ended there


def test_a_takeover_adopts_what_a_worker_holds_and_places_each_other_kind_in_its_phase():
    assert settlement(known=True, prefilled=True, admitted=True) == "adopted"
    assert settlement(known=False, prefilled=True, admitted=True) == "decode"
    assert settlement(known=False, prefilled=False, admitted=True) == "queue"
    assert settlement(known=False, prefilled=False, admitted=False) == "admit"


def test_a_kept_submit_remembers_its_prefill_until_it_ends():
    shadow = SubmitShadow(max_bytes=100)
    a, b = make_spec("a"), make_spec("b")
    for rid in ("a", "b"):
        shadow.submitted(_kept(rid))
    done = prefill_done(a, "p0")
    shadow.prefilled(done)
    shadow.prefilled(prefill_done(b, "p0", finished=True))  # token 0 ended it
    shadow.prefilled(prefill_done(make_spec("never-kept"), "p0"))
    assert [(k.entry.request_id, k.prefill) for k in shadow.take()] == [("a", done)]


def test_a_request_the_old_scheduler_queued_is_queued_again_without_a_second_admission():
    clock = FakeClock()
    new = SchedulerCore(SchedulerConfig())
    new.on_event(load_report("p0", "prefill", budget=100, seq=1), clock.now)
    spec = make_spec("queued", prompt_len=40, deadline_s=5.0)
    reply, _ = new.submit(spec, clock.now)
    assert isinstance(reply, Rejected) and reply.reason == "no_workers"  # as a new request, refused
    actions = new.requeue(spec, enqueued_at=clock.now - 1.0, now=clock.now)  # admitted already: placed
    assert [(a.worker_id, type(a.task)) for a in actions if isinstance(a, Dispatch)] == [("p0", PrefillTask)]
    assert new.requeue(spec, enqueued_at=clock.now, now=clock.now) == []
    new.check_invariants()


def test_a_request_that_waited_for_decode_resumes_from_the_same_handle():
    clock = FakeClock()
    new = _core(clock)
    spec = make_spec("waited", prompt_len=40)
    done = prefill_done(spec, "p0", first_token=4321)
    actions = new.resume_decode(spec, done, clock.now)
    assert [(a.worker_id, a.task) for a in actions if isinstance(a, Dispatch)] == [
        ("d0", DecodeTask(spec=spec, handle=done.handle, first_token=4321, usage=done.usage, charged_tokens=48))
    ]
    assert new.resume_decode(spec, done, clock.now) == []  # known already: nothing twice
    new.check_invariants()


def test_the_workers_a_takeover_waits_for_are_those_heard_lately():
    shadow = SubmitShadow(max_bytes=100)
    shadow.worker_heard("p0", 1.0)
    shadow.worker_heard("d0", 4.0)
    shadow.worker_heard("gone", 4.0)
    shadow.worker_left("gone")
    assert shadow.live_workers(now=5.0, expiry_s=2.0) == {"d0"}
