"""The core's SLO-aware queueing (the ``switchyard`` policy with ``ttft_slo_s``), its
backfill around a prompt larger than any worker's budget, and the rate it learns.

One prefill worker computes at the default 8,000 tokens/s until the core learns
otherwise, so a prompt's predicted time to first token is (tokens queued there + its own)
/ 8,000 s.
"""

from __future__ import annotations

from dataclasses import replace

import pytest

from switchyard.scheduler import Dispatch, FailStream
from switchyard.scheduler.policies import Switchyard
from switchyard.scheduler.state import Fleet, Tracked
from switchyard.schemas import Admitted, LocalTask, PrefillTask, RequestSpec
from tests.support.factories import make_spec, prefill_done, request_finished
from tests.unit.test_policies import tracked, view, worker
from tests.unit.test_scheduler_core import Harness

SLO = 2.0


def placed(actions: list) -> dict[str, str]:
    """request -> worker, for the prefill tasks among ``actions`` (a colocated worker's
    ``LocalTask`` too: it prefills, then decodes there)."""
    return {
        a.task.spec.request_id: a.worker_id
        for a in actions
        if isinstance(a, Dispatch) and isinstance(a.task, PrefillTask | LocalTask)
    }


def fleet(policy: str = "switchyard", workers: int = 1, budget: int = 100_000, **config) -> Harness:
    h = Harness(policy=policy, ttft_slo_s=SLO, **config)
    for i in range(workers):
        h.report(f"p{i}", budget=budget)
    h.report("d0", role="decode", budget=1_000_000)
    return h


def test_a_request_that_would_miss_the_slo_waits_behind_one_that_can_meet_it() -> None:
    h = fleet()
    a, b, c = (make_spec(r, prompt_len=n) for r, n in (("a", 12_000), ("b", 12_000), ("c", 2_000)))
    assert placed(h.admit(a)) == {"a": "p0"}  # 1.5 s: it makes it
    assert placed(h.admit(b)) == {}  # 12k behind 12k: 3 s, late
    assert placed(h.admit(c)) == {"c": "p0"}  # 1.75 s: it can still make it, so it goes first
    assert h.core.requests["b"].late and h.core.requests["b"].phase == "queued"


def test_the_peers_keep_arrival_order_whatever_the_slo() -> None:
    h = fleet(policy="dynamo_kv")
    a, b, c = (make_spec(r, prompt_len=n) for r, n in (("a", 12_000), ("b", 12_000), ("c", 2_000)))
    assert placed(h.admit(a) + h.admit(b) + h.admit(c)) == {"a": "p0", "b": "p0", "c": "p0"}
    assert not any(t.late for t in h.core.requests.values())


def test_no_slo_no_late_lane() -> None:
    h = Harness(policy="switchyard")  # no ttft_slo_s: the default, none
    h.report("p0", budget=100_000)
    h.report("d0", role="decode", budget=1_000_000)
    a, b = make_spec("a", prompt_len=12_000), make_spec("b", prompt_len=12_000)
    assert placed(h.admit(a) + h.admit(b)) == {"a": "p0", "b": "p0"}


def test_a_late_request_runs_once_its_worker_has_slack() -> None:
    h = fleet()
    a, b = make_spec("a", prompt_len=12_000), make_spec("b", prompt_len=12_000)
    h.admit(a)
    assert placed(h.admit(b)) == {}
    h.clock.advance(1.5)
    assert placed(h.event(prefill_done(a, "p0", prefill_s=1.5))) == {"b": "p0"}


def _document_on_p0(queued: int, document: int = 16_000) -> tuple[Harness, RequestSpec]:
    """Two prefill workers, p0 holding a ``document``-token document and ``queued`` tokens
    of another prompt on its ledger; the core and a question on the document (1,000 more)."""
    from switchyard.schemas import KvSnapshot

    h = fleet(workers=2, worker_expiry_s=100.0)
    doc = make_spec("doc", prompt_len=document)
    h.core.index.load_snapshot(KvSnapshot(worker_id="p0", seq=0, blocks={"device": doc.block_keys}))
    assert placed(h.admit(make_spec("a", prompt_len=queued))) == {"a": "p0"}
    return h, make_spec("q", prompt=doc.prompt_tokens + make_spec("x", prompt_len=1_000).prompt_tokens)


def test_a_late_request_whose_prefix_a_busy_worker_holds_runs_there_not_on_the_idle_one() -> None:
    h, question = _document_on_p0(16_000)  # 2 s of work on p0
    # 16,000 queued + its 1,000 uncached on p0, 17,000 on p1: 2.1 s either way, late. p1 has
    # slack, but p0 computes it in 0.125 s (within a tenth of the SLO): p0, not 16,000
    # tokens recomputed on p1 and the document cached twice
    assert placed(h.admit(question)) == {"q": "p0"}
    assert h.core.requests["q"].late
    # ...while a late prompt cached nowhere still waits for slack: p1's
    assert placed(h.admit(make_spec("new", prompt_len=17_000))) == {"new": "p1"}
    assert h.core.requests["new"].late


@pytest.mark.parametrize("busy", [True, False], ids=["busy", "spare"])
def test_alone_on_a_busy_fleet_a_request_no_worker_serves_within_half_its_budget_goes_where_it_computes_least(
    busy: bool,
) -> None:
    """p0 holds 10,000 tokens of the question's 11,000 and has 12,000 queued: (12,000 +
    1,000) / 8,000 = 1.625 s; p1 computes it all: 1.375 s. Neither is within half the 2 s
    SLO, both within it. Alone in the queue on a fleet that has been busy lately, it goes
    to p0 (1,000 tokens computed, not 11,000); with spare time, to the quickest, p1."""
    h, question = _document_on_p0(12_000, document=10_000)
    h.core.fleet.busy = busy  # (the core sets it from its ticks: the share of time the fleet was busy)
    assert placed(h.admit(question)) == {"q": "p0" if busy else "p1"}
    assert not h.core.requests["q"].late


def test_a_late_request_does_not_wait_where_its_prefix_is_past_the_time_it_would_be_shed() -> None:
    h, question = _document_on_p0(40_000)  # 5 s of work on p0
    # On p0 its first token would come after 5.1 s, past the 4 s (2 SLOs) at which it would
    # be shed: not there, but on p1's slack
    assert placed(h.admit(question)) == {"q": "p1"}


def test_late_requests_go_shortest_first() -> None:
    h = fleet()
    a = make_spec("a", prompt_len=12_000)
    h.admit(a)
    for rid, n in (("long", 20_000), ("short", 6_000)):
        assert placed(h.admit(make_spec(rid, prompt_len=n))) == {}
    h.clock.advance(1.5)
    # the short one first; the long one then waits for slack again
    assert placed(h.event(prefill_done(a, "p0", prefill_s=1.5))) == {"short": "p0"}


def test_a_late_request_with_no_slack_in_two_slos_is_shed_with_a_clear_error() -> None:
    h = fleet(worker_expiry_s=100.0)
    a, b = make_spec("a", prompt_len=12_000), make_spec("b", prompt_len=12_000)
    h.admit(a)
    h.admit(b)
    assert [x for x in h.tick(1.9 * SLO) if isinstance(x, FailStream)] == []
    shed = [x for x in h.tick(0.2 * SLO) if isinstance(x, FailStream)]
    assert [(x.request_id, x.error.code) for x in shed] == [("b", "overloaded")]
    assert "could not meet the 2 s time to first token" in shed[0].error.message
    assert "b" not in h.core.requests and "a" in h.core.requests
    assert shed[0].error.retry_after_s == 2.0  # a's 12,000 tokens left at 8,000 tokens/s: 1.5 s, rounded up


def test_late_requests_do_not_count_against_the_queue_limit() -> None:
    h = fleet(max_queued_tokens=20_000)
    h.admit(make_spec("a", prompt_len=12_000))
    h.admit(make_spec("b", prompt_len=12_000))  # late, queued: 12k of the 20k
    reply, _ = h.submit(make_spec("c", prompt_len=12_000))  # 24k queued, but b is shed first if need be
    assert isinstance(reply, Admitted)


def test_on_time_requests_prefer_the_cached_worker_that_still_meets_the_slo() -> None:
    busy_with_cache = worker("w1", load=4_000, requests=1)
    idle = worker("w2")
    request = tracked(prompt_len=16_000)
    matches = {"w1": (800, 800)}  # w1 holds 12,800 of the 16,000 tokens
    # Without an SLO, the least predicted TTFT: here the cached worker (0.72 s against 1.6 s)
    assert Switchyard().choose(request, [busy_with_cache, idle], view(matches, prompt=16_000)).worker_id == "w1"
    # Make the cached worker slower to answer than the idle one, but still well inside the SLO:
    slow = worker("w1", load=18_000, requests=1)
    no_slo = view(matches, prompt=16_000)
    assert Switchyard().choose(request, [slow, idle], no_slo).worker_id == "w2"  # 2.12 s against 1.6 s
    with_slo = replace(no_slo, ttft_budget_s=5.0)
    assert Switchyard().choose(request, [slow, idle], with_slo).worker_id == "w1"  # 3,200 tokens, not 16,000
    # ...unless keeping the SLO with room to spare rules it out: then the quickest again
    tight = replace(no_slo, ttft_budget_s=3.0)
    assert Switchyard().choose(request, [slow, idle], tight).worker_id == "w2"


def test_a_prompt_over_every_budget_keeps_the_first_worker_to_free_up_and_the_rest_backfill() -> None:
    h = fleet(policy="least_tokens", workers=2, budget=10_000)
    x, y = make_spec("x", prompt_len=2_000), make_spec("y", prompt_len=6_000)
    assert placed(h.admit(x) + h.admit(y)) == {"x": "p0", "y": "p1"}
    big, small = make_spec("big", prompt_len=30_000), make_spec("small", prompt_len=3_000)
    assert placed(h.admit(big)) == {}  # over every budget: it needs an idle worker
    assert placed(h.admit(small)) == {"small": "p1"}  # not p0: p0 frees up first, it is big's
    h.clock.advance(0.3)
    assert placed(h.event(prefill_done(x, "p0", prefill_s=0.3))) == {"big": "p0"}


def test_a_head_within_budget_is_not_jumped() -> None:
    h = fleet(policy="least_tokens", workers=2, budget=10_000)
    h.admit(make_spec("x", prompt_len=5_000))
    h.admit(make_spec("y", prompt_len=5_000))
    assert placed(h.admit(make_spec("head", prompt_len=8_000))) == {}
    assert placed(h.admit(make_spec("small", prompt_len=1_000))) == {}  # it would fit, but waits its turn


def test_the_rate_is_the_tokens_computed_over_the_time_the_worker_was_busy_computing_them() -> None:
    h = fleet(policy="least_tokens")
    a, b = make_spec("a", prompt_len=8_000), make_spec("b", prompt_len=6_000)
    h.admit(a)
    h.admit(b)  # dispatched behind a
    h.clock.advance(1.0)
    h.event(prefill_done(a, "p0", prefill_s=1.0))  # 8,000 tokens in 1 s: as assumed
    assert h.core.workers["p0"].prefill_rate == pytest.approx(8_000)
    h.clock.advance(2.0)
    # b was computed from a's done on, and 2,000 of its tokens were cached there: 4,000 in 2 s
    # (not its 6,000 and a's 8,000 ahead of it over the 3 s since its dispatch), added to
    # the worker's sums, which keep 0.95 of what they held.
    h.event(prefill_done(b, "p0", cached=2_000, prefill_s=0.5))
    sample = (0.95 * 8_000 + 4_000) / (0.95 * 1.0 + 2.0)
    assert h.core.workers["p0"].prefill_rate == pytest.approx(0.8 * 8_000 + 0.2 * sample)


def test_small_prompts_give_no_sample_until_the_sums_hold_2048_tokens_and_idle_time_is_not_counted() -> None:
    h = fleet(policy="least_tokens")
    a, b = make_spec("a", prompt_len=1_000), make_spec("b", prompt_len=1_500)
    h.admit(a)
    h.clock.advance(0.5)  # mostly the bus and fixed costs: not a rate on its own
    h.event(prefill_done(a, "p0", prefill_s=0.1))
    assert h.core.workers["p0"].prefill_rate == pytest.approx(8_000)
    h.clock.advance(10.0)  # idle
    h.admit(b)
    h.clock.advance(0.25)
    h.event(prefill_done(b, "p0", prefill_s=0.1))  # 1,500 more tokens in 0.25 s busy
    sample = (0.95 * 1_000 + 1_500) / (0.95 * 0.5 + 0.25)
    assert h.core.workers["p0"].prefill_rate == pytest.approx(0.8 * 8_000 + 0.2 * sample)


def test_a_request_behind_a_prompt_half_computed_is_not_late_for_the_half_done() -> None:
    """The ledger holds a prompt's tokens until it is done; the time since the worker's
    last prefill done at its rate is counted off (``SchedulerCore._backlog``)."""
    for waited, late in ((0.5, True), (1.2, False)):
        h = fleet()
        a, b = make_spec("a", prompt_len=12_000), make_spec("b", prompt_len=12_000)
        assert placed(h.admit(a)) == {"a": "p0"}  # 1.5 s
        h.clock.advance(waited)
        # 12,000 - 8,000 * waited still to compute ahead of b's 12,000: 2.5 s after 0.5 s
        # (late), 1.8 s after 1.2 s (it makes it); counted whole, 3 s either way.
        assert placed(h.admit(b)) == ({} if late else {"b": "p0"}), waited
        assert h.core.requests["b"].late is late


def test_with_prefilled_requests_waiting_for_decode_room_a_new_one_is_refused_up_front() -> None:
    h = Harness(policy="switchyard", ttft_slo_s=SLO)
    h.report("p0", budget=100_000)
    h.report("d0", role="decode", budget=2_500)  # room for one request's KV (1,500 tokens) at a time
    a, b = make_spec("a", prompt_len=1_000, max_tokens=500), make_spec("b", prompt_len=1_000, max_tokens=500)
    h.admit(a)
    h.admit(b)
    h.clock.advance(0.2)
    h.event(prefill_done(a, "p0", prefill_s=0.1))  # a decodes on d0
    h.event(prefill_done(b, "p0", prefill_s=0.1))  # b waits for room
    assert h.core.requests["b"].phase == "awaiting_decode"
    status = h.core.status()
    assert (status.queued_requests, status.awaiting_decode, status.paused_requests) == (0, 1, 0)
    reply, _ = h.submit(make_spec("c", prompt_len=1_000, max_tokens=500))
    assert reply.reason == "overloaded" and "1 prefilled requests wait for room" in reply.message
    # the peers let it in (up to the overcommit), to wait after its first token
    peer = Harness(policy="dynamo_kv", ttft_slo_s=SLO)
    peer.report("p0", budget=100_000)
    peer.report("d0", role="decode", budget=2_500)
    for spec in (a, b):
        peer.admit(spec)
    peer.clock.advance(0.2)
    peer.event(prefill_done(a, "p0", prefill_s=0.1))
    peer.event(prefill_done(b, "p0", prefill_s=0.1))
    assert isinstance(peer.submit(make_spec("c", prompt_len=1_000, max_tokens=500))[0], Admitted)


def test_on_a_colocated_fleet_the_safe_choice_weighs_what_each_worker_computes_not_what_it_decodes() -> None:
    decoding = worker("w1", role="both")
    decoding.hold("seq", 6_000)  # 6,000 KV tokens of sequences it decodes
    idle = worker("w2", role="both")
    both = Fleet()
    for w in (decoding, idle):
        both.add(w)
    both.busy = True  # ties to the lowest id (no spread)
    request = tracked(prompt_len=4_000)
    safe = replace(view(prompt=4_000), ttft_budget_s=10.0)
    # Same compute either way. Decodes running slow: the KV is not counted, the lowest id.
    assert Switchyard().choose(request, [decoding, idle], safe).worker_id == "w1"
    # Decodes with slack: it breaks the tie, to the one whose decodes the prompt would not slow.
    both.decode_slack = True
    assert Switchyard().choose(request, [decoding, idle], safe).worker_id == "w2"
    # 3,200 of the 4,000 tokens cached where it decodes: it goes there, slack or not (weighed
    # as work, its 6,000 KV tokens sent the prompt to recompute them on the idle worker).
    cached = replace(view({"w1": (200, 200)}, prompt=4_000), ttft_budget_s=10.0)
    for slack in (False, True):
        both.decode_slack = slack
        assert Switchyard().choose(request, [decoding, idle], cached).worker_id == "w1", slack


def test_on_a_fleet_busy_lately_a_colocated_workers_queue_weighs_nothing_beside_the_compute_it_saves() -> None:
    holder, idle = worker("w1", load=2_000, requests=1, role="both"), worker("w2", role="both")
    both = Fleet()
    for w in (holder, idle):
        both.add(w)
    request = tracked(prompt_len=6_400)
    cached = replace(view({"w1": (370, 370)}, prompt=6_400), ttft_budget_s=10.0)  # w1 holds 5,920 tokens
    # Capacity to spare: 480 to compute behind 2,000 queued (4 x) against 6,400 on the idle one
    assert Switchyard().choose(request, [holder, idle], cached).worker_id == "w2"
    both.busy = True  # busy lately: the 5,920 tokens it saves are the next request's capacity
    assert Switchyard().choose(request, [holder, idle], cached).worker_id == "w1"


# --- the late lane on colocated fleets, and when shedding is right --------------------------
#
# A prompt of 40,000 tokens takes 5 s at the default rate: it misses the 2 s SLO even on an
# idle worker (late on arrival, whatever the load).

LONG = 40_000
BOTH_BUDGET = 1_000_000  # prompt tokens, and KV tokens, each colocated worker holds


class Colocated(Harness):
    """``Harness`` for ``both`` workers: the core's own invariants after every step (the
    harness's ledger check knows only prefill and decode workers)."""

    def check(self) -> None:
        self.core.check_invariants()


def colocated(workers: int = 2, **config) -> Harness:
    h = Colocated(policy="switchyard", ttft_slo_s=SLO, worker_expiry_s=1_000.0, **config)
    for i in range(workers):
        h.report(f"c{i}", role="both", budget=BOTH_BUDGET)
    return h


def decoding(h: Harness, worker_id: str, rid: str) -> None:
    """A short request prefilled on ``worker_id``, which now decodes it."""
    spec = make_spec(rid, prompt_len=1_000)
    assert placed(h.admit(spec)) == {rid: worker_id}
    h.event(prefill_done(spec, worker_id, prefill_s=0.1))
    assert rid in h.core.workers[worker_id].held


def busy_for(h: Harness, seconds: int) -> None:
    """Heartbeats and ticks, a second apart, for ``seconds``: the core's busy share learns."""
    for _ in range(seconds):
        h.clock.advance(1.0)
        for worker_id in h.core.workers:
            h.report(worker_id, role="both", budget=BOTH_BUDGET)
        h.tick()


def test_a_long_prompt_on_an_idle_colocated_fleet_is_placed_at_once_and_never_shed() -> None:
    h = colocated()
    assert placed(h.admit(make_spec("long", prompt_len=LONG))) == {"long": "c0"}
    assert h.core.requests["long"].late  # it misses the SLO anyway: it just goes first
    assert not [a for a in h.tick(10 * SLO) if isinstance(a, FailStream)]
    assert h.phase("long") == "prefill"


def test_a_late_request_takes_an_idle_colocated_worker_while_another_runs_a_long_prompt() -> None:
    # The whole fleet does not drain (c0 has 5 s of work), but c1 is idle: nobody on time
    # needs it, so the second long prompt need not wait for c0.
    h = colocated()
    assert placed(h.admit(make_spec("a", prompt_len=LONG))) == {"a": "c0"}
    assert placed(h.admit(make_spec("b", prompt_len=LONG))) == {"b": "c1"}


def test_a_late_request_goes_to_the_slack_colocated_worker_that_decodes_fewest_sequences() -> None:
    h = colocated()
    decoding(h, "c0", "seq")
    assert placed(h.admit(make_spec("long", prompt_len=LONG))) == {"long": "c1"}  # not the lowest id


def test_on_a_colocated_fleet_busy_lately_a_late_request_does_not_stall_a_workers_decodes() -> None:
    # c1 runs a long prompt for a minute: half the fleet busy lately. c0 is idle but decodes
    # a sequence the late prompt would stall.
    h = colocated()
    decoding(h, "c0", "seq")
    assert placed(h.admit(make_spec("a", prompt_len=10 * LONG))) == {"a": "c1"}  # not on the decodes
    busy_for(h, 60)
    assert placed(h.admit(make_spec("b", prompt_len=LONG))) == {}
    assert h.core.requests["b"].late
    # ...whereas with nothing to decode there, it takes c0 at once (as on a prefill worker)
    h = colocated()
    assert placed(h.admit(make_spec("a", prompt_len=10 * LONG))) == {"a": "c0"}
    busy_for(h, 60)
    assert placed(h.admit(make_spec("b", prompt_len=LONG))) == {"b": "c1"}


def test_under_overload_late_requests_on_a_colocated_fleet_are_still_shed() -> None:
    h = colocated()
    for rid in ("a", "b"):
        h.admit(make_spec(rid, prompt_len=10 * LONG))  # both workers busy for 50 s
    assert placed(h.admit(make_spec("c", prompt_len=LONG))) == {}
    assert not [a for a in h.tick(1.9 * SLO) if isinstance(a, FailStream)]
    shed = [a for a in h.tick(0.2 * SLO) if isinstance(a, FailStream)]
    assert [(a.request_id, a.error.code) for a in shed] == [("c", "overloaded")]


def test_an_overdue_late_request_takes_a_worker_with_nothing_to_do_instead_of_being_shed() -> None:
    # The whole fleet busy for a minute; then two of its four workers are left with nothing
    # to do. The busy share lately still reads busy (it lags), so the late request waits,
    # but once it has waited two SLOs it takes one of them: the fleet is not overloaded.
    h = colocated(workers=4)
    specs = [make_spec(f"r{i}", prompt_len=n) for i, n in enumerate((10 * LONG, 10 * LONG, 4 * LONG, 4 * LONG))]
    assert placed([x for spec in specs for x in h.admit(spec)]) == {f"r{i}": f"c{i}" for i in range(4)}
    busy_for(h, 60)
    assert placed(h.admit(make_spec("late", prompt_len=LONG))) == {}
    for spec in specs[2:]:
        assert placed(h.event(prefill_done(spec, spec.request_id.replace("r", "c"), finished=True))) == {}
    actions = []
    for _ in range(int(2 * SLO) + 1):  # a tick a second: overdue once it has waited over 2 SLOs
        assert placed(actions) == {}
        actions = h.tick(1.0)
        assert not [x for x in actions if isinstance(x, FailStream)]
    assert placed(actions) in ({"late": "c2"}, {"late": "c3"})  # one of the two with nothing to do


def test_a_head_over_every_budget_that_misses_the_slo_anyway_waits_behind_those_on_time() -> None:
    h = fleet(workers=2, budget=10_000)
    h.admit(make_spec("x", prompt_len=8_000))
    h.admit(make_spec("y", prompt_len=8_000))
    assert placed(h.admit(make_spec("huge", prompt_len=30_000))) == {}  # 3.75 s alone: late
    assert h.core.requests["huge"].late
    # an on-time request behind it is not held back for it, however many it would fit
    assert placed(h.admit(make_spec("small", prompt_len=1_000))) == {"small": "p0"}


def _busy(h: Harness) -> None:
    """Both prefill workers run a 10,000-token prompt (1.25 s each, on time), long enough for
    the fleet's busy share, sampled each tick over about 20 s, to reach 1."""
    for rid, w in (("a", "p0"), ("b", "p1")):
        assert placed(h.admit(make_spec(rid, prompt_len=10_000))) == {rid: w}
    h.tick()
    h.tick(20.0)


def test_on_a_busy_fleet_a_short_prompt_passes_a_long_one_in_the_core_queue() -> None:
    h = fleet(workers=2, worker_expiry_s=100.0)
    _busy(h)
    # Each worker holds at most 0.15 s of prefill (1,200 tokens at 8,000/s) or one prompt
    # alone: both wait here instead of behind the 10,000 tokens on either worker.
    assert placed(h.admit(make_spec("long", prompt_len=5_000))) == {}
    assert placed(h.admit(make_spec("short", prompt_len=400))) == {}
    # The first worker to finish takes the short one (it came later), then nothing more:
    # 400 + 5,000 tokens are over the hold, so the long one waits for an idle worker.
    a = h.core.requests["a"].spec
    assert placed(h.event(prefill_done(a, "p0", prefill_s=1.25))) == {"short": "p0"}
    b = h.core.requests["b"].spec
    assert placed(h.event(prefill_done(b, "p1", prefill_s=1.25))) == {"long": "p1"}


def test_on_a_fleet_not_busy_lately_prompts_queue_at_the_workers_in_arrival_order() -> None:
    h = fleet(workers=2, worker_expiry_s=100.0)
    for rid, w in (("a", "p0"), ("b", "p1")):
        assert placed(h.admit(make_spec(rid, prompt_len=10_000))) == {rid: w}
    h.tick()  # no busy past yet: no hold
    assert placed(h.admit(make_spec("long", prompt_len=5_000))) == {"long": "p0"}
    assert placed(h.admit(make_spec("short", prompt_len=400))) == {"short": "p1"}


def test_the_peers_are_never_held_in_the_core_queue() -> None:
    h = fleet(policy="sglang_cache_aware", workers=2, worker_expiry_s=100.0)
    _busy(h)
    assert set(placed(h.admit(make_spec("long", prompt_len=5_000)))) == {"long"}
    assert set(placed(h.admit(make_spec("short", prompt_len=400)))) == {"short"}


def test_on_a_busy_fleet_a_prompt_is_not_held_from_the_worker_that_holds_most_of_it() -> None:
    from switchyard.schemas import KvSnapshot

    h = fleet(workers=2, worker_expiry_s=100.0)
    _busy(h)
    first_turn = make_spec("turn-1", prompt_len=5_000)
    h.core.index.load_snapshot(KvSnapshot(worker_id="p0", seq=0, blocks={"device": first_turn.block_keys}))
    extra = make_spec("x", prompt_len=1_000).prompt_tokens
    follow = make_spec("turn-2", prompt=first_turn.prompt_tokens + extra)
    # p0 holds 5,000 of its 6,000 tokens: it goes there behind the 10,000 (1.4 s), not held
    # for an idle worker that would recompute them all
    assert placed(h.admit(follow)) == {"turn-2": "p0"}
    assert placed(h.admit(make_spec("new", prompt_len=1_000))) == {}  # nothing cached: held


def one_decoding(measured: float | None) -> tuple[Harness, str, str]:
    """A colocated pair: one worker decodes 6,008 KV tokens, the other nothing; decodes
    measured at ``measured`` s for 8 tokens (14 or 29 ms a token; None: not yet). The
    decoding one, then the other (which took new content last: the spread would pick the
    decoding one)."""
    h = colocated(tpot_slo_s=0.05)
    if measured is not None:
        warm = make_spec("warm", prompt_len=100, max_tokens=8)
        assert placed(h.admit(warm)) == {"warm": "c0"}
        h.event(prefill_done(warm, "c0", prefill_s=0.01))
        h.clock.advance(measured)
        h.event(request_finished(warm, "c0"))
    seq = make_spec("seq", prompt_len=6_000, max_tokens=8)
    decoding = placed(h.admit(seq))["seq"]
    h.event(prefill_done(seq, decoding, prefill_s=0.5))
    other = {"c0": "c1", "c1": "c0"}[decoding]
    h.core.fleet.mark_filled(h.core.workers[other])
    return h, decoding, other


@pytest.mark.parametrize(("measured", "slack"), [(None, False), (0.1, True), (0.2, False)])
def test_the_kv_a_colocated_worker_decodes_breaks_ties_only_while_decodes_have_slack(
    measured: float | None, slack: bool
) -> None:
    # A prompt that costs both workers the same: while decodes finish within half the TPOT
    # SLO, the one decoding nothing takes it; else the KV does not count and the spread
    # decides (the decoding worker took new content longer ago).
    h, decoding, other = one_decoding(measured)
    assert h.core.fleet.decode_slack == slack
    assert placed(h.admit(make_spec("q", prompt_len=500))) == {"q": other if slack else decoding}


@pytest.mark.parametrize("measured", [None, 0.1, 0.2])
def test_the_kv_a_colocated_worker_decodes_is_not_work(measured: float | None) -> None:
    # The worker decoding nothing has 100 prompt tokens queued (400 of work at the queue's
    # weight); the decoding one, none. Counted as work while decodes ran slow, its 6,008 KV
    # tokens sent the prompt to the queue: on long shared documents that outweighed cached
    # prefixes, and the prompts recomputed them.
    h, decoding, other = one_decoding(measured)
    h.core.workers[other].assign("ahead", 100)  # (no request of the core's: placed by hand below)
    new = Tracked(spec=make_spec("new", prompt_len=1_000), enqueued_at=h.clock.now, order=99)
    for native in (True, False):  # the C loop, the numpy path, and the list of workers
        h.core.index.native = native
        for workers in (h.core.fleet, list(h.core.fleet.prefill.values())):
            placement = h.core.placer.prefill(new, workers, None, SLO)
            assert placement is not None and placement.worker.worker_id == decoding, (native, type(workers))


@pytest.mark.parametrize("native", [True, False])
def test_a_prompt_goes_where_it_pushes_no_decode_past_the_tpot_slo_between_workers_of_equal_work(
    native: bool,
) -> None:
    # Decodes have lately taken 14 ms a token against a 50 ms SLO. c0 decodes a 3-token
    # answer: 2 tokens after the first, 36 ms of slack each, room for some 600 prompt tokens
    # at the rate learned then. c1 decodes a 500-token one (room for ~140,000) and holds more KV.
    h = colocated(tpot_slo_s=0.05)
    h.core.index.native = native  # the C loop, or the numpy path
    warm = make_spec("warm", prompt_len=100, max_tokens=8)
    assert placed(h.admit(warm)) == {"warm": "c0"}
    h.event(prefill_done(warm, "c0", prefill_s=0.01))
    h.clock.advance(0.1)
    h.event(request_finished(warm, "c0"))
    assert h.core.fleet.decode_slack
    # The fleet is not busy: equal workers take new content in turn (``spreads``); c1 took
    # it last, so the next goes to c0.
    h.core.fleet.mark_filled(h.core.workers["c1"])
    for rid, prompt, answer, worker_id in (("short", 1_000, 3, "c0"), ("long", 3_000, 500, "c1")):
        spec = make_spec(rid, prompt_len=prompt, max_tokens=answer)
        assert placed(h.admit(spec)) == {rid: worker_id}
        h.event(prefill_done(spec, worker_id, prefill_s=0.1))
        worker, recent = h.core.workers[worker_id], h.core._lending.tpot[False]
        assert worker.room_tokens == pytest.approx((answer - 1) * (0.05 - recent) * worker.prefill_rate)
    c0, c1 = h.core.workers["c0"], h.core.workers["c1"]
    room = c0.room_tokens
    assert 400 < room < 1_000 < c0.kv_tokens < c1.kv_tokens and c1.room_tokens > 50_000
    # A prompt c0's room takes: the least KV breaks the tie, as before.
    small = make_spec("small", prompt_len=300)
    assert placed(h.admit(small)) == {"small": "c0"}
    h.event(prefill_done(small, "c0", prefill_s=0.05))
    assert c0.room_tokens == room - 300  # what it took
    # One it does not: c1, though it decodes more KV.
    big = make_spec("big", prompt_len=2_000)
    tracked_big = Tracked(spec=big, enqueued_at=0.0, order=99)
    by_worker = h.core.placer.prefill(tracked_big, list(h.core.fleet.prefill.values()), None, SLO)
    assert by_worker is not None and by_worker.worker.worker_id == "c1"  # the list path too
    assert placed(h.admit(big)) == {"big": "c1"}
    # The room only breaks ties: with c1's ledger holding the big prompt, c0 takes the next
    # one though it pushes c0's short answer past the SLO.
    assert placed(h.admit(make_spec("next", prompt_len=2_000))) == {"next": "c0"}
