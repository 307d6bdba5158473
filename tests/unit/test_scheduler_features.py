"""The scheduler core's queue, deadlines, sessions, colocated workers and conditional
disaggregation, with factories and a fake clock."""

from __future__ import annotations

import pytest

from switchyard.scheduler import BindSession, Dispatch, FailStream, SchedulerConfig, SchedulerCore
from switchyard.scheduler.sessions import Binding
from switchyard.schemas import Admitted, DecodeTask, LocalTask, PrefillTask, Rejected
from tests.support.factories import FakeClock, load_report, make_spec, prefill_done, request_finished


class Core:
    def __init__(self, **config) -> None:
        self.core = SchedulerCore(SchedulerConfig(**config))
        self.clock = FakeClock()
        self.seq = 0

    def worker(self, wid: str, role: str, budget: int = 100_000) -> list:
        self.seq += 1
        return self.core.on_event(load_report(wid, role, budget=budget, seq=self.seq), self.clock.now)

    def submit(self, spec) -> tuple:
        reply, actions = self.core.submit(spec, self.clock.now)
        self.core.check_invariants()
        return reply, actions

    def event(self, event) -> list:
        actions = self.core.on_event(event, self.clock.now)
        self.core.check_invariants()
        return actions


def dispatches(actions, kind=None) -> list[tuple[str, str]]:
    return [
        (a.task.spec.request_id, a.worker_id)
        for a in actions
        if isinstance(a, Dispatch) and (kind is None or isinstance(a.task, kind))
    ]


# --- the fair queue ------------------------------------------------------------------------------


def test_a_flooding_tenant_does_not_starve_another() -> None:
    c = Core()
    c.worker("p", "prefill", budget=100)
    c.worker("d", "decode")
    for i in range(5):
        c.submit(make_spec(f"big{i}", prompt_len=100, tenant="flood"))
    c.submit(make_spec("small", prompt_len=100, tenant="quiet"))
    order = []
    for _ in range(6):
        running = next(r for r, t in c.core.requests.items() if t.phase == "prefill")
        order.append(running)
        spec = c.core.requests[running].spec
        c.event(prefill_done(spec, "p", finished=True))
    assert order.index("small") <= 2, order  # not behind all five of the flood


def test_priority_beats_arrival_and_requeued_beat_new() -> None:
    c = Core()
    c.worker("p", "prefill", budget=10)
    c.worker("d", "decode")
    c.submit(make_spec("running", prompt_len=10))
    c.submit(make_spec("batch", prompt_len=10, priority=1))
    c.submit(make_spec("interactive", prompt_len=10, priority=0))
    assert c.core._queue.request_ids() == ["interactive", "batch"]


def test_queue_position_is_reported() -> None:
    c = Core()
    c.worker("p", "prefill", budget=10)
    c.worker("d", "decode")
    first, _ = c.submit(make_spec("a", prompt_len=10))
    second, _ = c.submit(make_spec("b", prompt_len=10))
    third, _ = c.submit(make_spec("c", prompt_len=10))
    assert (first.queue_position, second.queue_position, third.queue_position) == (0, 1, 2)


# --- deadlines -----------------------------------------------------------------------------------


def test_a_queued_request_past_its_deadline_fails_and_leaves() -> None:
    c = Core()
    c.worker("p", "prefill", budget=10)
    c.worker("d", "decode")
    c.submit(make_spec("busy", prompt_len=10))
    c.submit(make_spec("hurry", prompt_len=10, deadline_s=1.0, ingress_id="ing-9"))
    c.clock.advance(0.5)
    assert not [a for a in c.core.tick(c.clock.now) if isinstance(a, FailStream)]
    c.clock.advance(0.6)
    failed = [a for a in c.core.tick(c.clock.now) if isinstance(a, FailStream)]
    assert [(f.ingress_id, f.request_id, f.error.code) for f in failed] == [("ing-9", "hurry", "deadline_exceeded")]
    assert "hurry" not in c.core.requests
    c.core.check_invariants()


def test_admission_rejects_a_deadline_the_queue_cannot_meet() -> None:
    c = Core(default_prefill_tokens_per_s=100.0)
    c.worker("p", "prefill", budget=100)
    c.worker("d", "decode")
    c.submit(make_spec("a", prompt_len=100))
    c.submit(make_spec("b", prompt_len=100))  # queued: 200 tokens ahead at 100 tok/s
    reply, _ = c.submit(make_spec("c", prompt_len=10, deadline_s=0.5))
    assert isinstance(reply, Rejected) and reply.reason == "overloaded" and reply.retry_after_s >= 1
    reply, _ = c.submit(make_spec("d", prompt_len=10, deadline_s=60))
    assert isinstance(reply, Admitted)


# --- sessions ------------------------------------------------------------------------------------


def test_a_session_returns_to_its_worker_and_is_persisted() -> None:
    c = Core(policy="round_robin")
    for wid in ("p1", "p2", "p3"):
        c.worker(wid, "prefill")
    c.worker("d", "decode")
    _, actions = c.submit(make_spec("a", session="chat-1", tenant="t"))
    ((_, home),) = dispatches(actions, PrefillTask)
    binds = [a.binding for a in actions if isinstance(a, BindSession)]
    assert [(b.tenant, b.session, b.worker_id) for b in binds] == [("t", "chat-1", home)]
    for i in range(4):  # round robin would move it; the binding holds it
        _, actions = c.submit(make_spec(f"b{i}", session="chat-1", tenant="t"))
        assert dispatches(actions, PrefillTask)[0][1] == home


def test_sessions_are_scoped_by_tenant_and_expire() -> None:
    c = Core(policy="round_robin", session_ttl_s=10)
    for wid in ("p1", "p2"):
        c.worker(wid, "prefill")
    c.worker("d", "decode")
    _, actions = c.submit(make_spec("a", session="s", tenant="t1"))
    home = dispatches(actions, PrefillTask)[0][1]
    assert c.core.sessions.lookup("t1", "s", c.clock.now) == home
    assert c.core.sessions.lookup("t2", "s", c.clock.now) is None
    c.clock.advance(11)
    c.core.tick(c.clock.now)
    assert c.core.sessions.lookup("t1", "s", c.clock.now) is None


def test_a_session_spills_when_its_worker_is_overloaded() -> None:
    c = Core(policy="least_tokens", session_max_load=0.5)
    c.worker("p1", "prefill", budget=1000)
    c.worker("p2", "prefill", budget=1000)
    c.worker("d", "decode")
    c.core.restore_session(Binding("t", "s", "p1", c.clock.now + 60), c.clock.now)
    _, actions = c.submit(make_spec("fill", prompt_len=400, tenant="other"))  # least_tokens: p1
    assert dispatches(actions, PrefillTask) == [("fill", "p1")]
    _, actions = c.submit(make_spec("a", prompt_len=200, session="s", tenant="t"))  # 600 > 0.5 x 1000
    assert dispatches(actions, PrefillTask) == [("a", "p2")]


def test_restored_bindings_route_like_fresh_ones() -> None:
    c = Core(policy="round_robin")
    for wid in ("p1", "p2", "p3"):
        c.worker(wid, "prefill")
    c.worker("d", "decode")
    c.core.restore_session(Binding("t", "s", "p3", c.clock.now + 60), c.clock.now)
    c.core.restore_session(Binding("t", "old", "p1", c.clock.now - 1), c.clock.now)  # already expired
    _, actions = c.submit(make_spec("a", session="s", tenant="t"))
    assert dispatches(actions, PrefillTask) == [("a", "p3")]
    assert c.core.sessions.lookup("t", "old", c.clock.now) is None


# --- conditional disaggregation and colocated workers -------------------------------------------


def test_short_prompts_prefill_on_their_decode_worker() -> None:
    c = Core(local_prefill_max_tokens=64)
    c.worker("p", "prefill")
    c.worker("d", "decode")
    short = make_spec("short", prompt_len=48, max_tokens=10)
    _, actions = c.submit(short)
    assert dispatches(actions, LocalTask) == [("short", "d")] and not dispatches(actions, PrefillTask)
    assert c.event(prefill_done(short, "d")) == []  # no handoff: decode stays where it is
    assert c.core.requests["short"].phase == "decode" and c.core.workers["d"].load_tokens == 58
    c.event(request_finished(short, "d"))
    assert not c.core.requests and c.core.workers["d"].load_tokens == 0


def test_long_prompts_still_go_to_prefill_workers() -> None:
    c = Core(local_prefill_max_tokens=64)
    c.worker("p", "prefill")
    c.worker("d", "decode")
    long = make_spec("long", prompt_len=500)
    _, actions = c.submit(long)
    assert dispatches(actions, PrefillTask) == [("long", "p")]
    assert dispatches(c.event(prefill_done(long, "p")), DecodeTask) == [("long", "d")]


def test_a_lost_local_task_is_queued_again() -> None:
    c = Core(local_prefill_max_tokens=64)
    c.worker("p", "prefill")
    c.worker("d1", "decode")
    _, actions = c.submit(make_spec("short", prompt_len=32))
    ((_, first),) = dispatches(actions, LocalTask)
    c.worker("d2", "decode")
    retried = c.core.on_dispatch_failed(first, "short", "no_responders", c.clock.now)
    assert [w for _, w in dispatches(retried)] == ["d2"]
    c.core.check_invariants()


def test_colocated_workers_decode_where_they_prefill() -> None:
    c = Core()
    c.worker("w1", "both")
    c.worker("w2", "both")
    spec = make_spec("a", prompt_len=100, max_tokens=20)
    reply, actions = c.submit(spec)
    assert isinstance(reply, Admitted)
    ((_, home),) = dispatches(actions, LocalTask)  # prefill, then decode there: no handoff
    assert c.event(prefill_done(spec, home)) == []
    w = c.core.workers[home]
    # two ledgers: its prefill budget is free again, its KV holds the sequence
    assert c.core.requests["a"].phase == "decode" and (w.load_tokens, w.kv_tokens) == (0, 120)
    c.event(request_finished(spec, home))
    assert (w.load_tokens, w.kv_tokens) == (0, 0)


def test_a_colocated_worker_with_full_kv_takes_no_new_prompt() -> None:
    from tests.support.factories import load_report

    c = Core()
    c.core.on_event(msgspec_replace(load_report("w", "both", budget=1000, seq=1), kv_capacity_tokens=150), c.clock.now)
    first = make_spec("a", prompt_len=100, max_tokens=20)
    c.submit(first)
    c.event(prefill_done(first, "w"))
    _, actions = c.submit(make_spec("b", prompt_len=100, max_tokens=20))  # 120 + 120 > 150 KV
    assert dispatches(actions) == [] and c.core.requests["b"].phase == "queued"
    assert [r for r, _ in dispatches(c.event(request_finished(first, "w")))] == ["b"]


def test_colocated_alone_counts_as_both_roles_for_admission() -> None:
    c = Core()
    reply, _ = c.submit(make_spec("x"))
    assert isinstance(reply, Rejected) and reply.reason == "no_workers"
    c.worker("w", "both")
    reply, _ = c.submit(make_spec("y"))
    assert isinstance(reply, Admitted)


# --- keeping the prefix index honest -----------------------------------------------------------


def _snapshot(worker_id: str, seq: int, keys: list[int]):
    from switchyard.schemas import KvSnapshot

    return KvSnapshot(worker_id=worker_id, seq=seq, blocks={"device": keys})


def test_a_heartbeat_ahead_of_the_index_asks_a_snapshot() -> None:
    from switchyard.scheduler import RequestSnapshot
    from tests.support.factories import load_report

    c = Core()
    c.worker("p", "prefill")
    c.core.on_snapshot_failed("p", c.clock.now)  # the join's snapshot request is settled
    c.core.on_kv_snapshot(_snapshot("p", 3, [1, 2]), c.clock.now)
    c.seq += 1
    quiet = c.core.on_event(load_report("p", "prefill", budget=100_000, seq=c.seq), c.clock.now)
    assert not [a for a in quiet if isinstance(a, RequestSnapshot)]
    c.seq += 1
    report = load_report("p", "prefill", budget=100_000, seq=c.seq)
    ahead = c.core.on_event(msgspec_replace(report, kv_seq=4), c.clock.now)  # batch 4 never arrived
    assert [a.worker_id for a in ahead if isinstance(a, RequestSnapshot)] == ["p"]


def test_a_failed_snapshot_forgets_the_worker_and_is_retried_on_tick() -> None:
    from switchyard.scheduler import RequestSnapshot

    c = Core(snapshot_retry_s=1.0)
    c.worker("p", "prefill")
    c.core.on_kv_snapshot(_snapshot("p", 1, [7, 8]), c.clock.now)
    assert c.core.index.match([7, 8])["p"].device_blocks == 2
    c.core.on_snapshot_failed("p", c.clock.now)
    assert c.core.index.match([7, 8]) == {}  # under-reports until it hears again
    assert not [a for a in c.core.tick(c.clock.now) if isinstance(a, RequestSnapshot)]
    c.clock.advance(1.1)
    assert [a.worker_id for a in c.core.tick(c.clock.now) if isinstance(a, RequestSnapshot)] == ["p"]


def msgspec_replace(struct, **changes):
    import msgspec

    return msgspec.structs.replace(struct, **changes)


def test_prompts_done_in_one_batch_teach_the_rate_of_the_whole_batch() -> None:
    c = Core(default_prefill_tokens_per_s=1000.0)
    c.worker("p", "prefill")
    c.worker("d", "decode")
    a, b = make_spec("a", prompt_len=1_500), make_spec("b", prompt_len=1_500)
    c.submit(a)
    c.submit(b)
    c.clock.advance(0.5)
    # Both done at once: the second has no time of its own, and its tokens join the first's
    # in the worker's sums (which keep 0.95 of what they held): about 6,000 tokens/s.
    c.event(prefill_done(a, "p", prefill_s=0.5))
    assert c.core.workers["p"].prefill_rate == pytest.approx(1000)  # 1,500 tokens: no sample yet
    c.event(prefill_done(b, "p", prefill_s=0.5))
    sample = (0.95 * 1_500 + 1_500) / (0.95 * 0.5)
    assert c.core.workers["p"].prefill_rate == pytest.approx(0.8 * 1000 + 0.2 * sample)
