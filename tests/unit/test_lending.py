"""Colocated workers lent to decoding (``scheduler/lending.py``): the fleet's bookkeeping,
the rule that lends and takes back, where a handed-over decode goes, and the core's use
of it (a ``PrefillTask`` then a ``DecodeTask`` to a lent worker instead of a ``LocalTask``)."""

from __future__ import annotations

import pytest

from switchyard.scheduler import Dispatch, SchedulerConfig
from switchyard.scheduler.lending import Lending, lane_worker, pick_decode
from switchyard.scheduler.state import Fleet, WorkerState
from switchyard.schemas import DecodeTask, LocalTask, PrefillTask
from tests.support.factories import make_spec, prefill_done, request_finished
from tests.unit.test_scheduler_core import dispatches
from tests.unit.test_scheduler_slo import BOTH_BUDGET, Colocated

TPOT_SLO = 0.05
SLOW, QUICK = 0.9 * TPOT_SLO, 0.3 * TPOT_SLO


def both(worker_id: str, held: int = 0, load: int = 0) -> WorkerState:
    worker = WorkerState(worker_id, "both", token_budget=100_000, block_size=16, last_seen=0.0, kv_capacity=10_000)
    for i in range(held):
        worker.hold(f"{worker_id}-seq{i}", 100)
    if load:
        worker.assign(f"{worker_id}-prompt", load)
    return worker


def colocated_fleet(*workers: WorkerState) -> Fleet:
    fleet = Fleet()
    for worker in workers:
        fleet.add(worker)
    return fleet


def test_a_lent_worker_leaves_the_prefill_workers_and_comes_back_in_its_place() -> None:
    fleet = colocated_fleet(both("a"), both("b"), both("c"))
    fleet.lend("b")
    assert list(fleet.prefill) == ["a", "c"] and list(fleet.lent) == ["b"]
    assert [fleet.ids[s] for s in fleet.slots("prefill")] == ["a", "c"]  # no prompt is placed on it
    fleet.check_invariants()
    fleet.take_back("b")
    assert list(fleet.prefill) == ["a", "b", "c"] and not fleet.lent  # in the order they joined
    assert [fleet.ids[s] for s in fleet.slots("prefill")] == ["a", "b", "c"]
    fleet.lend("c")
    assert fleet.remove("c") is not None and not fleet.lent  # a lent worker may leave
    fleet.check_invariants()
    fleet.lend("b")
    fleet.remove("a")  # the last one that prefilled: the lent ones prefill again
    assert list(fleet.prefill) == ["b"] and not fleet.lent
    fleet.check_invariants()


def test_a_prefill_worker_joining_takes_every_lent_worker_back_and_a_decode_worker_does_not() -> None:
    # Lending is for fleets of colocated workers, with decode workers beside them or none:
    # once a prefill worker joins, the core no longer lends (``_lend``), so nothing may stay lent.
    for role, kept in (("prefill", False), ("decode", True)):
        fleet = colocated_fleet(both("a"), both("b"), both("c"))
        fleet.lend("b")
        fleet.lend("c")
        fleet.add(WorkerState("x", role, token_budget=100_000, block_size=16, last_seen=0.0))  # type: ignore[arg-type]
        assert (set(fleet.lent) == {"b", "c"}) is kept and set(fleet.prefill) >= ({"a"} if kept else {"a", "b", "c"})
        fleet.check_invariants()


def test_slow_decodes_lend_the_worker_with_most_decodes_then_wait_a_decode_before_the_next() -> None:
    fleet = colocated_fleet(both("a", held=1), both("b", held=3, load=500), both("c", held=3), both("d"))
    lending = Lending(SchedulerConfig(tpot_slo_s=TPOT_SLO))
    never = lambda: False  # noqa: E731
    lending.observe(False, QUICK)
    assert lending.decide(fleet, never, settle_s=10.0, now=0.0) is None  # quick enough: all prefill
    for _ in range(60):
        lending.observe(False, SLOW)
    assert lending.decide(fleet, never, 10.0, now=1.0) == "c"  # most decodes; fewer prompts than b
    assert list(fleet.lent) == ["c"]
    lending.observe(True, SLOW)
    assert lending.decide(fleet, never, 10.0, now=5.0) is None  # the last change has not settled
    assert lending.decide(fleet, never, 10.0, now=12.0) == "b"  # the lent ones are slow too
    lending.observe(True, SLOW)
    assert lending.decide(fleet, never, 10.0, now=30.0) == "a"
    lending.observe(True, SLOW)
    assert lending.decide(fleet, never, 10.0, now=60.0) is None  # the last prefill worker stays
    assert list(fleet.prefill) == ["d"] and lending.lent_total == 3


def test_while_prefill_is_short_only_decodes_past_the_slo_lend_a_worker() -> None:
    fleet = colocated_fleet(both("a"), both("b", held=2), both("c"))
    lending = Lending(SchedulerConfig(tpot_slo_s=TPOT_SLO))
    short = lambda: True  # noqa: E731
    lending.observe(False, SLOW)  # slow, but within the SLO: prefill needs the workers more
    assert lending.decide(fleet, short, 10.0, now=0.0) is None and not fleet.lent
    lending = Lending(SchedulerConfig(tpot_slo_s=TPOT_SLO))
    lending.observe(False, 1.5 * TPOT_SLO)  # past it: decodes miss whatever prefill does
    assert lending.decide(fleet, short, 10.0, now=0.0) == "b"


def two_lent_decoding_quick() -> tuple[Fleet, Lending]:
    """Three colocated workers, b and c lent, their decodes measured quick."""
    fleet = colocated_fleet(both("a"), both("b", held=2), both("c", held=1))
    fleet.lend("b")
    fleet.lend("c")
    lending = Lending(SchedulerConfig(tpot_slo_s=TPOT_SLO))
    lending.observe(True, QUICK)
    return fleet, lending


def test_quick_lent_decodes_give_a_worker_back_only_while_prefill_is_short() -> None:
    fleet, lending = two_lent_decoding_quick()
    assert lending.decide(fleet, lambda: False, 10.0, now=0.0) is None  # prefill keeps up
    assert lending.decide(fleet, lambda: True, 10.0, now=0.0) == "c"  # the one decoding fewest
    assert list(fleet.lent) == ["b"] and lending.taken_back == 1


def test_decodes_that_find_no_room_on_the_lent_workers_lend_another_whatever_prefill_does() -> None:
    # The lent worker decodes well within the SLO, but more than a fifth of the decodes
    # handed over went to colocated workers (none lent had room): they decode there between
    # prefill iterations, so another worker is lent even while prefill is short.
    fleet = colocated_fleet(both("a", held=2), both("b", held=3), both("c", held=1), both("d"))
    fleet.lend("a")
    lending = Lending(SchedulerConfig(tpot_slo_s=TPOT_SLO))
    short = lambda: True  # noqa: E731
    lending.observe(True, 0.7 * TPOT_SLO)  # neither slow nor quick
    for i in range(19):
        lending.observe_handover(to_lent=i % 2 == 0)  # 9 of 19 spilled: too few handed over yet
    assert lending.decide(fleet, short, 10.0, now=0.0) is None
    lending.observe_handover(to_lent=False)  # 10 of 20
    assert lending.decide(fleet, short, 10.0, now=1.0) == "b"  # the one decoding most
    assert set(fleet.lent) == {"a", "b"} and lending.lent_total == 1
    # Counted afresh after the change: a fifth spilled is not more than a fifth.
    lending.observe(True, 0.7 * TPOT_SLO)
    for i in range(20):
        lending.observe_handover(to_lent=i % 5 != 0)
    assert lending.decide(fleet, short, 10.0, now=20.0) is None
    lending.observe_handover(to_lent=False)  # 5 of 21
    assert lending.decide(fleet, short, 10.0, now=21.0) == "c"
    for _ in range(40):
        lending.observe_handover(to_lent=False)
    assert lending.decide(fleet, short, 10.0, now=40.0) is None  # the last prefill worker stays
    assert list(fleet.prefill) == ["d"]


def test_no_worker_is_taken_back_while_decodes_spill_to_colocated_workers() -> None:
    # Quick lent decodes and late prompts would give a worker back, but one decode since the
    # last change found no lent worker with room: taking one back would spill more.
    fleet, lending = two_lent_decoding_quick()
    for i in range(10):
        lending.observe_handover(to_lent=i != 3)
    assert lending.decide(fleet, lambda: True, 10.0, now=0.0) is None
    assert set(fleet.lent) == {"b", "c"} and lending.taken_back == 0


def test_without_a_tpot_slo_nothing_is_lent() -> None:
    fleet = colocated_fleet(both("a"), both("b"))
    lending = Lending(SchedulerConfig())
    lending.observe(False, 10.0)
    assert lending.decide(fleet, lambda: True, 0.0, now=0.0) is None and not fleet.lent


def test_a_handed_over_decode_goes_to_the_lent_worker_with_room_that_decodes_fewest() -> None:
    full = both("full")
    full.hold("big", 9_950)
    fleet = colocated_fleet(both("a", held=5, load=0), both("b", load=800), both("c", held=4), both("d", held=2), full)
    fleet.lend("c")
    fleet.lend("d")
    fleet.lend("full")
    assert pick_decode(fleet, 100).worker_id == "d"  # not full's single sequence: no room there
    fleet.take_back("c")
    fleet.take_back("d")
    assert pick_decode(fleet, 100).worker_id == "d"  # no lent one with room: fewest prompt tokens, then decodes


def test_the_lane_opens_only_on_lent_decodes_measured_well_within_the_slo() -> None:
    lending = Lending(SchedulerConfig(tpot_slo_s=TPOT_SLO))
    assert not lending.lane_open()  # nothing measured on a lent worker yet
    lending.observe(False, QUICK)
    assert not lending.lane_open()  # quick, but not on a lent worker
    lending.observe(True, 0.7 * TPOT_SLO)
    assert lending.lane_open()
    for _ in range(60):
        lending.observe(True, 0.82 * TPOT_SLO)  # past the lane's share, short of lending another
    assert not lending.lane_open()
    unset = Lending(SchedulerConfig())
    unset.observe(True, QUICK)
    assert not unset.lane_open()  # no TPOT SLO: no lending, no lane


def test_the_lane_worker_has_no_prompt_on_its_ledger_and_room_for_the_kv() -> None:
    full = both("full")
    full.hold("big", 9_950)
    fleet = colocated_fleet(both("a"), both("b", held=1, load=300), both("c", held=4), both("d", held=2), full)
    for worker_id in ("b", "c", "d", "full"):
        fleet.lend(worker_id)
    assert lane_worker(fleet, 100).worker_id == "d"  # b prefills one already; full has no room
    fleet.take_back("d")
    assert lane_worker(fleet, 100).worker_id == "c"
    assert lane_worker(fleet, 20_000) is None  # no lent worker holds that much KV


class TestTheCore:
    """The core on a colocated fleet with a TPOT SLO: slow decodes lend a worker, and from
    then on prompts go to the others, which hand each decode over to it."""

    @staticmethod
    def core(policy: str = "switchyard", tpot_slo_s: float = TPOT_SLO) -> Colocated:
        h = Colocated(policy=policy, ttft_slo_s=2.0, tpot_slo_s=tpot_slo_s, worker_expiry_s=1_000.0)
        for i in range(3):
            h.report(f"c{i}", role="both", budget=BOTH_BUDGET)
        return h

    @staticmethod
    def slow_decode(h: Colocated) -> str:
        """One request prefilled and decoded on one worker at 0.5 s a token; its worker."""
        spec = make_spec("slow", prompt_len=1_000, max_tokens=21)
        ((dispatch,),) = [[a for a in h.admit(spec) if isinstance(a, Dispatch)]]
        assert isinstance(dispatch.task, LocalTask)  # nothing lent yet: prefill, then decode there
        h.event(prefill_done(spec, dispatch.worker_id, prefill_s=0.1))
        h.clock.advance(10.0)
        h.event(request_finished(spec, dispatch.worker_id, generated=21))
        return dispatch.worker_id

    def test_slow_decodes_lend_a_worker_and_the_others_hand_their_decodes_to_it(self) -> None:
        h = self.core()
        self.slow_decode(h)
        (lent,) = h.core.fleet.lent
        spec = make_spec("next", prompt_len=1_000, max_tokens=20)
        ((dispatch,),) = [[a for a in h.admit(spec) if isinstance(a, Dispatch)]]
        assert isinstance(dispatch.task, PrefillTask) and dispatch.worker_id != lent  # prefill, then hand over
        handoff = [a for a in h.event(prefill_done(spec, dispatch.worker_id)) if isinstance(a, Dispatch)]
        assert [(a.worker_id, type(a.task)) for a in handoff] == [(lent, DecodeTask)]
        worker = h.core.workers[lent]
        assert worker.held == {"next": h.core.requests["next"].decode_tokens} and worker.load_tokens == 0
        h.event(request_finished(spec, lent, generated=20))
        assert not worker.held and "next" not in h.core.requests

    def test_the_core_counts_each_decode_handed_to_a_colocated_worker_for_want_of_room(self) -> None:
        h = self.core()
        self.slow_decode(h)
        (lent,) = h.core.fleet.lent
        h.core.workers[lent].kv_capacity = 1_500  # room for one of these decodes
        lending = h.core._lending

        def handed_to(rid: str) -> str:
            spec = make_spec(rid, prompt_len=1_000, max_tokens=20)
            (prefill,) = dispatches(h.admit(spec))
            (handoff,) = dispatches(h.event(prefill_done(spec, prefill.worker_id)), DecodeTask)
            return handoff.worker_id

        assert handed_to("r0") == lent and (lending._handed, lending._spilled) == (1, 0)
        for rid in ("r1", "r2"):
            assert handed_to(rid) != lent  # no room there: a colocated worker decodes it
        assert (lending._handed, lending._spilled) == (3, 2)
        h.event(request_finished(make_spec("r0", prompt_len=1_000, max_tokens=20), lent, generated=20))
        assert handed_to("r3") == lent and (lending._handed, lending._spilled) == (4, 2)

    @pytest.mark.parametrize(("policy", "tpot_slo_s"), [("llmd", TPOT_SLO), ("switchyard", 0.0)])
    def test_a_peer_or_no_tpot_slo_keeps_every_decode_where_it_was_prefilled(
        self, policy: str, tpot_slo_s: float
    ) -> None:
        h = self.core(policy, tpot_slo_s)
        self.slow_decode(h)
        assert not h.core.fleet.lent
        actions = h.admit(make_spec("next", prompt_len=1_000))
        assert [type(a.task) for a in actions if isinstance(a, Dispatch)] == [LocalTask]

    @staticmethod
    def lent_and_quick(h: Colocated) -> str:
        """A worker lent (slow colocated decodes), then a decode handed to it that ran at
        20 ms a token, under the lane's share of the 50 ms SLO: the lane is open. The lent worker."""
        TestTheCore.slow_decode(h)
        (lent,) = h.core.fleet.lent
        spec = make_spec("quick", prompt_len=1_000, max_tokens=21)
        (prefill,) = dispatches(h.admit(spec))
        (handoff,) = dispatches(h.event(prefill_done(spec, prefill.worker_id, prefill_s=0.1)), DecodeTask)
        assert handoff.worker_id == lent
        h.clock.advance(0.4)
        h.event(request_finished(spec, lent, generated=21))
        assert h.core._lending.lane_open()
        return lent

    def test_behind_long_prompts_a_short_one_prefills_and_decodes_on_the_lent_worker(self) -> None:
        h = self.core()
        lent = self.lent_and_quick(h)
        # On idle prefill workers a short prompt is quickest there: it goes there, to hand over.
        idle = make_spec("idle", prompt_len=100)
        (first,) = dispatches(h.admit(idle))
        assert isinstance(first.task, PrefillTask) and first.worker_id != lent
        h.event(prefill_done(idle, first.worker_id, prefill_s=0.01))
        # Each prefill worker busy with a long prompt for about a second...
        for i in range(2):
            (long,) = dispatches(h.admit(make_spec(f"long{i}", prompt_len=8_000)))
            assert isinstance(long.task, PrefillTask) and long.worker_id != lent
        # ...a short prompt prefills on the lent worker and decodes there, with no handoff.
        short = make_spec("short", prompt_len=100)
        (lane,) = dispatches(h.admit(short))
        assert (lane.worker_id, type(lane.task)) == (lent, LocalTask)
        # One prompt at a time there: the next short one queues behind a long one.
        (second,) = dispatches(h.admit(make_spec("short2", prompt_len=100)))
        assert isinstance(second.task, PrefillTask) and second.worker_id != lent
        assert not dispatches(h.event(prefill_done(short, lent, prefill_s=0.02)))
        worker = h.core.workers[lent]
        assert "short" in worker.held and worker.load_tokens == 0 and h.phase("short") == "decode"
        # A prompt that would stall the lent decodes for more than a token's SLO does not go there.
        (medium,) = dispatches(h.admit(make_spec("medium", prompt_len=1_000)))
        assert isinstance(medium.task, PrefillTask) and medium.worker_id != lent

    def test_once_handoffs_were_measured_a_long_prompt_with_a_short_answer_decodes_in_place(self) -> None:
        h = self.core()
        lent = self.lent_and_quick(h)
        for i, size in enumerate((2_000, 20_000)):  # handoffs of 3 us a token, beside a 20 ms step
            spec = make_spec(f"h{i}", prompt_len=size, max_tokens=21)
            (prefill,) = dispatches(h.admit(spec))
            h.event(prefill_done(spec, prefill.worker_id, prefill_s=0.1))
            h.clock.advance(0.02 + size * 3e-6 + 19 * 0.02)
            h.event(request_finished(spec, lent, generated=21, step_s=0.02))
        assert h.core._lending.handoff_s_per_token() == pytest.approx(3e-6, rel=1e-3)
        (short,) = dispatches(h.admit(make_spec("short-answer", prompt_len=30_000, max_tokens=3)))
        assert isinstance(short.task, LocalTask) and short.worker_id != lent  # 45 ms a token to hand over
        (long,) = dispatches(h.admit(make_spec("long-answer", prompt_len=30_000, max_tokens=300)))
        assert isinstance(long.task, PrefillTask) and long.worker_id != lent  # 0.3 ms a token

    def lent_holding(self, cached: int, left: int) -> tuple[Colocated, str, list[int]]:
        """``lent_and_quick``, with ``cached`` tokens of a document on the lent worker's
        device; the core, the lent worker, and a follow-up's prompt: the document and
        ``left`` tokens more."""
        from switchyard.schemas import KvSnapshot

        h = self.core()
        lent = self.lent_and_quick(h)
        doc = make_spec("doc", prompt_len=cached)
        h.core.index.load_snapshot(KvSnapshot(worker_id=lent, seq=0, blocks={"device": doc.block_keys}))
        return h, lent, doc.prompt_tokens + make_spec("x", prompt_len=left).prompt_tokens

    def test_a_prompt_whose_prefix_the_lent_worker_holds_prefills_there(self) -> None:
        # 9,000 tokens to compute on a prefill worker; 1,000 on the lent one (four TPOT SLOs
        # at 8,000 tokens/s is 1,600): the lent one, to prefill and decode there
        h, lent, prompt = self.lent_holding(8_000, 1_000)
        (turn,) = dispatches(h.admit(make_spec("turn-2", prompt=prompt)))
        assert (turn.worker_id, type(turn.task)) == (lent, LocalTask)
        # ...one prompt at a time: the next such turn goes to a prefill worker
        (other,) = dispatches(h.admit(make_spec("turn-2b", prompt=prompt)))
        assert isinstance(other.task, PrefillTask) and other.worker_id != lent

    def test_a_cached_prefix_too_short_to_pay_keeps_the_prompt_off_the_lent_worker(self) -> None:
        h, lent, prompt = self.lent_holding(1_000, 4_000)  # 4,000 left to compute there: over 1,600
        (turn,) = dispatches(h.admit(make_spec("turn-2", prompt=prompt)))
        assert isinstance(turn.task, PrefillTask) and turn.worker_id != lent

    def test_slow_lent_decodes_close_the_lane(self) -> None:
        h = self.core()
        lent = self.lent_and_quick(h)
        for _ in range(60):
            h.core._lending.observe(True, 0.82 * TPOT_SLO)
        for i in range(2):
            h.admit(make_spec(f"long{i}", prompt_len=8_000))
        (short,) = dispatches(h.admit(make_spec("short", prompt_len=100)))
        assert isinstance(short.task, PrefillTask) and short.worker_id != lent


# --- disaggregation per request: a handoff that would cost the answer its TPOT ----------------------


def test_the_handoffs_cost_a_token_is_the_slope_of_their_times_not_the_step_they_join() -> None:
    lending = Lending(SchedulerConfig(tpot_slo_s=TPOT_SLO))
    assert lending.handoff_s_per_token() is None
    lending.observe_handoff(0.05 + 1_000 * 3e-6, 1_000)
    assert lending.handoff_s_per_token() is None  # one prompt length: no slope yet
    for _ in range(50):
        lending.observe_handoff(0.05 + 20_000 * 3e-6, 20_000)  # a 50 ms step joined, 3 us a token moved
        lending.observe_handoff(0.05 + 2_000 * 3e-6, 2_000)
    assert lending.handoff_s_per_token() == pytest.approx(3e-6, rel=1e-6)
    for broken in (float("nan"), float("inf"), -1.0):
        lending.observe_handoff(broken, 50_000)  # a broken worker's figures change nothing
    assert lending.handoff_s_per_token() == pytest.approx(3e-6, rel=1e-6)


@pytest.mark.parametrize(
    ("prompt", "max_tokens", "local"),
    [
        (40_000, 5, True),  # 120 ms of handoff over 4 tokens: 30 ms a token, over a quarter of 50
        (40_000, 200, False),  # the same over 199 tokens: 0.6 ms
        (4_000, 5, False),  # 3 ms a token
    ],
)
def test_a_request_decodes_where_it_was_prefilled_when_its_handoff_would_cost_its_tpot(
    prompt: int, max_tokens: int, local: bool
) -> None:
    lending = Lending(SchedulerConfig(tpot_slo_s=TPOT_SLO))
    assert not lending.keeps_local(prompt, max_tokens)  # nothing measured: handed over
    for size in (2_000, 20_000):
        lending.observe_handoff(0.05 + size * 3e-6, size)
    assert lending.keeps_local(prompt, max_tokens) is local
    assert not Lending(SchedulerConfig(tpot_slo_s=0.0)).keeps_local(prompt, max_tokens)  # no TPOT SLO


# --- disaggregated, the prefill workers colocated ones: lent to decoding beside the decode workers ---


def decode(worker_id: str, sequences: int = 0) -> WorkerState:
    worker = WorkerState(worker_id, "decode", token_budget=10_000, block_size=16, last_seen=0.0)
    for i in range(sequences):
        worker.assign_decode(f"{worker_id}-seq{i}", 100, ())
    return worker


def test_beside_decode_workers_colocated_ones_hand_over_and_slow_decodes_there_lend_one() -> None:
    fleet = colocated_fleet(both("a"), both("b", held=1), both("c"), decode("d0", 3), decode("d1", 2))
    assert fleet.hands_over and not fleet.lent  # every decode is handed over, to a decode worker
    assert fleet.takes_handovers(fleet.workers["d0"]) and not fleet.takes_handovers(fleet.workers["b"])
    lending = Lending(SchedulerConfig(tpot_slo_s=TPOT_SLO))
    never = lambda: False  # noqa: E731
    lending.observe(False, 2 * TPOT_SLO)  # a decode kept on a colocated worker: not what lends here
    assert lending.decide(fleet, never, 10.0, now=0.0) is None
    lending.observe(True, SLOW)  # the decode workers' decodes run slow
    assert lending.decide(fleet, never, 10.0, now=1.0) == "b" and list(fleet.lent) == ["b"]
    fleet.check_invariants()


def test_beside_decode_workers_a_handover_goes_to_the_taker_decoding_fewest_then_spills() -> None:
    fleet = colocated_fleet(both("a"), both("b"), decode("d0", 3), decode("d1", 2))
    fleet.lend("b")
    assert pick_decode(fleet, 100).worker_id == "b"  # lent, decoding nothing
    for i in range(3):
        fleet.workers["b"].hold(f"b-seq{i}", 100)
    assert pick_decode(fleet, 100).worker_id == "d1"  # a decode worker decoding fewer
    assert pick_decode(fleet, 9_950).worker_id == "a"  # room nowhere that takes handovers: it spills


@pytest.mark.parametrize(("tpot_share", "given_back"), [(0.5, True), (0.59, False)])
def test_beside_decode_workers_a_lent_worker_comes_back_only_if_the_rest_would_stay_quick(
    tpot_share: float, given_back: bool
) -> None:
    # Two decode workers and one lent, quick (under 0.6 of the SLO): with one taker fewer the
    # same decodes spread over two, half as much again on each; at 0.59 of the SLO that is
    # 0.885, past the share that lends a worker, and it would be lent again at once.
    fleet = colocated_fleet(both("a"), both("b", held=2), both("c"), decode("d0"), decode("d1"))
    fleet.lend("b")
    lending = Lending(SchedulerConfig(tpot_slo_s=TPOT_SLO))
    lending.observe(True, tpot_share * TPOT_SLO)
    assert (lending.decide(fleet, lambda: True, 10.0, now=0.0) == "b") is given_back
    # A fleet of colocated workers alone takes back by the lent decodes' own measure, as before.
    fleet, lending = two_lent_decoding_quick()
    lending.observe(True, 0.59 * TPOT_SLO)
    assert lending.decide(fleet, lambda: True, 10.0, now=0.0) == "c"


class TestBesideDecodeWorkers:
    """The core on two colocated workers and a decode worker, with a TPOT SLO."""

    @staticmethod
    def core() -> Colocated:
        h = Colocated(policy="switchyard", ttft_slo_s=2.0, tpot_slo_s=TPOT_SLO, worker_expiry_s=1_000.0)
        for i in range(2):
            h.report(f"c{i}", role="both", budget=BOTH_BUDGET)
        h.report("d0", role="decode", budget=BOTH_BUDGET)
        return h

    def test_prompts_are_handed_over_to_the_decode_worker_until_its_slow_decodes_lend_one(self) -> None:
        h = self.core()
        spec = make_spec("first", prompt_len=1_000, max_tokens=21)
        (prefill,) = dispatches(h.admit(spec))
        assert isinstance(prefill.task, PrefillTask) and prefill.worker_id != "d0"  # not a LocalTask
        (handoff,) = dispatches(h.event(prefill_done(spec, prefill.worker_id, prefill_s=0.1)), DecodeTask)
        assert handoff.worker_id == "d0" and not h.core.fleet.lent
        h.clock.advance(10.0)  # 0.5 s a token
        h.event(request_finished(spec, "d0", generated=21))
        (lent,) = h.core.fleet.lent
        assert h.core.workers[lent].role == "both"
        nxt = make_spec("next", prompt_len=1_000, max_tokens=21)
        (prefill,) = dispatches(h.admit(nxt))
        assert isinstance(prefill.task, PrefillTask) and prefill.worker_id not in (lent, "d0")
        (handoff,) = dispatches(h.event(prefill_done(nxt, prefill.worker_id)), DecodeTask)
        assert handoff.worker_id == lent  # decoding fewest of those that take handovers
        assert lent in h.core.fleet.lent and "next" in h.core.workers[lent].held

    def test_a_peer_never_lends_beside_decode_workers(self) -> None:
        h = Colocated(policy="llmd", ttft_slo_s=2.0, tpot_slo_s=TPOT_SLO, worker_expiry_s=1_000.0)
        for i in range(2):
            h.report(f"c{i}", role="both", budget=BOTH_BUDGET)
        h.report("d0", role="decode", budget=BOTH_BUDGET)
        spec = make_spec("first", prompt_len=1_000, max_tokens=21)
        (prefill,) = dispatches(h.admit(spec))
        assert isinstance(prefill.task, PrefillTask)
        (handoff,) = dispatches(h.event(prefill_done(spec, prefill.worker_id, prefill_s=0.1)), DecodeTask)
        h.clock.advance(10.0)
        h.event(request_finished(spec, handoff.worker_id, generated=21))
        assert not h.core.fleet.lent


def test_beside_decode_workers_colocated_ones_are_placed_as_prefill_workers_are() -> None:
    # A colocated worker that decodes what it prefills has its queue weighed and, on a busy
    # fleet, no spreading of ties by fill time; one that hands every decode over does as a
    # prefill worker does (on tool agents at light load: 21 TPOT misses against 13 otherwise).
    from switchyard.scheduler.policies import queue_weight, spreads

    fleet = colocated_fleet(both("a"), both("b"))
    fleet.busy = False
    assert queue_weight(fleet) > 0 and spreads(fleet)
    fleet.busy = True
    assert queue_weight(fleet) == 0 and not spreads(fleet)
    fleet.add(decode("d0"))
    assert queue_weight(fleet) == 0 and spreads(fleet)
    fleet.busy = False
    assert queue_weight(fleet) == 0


def test_beside_decode_workers_a_colocated_workers_kv_is_decode_capacity_only_where_the_core_lends() -> None:
    # A peer never lends: counting the colocated workers' KV would admit requests against
    # room no decode is ever sent to. ``switchyard`` with a TPOT SLO may lend any of them.
    for lends in (False, True):
        fleet = Fleet()
        fleet.lends = lends
        for worker in (both("a"), both("b"), decode("d0")):
            fleet.add(worker)
        assert fleet.decode_capacity == 10_000 + (20_000 if lends else 0)
        fleet.remove("d0")  # colocated workers alone: each decodes what it prefills
        assert fleet.decode_capacity == 20_000
        fleet.check_invariants()
    for policy, tpot_slo_s, lends in (
        ("llmd", TPOT_SLO, False),
        ("switchyard", 0.0, False),
        ("switchyard", TPOT_SLO, True),
    ):
        h = Colocated(policy=policy, ttft_slo_s=2.0, tpot_slo_s=tpot_slo_s)
        assert h.core.fleet.lends is lends, policy


def test_a_peer_deploys_a_colocated_worker_beside_decode_workers_as_a_prefill_worker() -> None:
    from switchyard.scheduler.peers import role_of

    fleet = colocated_fleet(both("a"))
    assert role_of(fleet.workers["a"]) == "both"  # aggregated: Dynamo tracks its active blocks
    fleet.add(decode("d0"))
    assert role_of(fleet.workers["a"]) == "prefill" and role_of(fleet.workers["d0"]) == "decode"


def test_a_short_answer_on_an_idle_colocated_worker_decodes_in_place_once_handoffs_are_measured() -> None:
    lending = Lending(SchedulerConfig(tpot_slo_s=TPOT_SLO))
    assert not lending.keeps_idle_local(1_000, 2)  # nothing measured: handed over
    for size in (2_000, 20_000):
        lending.observe_handoff(0.03 + size * 1e-6, size)  # a 30 ms report-and-step, 1 us a token
    # Its whole handoff (32 ms at 2,000 tokens) over one token after the first: past a quarter
    # of the SLO (12.5 ms); over four tokens, 8 ms: not.
    assert lending.keeps_idle_local(2_000, 2) and not lending.keeps_idle_local(2_000, 5)
    assert not lending.keeps_local(2_000, 2)  # the colocated rule counts the transfer only: 2 ms


class TestShortAnswersBesideDecodeWorkers:
    @staticmethod
    def measured() -> Colocated:
        """Two colocated workers and a decode worker, handoffs to it measured: 30 ms and 1 us
        a prompt token, its steps 20 ms (quick: nothing is lent)."""
        h = TestBesideDecodeWorkers.core()
        for i, size in enumerate((2_000, 20_000)):
            spec = make_spec(f"h{i}", prompt_len=size, max_tokens=21)
            (prefill,) = dispatches(h.admit(spec))
            (handoff,) = dispatches(h.event(prefill_done(spec, prefill.worker_id, prefill_s=0.1)), DecodeTask)
            assert handoff.worker_id == "d0"
            h.clock.advance(0.03 + size * 1e-6 + 19 * 0.02)
            h.event(request_finished(spec, "d0", generated=21, step_s=0.02))
        assert not h.core.fleet.lent
        return h

    def test_on_an_idle_fleet_a_one_step_answer_decodes_where_it_was_prefilled(self) -> None:
        h = self.measured()
        (short,) = dispatches(h.admit(make_spec("short", prompt_len=2_000, max_tokens=2)))
        assert isinstance(short.task, LocalTask) and short.worker_id != "d0"
        (longer,) = dispatches(h.admit(make_spec("longer", prompt_len=2_000, max_tokens=3)))
        assert isinstance(longer.task, PrefillTask)  # a second step could wait behind a prompt placed meanwhile

    def test_behind_another_prompt_or_on_a_busy_fleet_it_is_handed_over(self) -> None:
        h = self.measured()
        for i in range(2):  # a prompt on each colocated worker
            (busy,) = dispatches(h.admit(make_spec(f"long{i}", prompt_len=8_000, max_tokens=40)))
            assert isinstance(busy.task, PrefillTask)
        (short,) = dispatches(h.admit(make_spec("short", prompt_len=500, max_tokens=2)))
        assert isinstance(short.task, PrefillTask)
        h = self.measured()
        h.core._busy = 0.9  # the fleet has been busy lately
        (short,) = dispatches(h.admit(make_spec("short", prompt_len=2_000, max_tokens=2)))
        assert isinstance(short.task, PrefillTask)
