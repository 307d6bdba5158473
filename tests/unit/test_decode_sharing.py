"""A decode worker holds a prompt block its decodes share once: the scheduler's ledger, its
decode placement and the worker's own room check all count it so (``SharedBlocks``)."""

from __future__ import annotations

import math
import random

import pytest

from switchyard.scheduler import FailStream
from switchyard.scheduler.placement import _SHARE_WEIGHT
from switchyard.schemas import (
    Admitted,
    DecodeTask,
    KvSnapshot,
    PromptUsage,
    SharedBlocks,
    SimKvHandle,
)
from switchyard.workers.decode import DecodeRole
from switchyard.workers.sim import SimEngine, SimEngineConfig
from tests.support.factories import BLOCK_SIZE, make_spec, prefill_done, prompt_of, request_finished, worker_leaving
from tests.unit.test_decode_role import RecordingBus, _run
from tests.unit.test_scheduler_core import Harness, cluster, dispatched


@pytest.fixture
def anyio_backend():
    return "asyncio"


# --- the count -------------------------------------------------------------------------


def test_a_block_is_counted_once_however_many_hold_it() -> None:
    shared = SharedBlocks(16)
    assert shared.sharing([1, 2, 3]) == 0
    assert shared.add("a", [1, 2, 3]) == 0
    assert shared.sharing([1, 2, 9]) == 32  # the leading blocks held, up to the first that is not
    assert shared.sharing([9, 2, 3]) == 0
    assert shared.add("b", [1, 2, 9]) == 32
    assert shared.add("c", [1, 7]) == 16
    assert shared.saved == 48  # block 1 held thrice, block 2 twice
    assert shared.remove("a") == 32  # blocks 1 and 2 are still held by b (and 1 by c): 3 is gone
    assert shared.saved == 16
    assert shared.remove("a") == 0  # not held: nothing moves
    assert shared.remove("b") == 16
    assert shared.remove("c") == 0
    assert shared.saved == 0 and len(shared) == 0
    shared.check(set())


def test_saved_is_what_the_counts_say_through_random_adds_and_removes() -> None:
    seed = random.randrange(2**32)
    rng = random.Random(seed)
    shared, held, live = SharedBlocks(4), 0, {}
    for step in range(2_000):
        if live and rng.random() < 0.45:
            rid = rng.choice(sorted(live))
            shared.remove(rid)
            live.pop(rid)
        else:
            rid = f"r{step}"
            # Chained keys: a prompt is a path down a small tree of prefixes.
            keys, node = [], 0
            for _ in range(rng.randrange(1, 8)):
                node = node * 3 + rng.randrange(1, 4)
                keys.append(node)
            assert shared.sharing(keys) == shared.add(rid, keys), seed
            live[rid] = keys
        held = len({k for keys in live.values() for k in keys}) * 4
        assert sum(len(k) for k in live.values()) * 4 - shared.saved == held, seed
        shared.check(live)


# --- the scheduler -----------------------------------------------------------------------

PREFIX = prompt_of(36 * BLOCK_SIZE, start=11)  # 576 tokens, 36 full blocks
# Prompts that must share nothing with PREFIX name their own start: ``make_spec``'s counter
# reaches 11 in some orders of the suite (pytest-xdist), which gives PREFIX itself.


def _spec(rid: str, tail: int, prefix: list[int] = PREFIX, max_tokens: int = 10):
    return make_spec(rid, prompt=prefix + prompt_of(24, start=tail), max_tokens=max_tokens)


def _prefilled(h: Harness, spec) -> list:
    """Admit ``spec``, prefill it on p0, and return the actions of its PrefillDone."""
    assert dispatched(h.admit(spec)) == [(spec.request_id, "p0")]
    return h.event(prefill_done(spec, "p0"))


def test_a_decode_sharing_a_prompt_fits_where_its_whole_kv_would_not() -> None:
    h = Harness()
    cluster(h, {"p0": 100_000}, {"d0": 1000, "d1": 1000})
    a, c, b = _spec("a", 1), make_spec("c", prompt=prompt_of(600, start=2_001), max_tokens=10), _spec("b", 2)
    assert dispatched(_prefilled(h, a), DecodeTask) == [("a", "d0")]
    assert dispatched(_prefilled(h, c), DecodeTask) == [("c", "d1")]
    assert h.load("d0") == h.load("d1") == 610
    # b's 610 tokens fit neither worker whole; on d0 it holds 576 of them with a already.
    assert dispatched(_prefilled(h, b), DecodeTask) == [("b", "d0")]
    assert h.load("d0") == 610 + 610 - 576
    h.event(request_finished(a, "d0"))  # b alone holds the prefix now, all of it its own
    assert h.load("d0") == 610
    h.event(request_finished(b, "d0"))
    assert h.load("d0") == 0


def test_a_decode_goes_where_its_prompt_is_held_unless_another_is_emptier_still() -> None:
    h = Harness()
    cluster(h, {"p0": 100_000}, {"d0": 10_000, "d1": 10_000})
    a, c = _spec("a", 1), make_spec("c", prompt=prompt_of(300, start=2_002), max_tokens=10)
    assert dispatched(_prefilled(h, a), DecodeTask) == [("a", "d0")]
    assert dispatched(_prefilled(h, c), DecodeTask) == [("c", "d1")]
    # d0 holds 610 and d1 310, but b would add 34 to d0 and 610 to d1.
    assert dispatched(_prefilled(h, _spec("b", 2)), DecodeTask) == [("b", "d0")]
    # Another prompt's decode shares nothing: the emptier worker takes it.
    other = _spec("e", 3, prefix=prompt_of(36 * BLOCK_SIZE, start=99))
    assert dispatched(_prefilled(h, other), DecodeTask) == [("e", "d1")]


def test_blocks_of_another_size_are_not_shared() -> None:
    h = Harness()
    cluster(h, {"p0": 100_000}, {"d0": 1000})  # the workers' blocks are of BLOCK_SIZE
    prompt = PREFIX + prompt_of(24, start=5)
    a = make_spec("a", prompt=prompt, max_tokens=10, block_size=2 * BLOCK_SIZE)
    b = make_spec("b", prompt=prompt, max_tokens=10, block_size=2 * BLOCK_SIZE)
    assert dispatched(_prefilled(h, a), DecodeTask) == [("a", "d0")]
    assert dispatched(_prefilled(h, b), DecodeTask) == []  # 1,220 tokens: it waits for room
    assert h.load("d0") == 610


def test_a_cancelled_or_lost_decode_gives_back_what_it_alone_held() -> None:
    h = Harness()
    cluster(h, {"p0": 100_000}, {"d0": 10_000})
    a, b = _spec("a", 1), _spec("b", 2)
    _prefilled(h, a), _prefilled(h, b)
    assert h.load("d0") == 610 + 34
    h.cancel("b")
    assert h.load("d0") == 610
    h.cancel("a")
    assert h.load("d0") == 0
    # A worker lost with shared decodes on it takes its count of them along (the harness
    # checks the fleet's totals and holders after every step).
    c, d = _spec("c", 3), _spec("d", 4)
    _prefilled(h, c), _prefilled(h, d)
    assert h.core.fleet.decode_saved == 576
    failed = h.event(worker_leaving("d0"))
    assert sorted(f.request_id for f in failed if isinstance(f, FailStream)) == ["c", "d"]
    assert h.core.fleet.decode_saved == 0 and h.core.fleet.decode_sharing(_spec("e", 5)) is None


# --- the worker ------------------------------------------------------------------------


def _task(spec) -> DecodeTask:
    return DecodeTask(
        spec=spec,
        handle=SimKvHandle(worker_id="p", block_keys=spec.block_keys, num_tokens=len(spec.prompt_tokens)),
        first_token=7,
        usage=PromptUsage(prompt_tokens=len(spec.prompt_tokens), cached_tokens=0),
    )


@pytest.mark.anyio
async def test_the_worker_takes_what_the_ledger_counts_and_gives_it_back() -> None:
    role, bus = DecodeRole(SimEngine(SimEngineConfig(), "d"), "d", 1000), RecordingBus()
    a, b, c = (
        _spec("a", 1, max_tokens=20),
        _spec("b", 2, max_tokens=20),
        make_spec("c", prompt=prompt_of(600, start=2000)),
    )
    assert role.offer(_task(a), {}) is None
    # c shares no block with a (a generated prompt could: ``make_spec``'s counter starting at 11
    # gives PREFIX itself, which made this depend on the tests run before it in the process)
    assert role.offer(_task(c), {}) == "no KV capacity"  # 620 + 608: over 1,000
    assert role.offer(_task(b), {}) is None  # 620 + 44: its prefix is a's
    assert role.inflight_tokens() == 620 + 620 - 576
    await _run(role, bus, lambda: len(bus.events) == 2)
    assert role.inflight_tokens() == 0 and role.running() == 0
    assert role.offer(_task(c), {}) is None


def test_a_task_delivered_twice_starts_one_decode() -> None:
    role = DecodeRole(SimEngine(SimEngineConfig(), "d"), "d", 10_000)
    a = _spec("a", 1)
    assert role.offer(_task(a), {}) is None
    assert role.offer(_task(a), {}) == "already decoding"
    assert role.running() == 1 and role.inflight_tokens() == 610


def _cached_on(h: Harness, worker: str, keys: list[int]) -> None:
    """``worker``'s cache holds ``keys`` on its device (handed over before, still there)."""
    h.core.on_kv_snapshot(KvSnapshot(worker_id=worker, seq=0, blocks={"device": keys}), h.clock.now)


def test_a_decode_goes_where_its_prompt_is_cached_already() -> None:
    """Blocks a decode worker still has on its device need no handoff (its connector loads
    only what the device lacks): they count off that worker's load in the pick, as blocks
    shared with its decodes do (not off its room: reused, they are held again)."""
    h = Harness()
    cluster(h, {"p0": 100_000}, {"d0": 10_000, "d1": 10_000})
    a = _spec("a", 1)
    _cached_on(h, "d1", a.block_keys[:36])
    assert dispatched(_prefilled(h, a), DecodeTask) == [("a", "d1")]  # idle both: d0 on a tie


@pytest.mark.parametrize("spare", [-1, 1])
def test_a_cached_prompt_weighs_its_tokens_share_weight_times_no_more(spare: int) -> None:
    """d0 holds ``big`` (2,010 tokens), d1 nothing: ``a`` goes to d0 only if the tokens of it
    d0 caches, ``_SHARE_WEIGHT`` times, outweigh those 2,010."""
    h = Harness()
    cluster(h, {"p0": 100_000}, {"d0": 10_000, "d1": 10_000})
    big = make_spec("big", prompt=prompt_of(2_000, start=2_003), max_tokens=10)
    assert dispatched(_prefilled(h, big), DecodeTask) == [("big", "d0")]
    a = _spec("a", 1)
    blocks = math.floor(2_010 / (_SHARE_WEIGHT * BLOCK_SIZE)) + (1 if spare > 0 else 0)
    _cached_on(h, "d0", a.block_keys[:blocks])
    assert dispatched(_prefilled(h, a), DecodeTask) == [("a", "d0" if spare > 0 else "d1")]


def test_decodes_sharing_a_prompt_stay_together_while_it_outweighs_the_load() -> None:
    """Two decode workers, one holding a long document's decodes: a further question about the
    document goes there, though the other is lighter by more than the document (at weight 1
    it went to the other, which then held the document too)."""
    h = Harness()
    cluster(h, {"p0": 100_000}, {"d0": 100_000, "d1": 100_000})
    doc = list(range(1_000, 1_000 + 64 * BLOCK_SIZE))  # 1,024 tokens
    first = make_spec("q1", prompt=doc + [7] * BLOCK_SIZE, max_tokens=10)
    assert dispatched(_prefilled(h, first), DecodeTask) == [("q1", "d0")]  # d0 1,050
    x = make_spec("x", prompt=prompt_of(1_500, start=2_004), max_tokens=10)
    assert dispatched(_prefilled(h, x), DecodeTask) == [("x", "d1")]  # d1 1,510
    y = make_spec("y", prompt=prompt_of(2_000, start=2_005), max_tokens=10)
    assert dispatched(_prefilled(h, y), DecodeTask) == [("y", "d0")]  # d0 3,060: heavier by 1,550
    second = make_spec("q2", prompt=doc + [8] * BLOCK_SIZE, max_tokens=10)
    assert dispatched(_prefilled(h, second), DecodeTask) == [("q2", "d1" if _SHARE_WEIGHT <= 1.5 else "d0")]


# --- decodes that run slow take no more -----------------------------------------------------


def _slow_fleet(policy: str = "switchyard") -> Harness:
    h = Harness(policy=policy, ttft_slo_s=2.0, tpot_slo_s=0.05)
    cluster(h, {"p0": 100_000}, {"d0": 100_000, "d1": 100_000})
    return h


def _decode(h: Harness, spec, seconds: float, step_s: float) -> str:
    """Prefill and hand ``spec`` over at once; finish its decode ``seconds`` later, its
    worker having measured ``step_s`` a step."""
    (worker,) = [w for _, w in dispatched(_prefilled(h, spec), DecodeTask)]
    h.clock.advance(seconds)
    h.event(request_finished(spec, worker, step_s=step_s))
    return worker


def _three_after(h: Harness, per_token_s: float, handoff_s: float = 0.0) -> tuple[list[str], Harness]:
    """40 decodes of 9 tokens after the first at ``per_token_s`` (after a handoff of
    ``handoff_s``), then three more handed over at once: the workers they went to."""
    for i in range(40):
        spec = make_spec(f"before{i}", prompt_len=100, max_tokens=10)
        _decode(h, spec, handoff_s + 9 * per_token_s, per_token_s)
    specs = [make_spec(r, prompt_len=100, max_tokens=10) for r in "abc"]
    return [w for spec in specs for _, w in dispatched(_prefilled(h, spec), DecodeTask)], h


def test_decodes_running_slow_take_no_more_but_on_an_idle_worker() -> None:
    placed, h = _three_after(_slow_fleet(), 0.06)  # 60 ms a token against a 50 ms SLO
    assert placed == ["d0", "d1"]  # each to an idle worker; c waits for room
    assert h.phase("c") == "awaiting_decode"
    reply, _ = h.submit(make_spec("d", prompt=prompt_of(100, start=2_011), max_tokens=10))
    assert reply.reason == "overloaded" and "wait for room" in reply.message  # type: ignore[union-attr]
    h.clock.advance(0.2)
    assert dispatched(h.event(request_finished(h.core.requests["a"].spec, "d0")), DecodeTask) == [("c", "d0")]


def test_decodes_running_quick_share_a_worker() -> None:
    placed, _ = _three_after(_slow_fleet(), 0.02)
    assert placed == ["d0", "d1", "d0"]


def test_a_slow_handoff_is_not_a_slow_decode() -> None:
    """Decodes that stepped quickly after a long KV handoff (a long prompt, a short answer:
    90 ms a token from placement) leave the decode workers open: refusing requests would
    not shorten a handoff, and the fleet may be idle."""
    placed, h = _three_after(_slow_fleet(), 0.02, handoff_s=0.63)
    assert placed == ["d0", "d1", "d0"]
    assert isinstance(h.submit(make_spec("d", prompt=prompt_of(100, start=2_012), max_tokens=10))[0], Admitted)


def test_decodes_of_one_step_teach_nothing() -> None:
    h = _slow_fleet()
    for i in range(40):  # two tokens each, 500 ms apart: one step, no step time
        _decode(h, make_spec(f"short{i}", prompt_len=100, max_tokens=2), 0.5, 0.0)
    specs = [make_spec(r, prompt_len=100, max_tokens=10) for r in "abc"]
    assert [w for spec in specs for _, w in dispatched(_prefilled(h, spec), DecodeTask)] == ["d0", "d1", "d0"]


@pytest.mark.parametrize("garbage", [math.inf, math.nan, -1.0])
def test_a_step_time_that_is_no_time_teaches_nothing(garbage: float) -> None:
    """A broken worker's step time (NaN or inf would stay in the average for good) is
    ignored: the decode workers stay open."""
    h = _slow_fleet()
    _decode(h, make_spec("broken", prompt=prompt_of(100, start=2_013), max_tokens=10), 0.2, garbage)
    placed, h = _three_after(h, 0.02)
    assert placed == ["d0", "d1", "d0"]


def test_the_peers_decode_whatever_the_time_per_token() -> None:
    placed, _ = _three_after(_slow_fleet("dynamo_kv"), 0.06)
    assert placed == ["d0", "d1", "d0"]


# --- colocated workers -----------------------------------------------------------------------


def test_a_lent_worker_holds_a_shared_prompt_once_and_takes_a_decode_sharing_it() -> None:
    from switchyard.scheduler.lending import pick_decode
    from tests.unit.test_lending import both, colocated_fleet

    fleet = colocated_fleet(both("a"), both("b"))  # 10,000 KV tokens each
    fleet.lend("b")
    lent = fleet.workers["b"]
    a, b = _spec("a", 1, max_tokens=2_750), _spec("b", 2, max_tokens=2_750)  # 3,350 KV tokens each
    lent.hold_decode("a", 3_350, math.inf, a.block_keys)
    lent.hold_decode("x", 3_350, math.inf, make_spec("x", prompt=prompt_of(600, start=2_014)).block_keys)
    assert pick_decode(fleet, 3_350, b) is lent  # 6,700 + 3,350 - 576: within 10,000
    assert pick_decode(fleet, 3_350) is fleet.workers["a"]  # counted whole it would not fit
    lent.hold_decode("b", 3_350, math.inf, b.block_keys)
    assert lent.kv_tokens == 3 * 3_350 - 576 and fleet.kv[lent.slot] == lent.kv_tokens
    lent.release("a")
    assert lent.kv_tokens == 2 * 3_350
    fleet.check_invariants()
