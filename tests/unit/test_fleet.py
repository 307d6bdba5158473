"""The fleet's arrays and counters, and placement from them: the very answers of the
per-worker Python they replace (``Fleet``, ``Placer`` given a ``Fleet``)."""

from __future__ import annotations

import itertools
import math
import random

import msgspec
import pytest

from switchyard.scheduler.config import SchedulerConfig
from switchyard.scheduler.index import PrefixIndex
from switchyard.scheduler.placement import Placer
from switchyard.scheduler.state import Fleet, LedgerBlocks, Tracked, WorkerState
from switchyard.schemas import KvSnapshot, Role
from tests.support.factories import BLOCK_SIZE, make_spec

ROLES: tuple[Role, ...] = ("prefill", "prefill", "prefill", "both", "decode")


def new_worker(wid: str, role: Role, rng: random.Random) -> WorkerState:
    budget = rng.choice([2_000, 5_000, 100_000])
    kind = rng.choice(["", "older"])  # two device classes: each learns a factor of its own
    worker = WorkerState(
        worker_id=wid, role=role, token_budget=budget, block_size=BLOCK_SIZE, last_seen=0.0, device_class=kind
    )
    worker.kv_capacity = rng.choice([0, 4_000])
    return worker


def test_counters_and_arrays_follow_every_change() -> None:
    rng, fleet = random.Random(7), Fleet()
    for step in range(400):
        roll = rng.random()
        if roll < 0.3 or not fleet.workers:
            wid = f"w{rng.randrange(60):02d}"
            if wid not in fleet.workers:
                fleet.add(new_worker(wid, rng.choice(ROLES), rng))
        elif roll < 0.4:
            fleet.remove(rng.choice(sorted(fleet.workers)))
        else:
            worker = fleet.workers[rng.choice(sorted(fleet.workers))]
            if worker.assigned and rng.random() < 0.5:
                worker.release(rng.choice(sorted(worker.assigned)))
            else:
                worker.assign(f"r{step}", rng.choice([0, 1, 500]))
            if rng.random() < 0.5:
                worker.prefill_rate = rng.choice([4_000.0, 8_000.0])
            else:
                fleet.learn_rate(worker, rng.choice([3_000.0, 9_000.0]), 0.2, 0.02)
                # Read before ``rate`` is written again (``Fleet.rate_of``): the very same rates.
                lazily = [w.prefill_rate for w in fleet]
                assert lazily == [fleet.rate[w.slot] for w in fleet]
            worker.token_budget = rng.choice([2_000, 5_000])
            worker.kv_capacity = rng.choice([0, 4_000])
            worker.last_seen = float(step)
        fleet.check_invariants()
    assert set(fleet.prefill) | set(fleet.decode) == set(fleet.workers)
    assert list(fleet.prefill) == [w for w, s in fleet.workers.items() if s.role != "decode"]  # join order
    gone = fleet.remove(next(iter(fleet.workers)))
    assert gone is not None and gone.fleet is None
    gone.load_tokens = 12  # no longer mirrored anywhere
    fleet.check_invariants()


def prefill_fleet(
    n: int, first_rate: float = 8_000.0, classes: dict[str, str] | None = None, role: Role = "prefill"
) -> Fleet:
    fleet = Fleet()
    for i in range(n):
        kind = (classes or {}).get(f"p{i}", "")
        worker = WorkerState(
            f"p{i}", role, token_budget=10_000, block_size=BLOCK_SIZE, last_seen=0.0, device_class=kind
        )
        worker.prefill_rate = first_rate if i == 0 else 1.0  # only the first of a role sets the rate
        fleet.add(worker)
    return fleet


def rates(fleet: Fleet) -> list[float]:
    return [w.prefill_rate for w in fleet.workers.values()]


def test_a_new_worker_joins_at_its_roles_rate_and_leaves_the_others_as_they_were() -> None:
    fleet = prefill_fleet(3)
    assert rates(fleet) == [8_000.0] * 3  # not the 1.0 the others came with
    fleet.learn_rate(fleet.workers["p1"], 4_000.0, 0.2, 0.02)
    before = rates(fleet)
    fleet.add(WorkerState("p3", "prefill", token_budget=10_000, block_size=BLOCK_SIZE, last_seen=0.0))
    assert rates(fleet)[:3] == pytest.approx(before) and fleet.workers["p3"].prefill_rate == pytest.approx(
        fleet.shared_rate["prefill"]
    )
    fleet.workers["p0"].prefill_rate = 20_000.0  # set: that worker's alone
    assert rates(fleet) == pytest.approx([20_000.0, *before[1:], fleet.workers["p3"].prefill_rate])
    left = rates(fleet)
    gone = fleet.remove("p0")
    assert gone is not None and gone.prefill_rate == 20_000.0  # what it leaves with
    assert rates(fleet) == pytest.approx(left[1:])
    fleet.check_invariants()


def test_identical_workers_share_one_rate_whatever_each_ones_noise() -> None:
    # Six workers with one true rate, each sample +-30 %: learnt per worker (the old rule,
    # an EWMA of 0.2), their rates spread by the noise, and placement followed the spread;
    # pooled, they stay far closer together.
    rng, fleet = random.Random(3), prefill_fleet(6)
    alone = dict.fromkeys(fleet.workers, 8_000.0)
    spread = {"pooled": 0.0, "alone": 0.0}
    for step in range(3_000):
        wid = rng.choice(sorted(fleet.workers))
        sample = 10_000.0 * rng.uniform(0.7, 1.3)
        fleet.learn_rate(fleet.workers[wid], sample, 0.2, 0.02)
        alone[wid] = 0.8 * alone[wid] + 0.2 * sample
        if step >= 1_000:
            spread["pooled"] += max(rates(fleet)) / min(rates(fleet)) - 1
            spread["alone"] += max(alone.values()) / min(alone.values()) - 1
    assert spread["pooled"] < spread["alone"] / 3, spread
    assert sum(rates(fleet)) / 6 == pytest.approx(10_000.0, rel=0.1)
    fleet.check_invariants()


def test_a_slower_class_of_worker_comes_to_a_rate_of_its_own() -> None:
    # An older GPU, half as fast, named so (``--device-class``): two of them, and two new ones.
    rng, fleet = random.Random(5), prefill_fleet(4, classes={"p0": "new", "p1": "new", "p2": "old", "p3": "old"})
    for _ in range(4_000):
        wid = rng.choice(sorted(fleet.workers))
        true = 5_000.0 if wid in ("p2", "p3") else 10_000.0
        fleet.learn_rate(fleet.workers[wid], true * rng.uniform(0.9, 1.1), 0.2, 0.02)
    got = dict(zip(fleet.workers, rates(fleet), strict=True))
    assert got["p2"] == pytest.approx(5_000.0, rel=0.15) and got["p3"] == got["p2"]  # one class, one rate
    assert got["p0"] == pytest.approx(10_000.0, rel=0.15) and got["p1"] == got["p0"]
    fleet.check_invariants()


def test_workers_of_one_class_keep_one_rate_whatever_work_each_one_is_given() -> None:
    # p0 prefills whole prompts (many tokens a second), the others short suffixes of cached
    # prefixes (few): a factor learnt per worker came to call p0 faster, so it took the next
    # whole prompt too and its cache churned. One class: one rate, the samples' mean.
    rng, fleet = random.Random(7), prefill_fleet(4)
    for _ in range(4_000):
        wid = rng.choice(sorted(fleet.workers))
        fleet.learn_rate(fleet.workers[wid], (13_000.0 if wid == "p0" else 8_000.0) * rng.uniform(0.9, 1.1), 0.2, 0.02)
    got = rates(fleet)
    assert max(got) == min(got)
    assert got[0] == pytest.approx(9_250.0, rel=0.15)
    fleet.check_invariants()


@pytest.mark.parametrize("busy", [False, True], ids=["light", "busy"])
def test_a_colocated_workers_own_factor_is_learnt_only_while_the_fleet_is_busy(busy: bool) -> None:
    # p0 prefills whole prompts, the others short suffixes of cached prefixes (the workload
    # mix, not the GPU): at light load that made p0 look 1.6x faster and take most prompts
    # cached nowhere. Busy, a colocated worker's samples also measure the decodes its prompts
    # share iterations with, its own: there it keeps a factor of its own.
    rng, fleet = random.Random(7), prefill_fleet(4, role="both")
    fleet.busy = busy
    for _ in range(4_000):
        wid = rng.choice(sorted(fleet.workers))
        fleet.learn_rate(fleet.workers[wid], (13_000.0 if wid == "p0" else 8_000.0) * rng.uniform(0.9, 1.1), 0.2, 0.02)
    got = rates(fleet)
    if busy:
        assert got[0] > 1.3 * max(got[1:])
    else:
        assert max(got) == min(got)
        assert got[0] == pytest.approx(9_250.0, rel=0.15)
    fleet.check_invariants()


def test_a_workers_class_leaves_with_it() -> None:
    fleet = prefill_fleet(3, classes={"p2": "old"})
    fleet.remove("p2")
    before = rates(fleet)
    fleet.learn_rate(fleet.workers["p0"], 20_000.0, 0.2, 0.02)  # one class left: the rate is shared
    assert rates(fleet)[0] == rates(fleet)[1] != before[0]
    fleet.check_invariants()


def test_raw_factors_that_drifted_together_are_brought_back_and_the_rates_stay() -> None:
    fleet = prefill_fleet(3)
    fleet.learn_rate(fleet.workers["p1"], 4_000.0, 0.2, 0.02)
    fleet.factor[:3] *= 10.0  # as a long run could drift them: the same rates, other raw factors
    fleet._factor_sum["prefill"] *= 10.0
    fleet.check_invariants()
    before = rates(fleet)
    fleet.learn_rate(fleet.workers["p0"], before[0], 0.2, 0.02)  # a sample of the very rate: no change
    assert rates(fleet) == pytest.approx(before)
    assert fleet._factor_sum["prefill"] / 3 == pytest.approx(1.0, rel=0.05)
    fleet.check_invariants()


def test_with_one_worker_its_rate_is_its_own_ewma() -> None:
    fleet = prefill_fleet(1)
    fleet.learn_rate(fleet.workers["p0"], 4_000.0, 0.2, 0.02)
    assert fleet.workers["p0"].prefill_rate == pytest.approx(0.8 * 8_000 + 0.2 * 4_000)


def test_expired_workers_come_in_join_order() -> None:
    fleet, rng = Fleet(), random.Random(1)
    for i, seen in enumerate([5.0, 0.0, 9.0, 1.0]):
        worker = new_worker(f"w{3 - i}", "prefill", rng)
        worker.last_seen = seen
        fleet.add(worker)
    assert [w.worker_id for w in fleet.expired(10.0, 4.0)] == ["w3", "w2", "w0"]
    assert fleet.expired(10.0, 10.0) == []


def test_a_role_is_fixed() -> None:
    fleet = Fleet()
    fleet.add(new_worker("a", "prefill", random.Random(0)))
    with pytest.raises(AssertionError, match="role is fixed"):
        fleet.workers["a"].role = "decode"


@pytest.mark.parametrize("native", [True, False], ids=["c", "numpy"])
@pytest.mark.parametrize("seed", range(6))
def test_placement_from_the_arrays_is_the_placement_from_the_workers(
    seed: int, native: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Random fleets (slots reused, so slot order is not id order), loads and rates with
    many ties, caches on several tiers: the fleet's vector path places every request where
    the per-worker loop does, prefill (every policy) and decode; in C (``_native.c``) and
    in numpy; decode with the blocks decodes there share (``Fleet.decode_sharing``)."""
    print(f"seed={seed}")
    rng = random.Random(seed)
    roles: tuple[Role, ...] = ROLES if seed % 2 else ("prefill", "prefill", "decode")  # colocated or not
    index = PrefixIndex()
    if native:
        assert index.native, "scheduler/_native.c did not build: `make install` (it needs a C compiler)"
    index.native = native
    fleet = Fleet()
    fleet.native = native  # the decodes' shared blocks too
    monkeypatch.setattr(LedgerBlocks, "native", native)
    ids = [f"w{i:02d}" for i in range(40)]
    rng.shuffle(ids)
    for wid in ids:
        fleet.add(new_worker(wid, rng.choice(roles), rng))
    for wid in rng.sample(ids, 10):  # free slots in the middle, taken again out of id order
        fleet.remove(wid)
        if rng.random() < 0.7:
            fleet.add(new_worker(wid, rng.choice(roles), rng))
    prefixes = [[rng.randrange(1 << 63) for _ in range(8)] for _ in range(6)]
    for wid in rng.sample(sorted(fleet.workers), 25):
        blocks: dict[str, list[int]] = {}
        for tier in ("device", "host", "cluster"):
            if rng.random() < 0.5:
                blocks[tier] = rng.choice(prefixes)[: rng.randrange(1, 9)]
        index.load_snapshot(KvSnapshot(worker_id=wid, seq=0, blocks=blocks))
    index.load_snapshot(KvSnapshot(worker_id="not-in-fleet", seq=0, blocks={"device": prefixes[0]}))
    alone_differs = 0  # switchyard's choices that being alone in the queue changed
    for name in ("switchyard", "dynamo_kv", "least_tokens", "round_robin"):
        config = SchedulerConfig(policy=name, fetch_credit=rng.choice([0.0, 0.8]))
        fast, slow = Placer(config, index), Placer(config, index)
        for i in range(60):
            for worker in fleet:  # ties: a few loads and rates only; many that do not fit
                worker.load_tokens = rng.choice([0, 0, 512, 1024])  # the ledger is not the point here
                worker.prefill_rate = rng.choice([8_000.0, 8_000.0, 7_500.0, 6_000.0])
                worker.token_budget = rng.choice([600, 1_100, 100_000])
                worker.filled_at = float(rng.choice([0, 3, 7]))  # which of the tied took content last
                for rid in [*worker.held, *(r for r in worker.assigned if r.startswith("dec"))]:
                    worker.release(rid)
                if worker.role == "decode" and rng.random() < 0.5:  # decodes sharing a prefix with the prompt
                    prefix = rng.choice(prefixes)[: rng.randrange(1, 9)]
                    worker.assign_decode(f"dec{i}", rng.choice([100, 900, 60_000]), prefix)
                if worker.role == "both" and rng.random() < 0.5:  # its decodes' room: none to plenty
                    worker.placed_tokens += rng.choice([0, 30])
                    worker.hold(f"kv{i}", rng.choice([100, 1_500, 3_900]), rng.choice([math.inf, 0.0, 60.0, 200.0]))
            if rng.random() < 0.5:  # learnt rates, which the C loop reads before they are written
                for worker in rng.sample(sorted(fleet.prefill.values(), key=lambda w: w.worker_id), 3):
                    fleet.learn_rate(worker, rng.choice([5_000.0, 9_000.0]), 0.2, 0.02)
            fleet.decode_slack = rng.random() < 0.5  # the KV decoded weighed, or a tie-break only
            fleet.busy = rng.random() < 0.5  # a colocated worker's queue weighed, or not
            keys = [*rng.choice(prefixes)[: rng.randrange(0, 9)], rng.randrange(1 << 63)]
            spec = msgspec.structs.replace(make_spec(f"r{i}", prompt_len=len(keys) * BLOCK_SIZE - 3), block_keys=keys)
            request = Tracked(spec=spec, enqueued_at=0.0, order=i)
            # With an SLO: all, some or none safe; late (-inf); alone in the queue or not.
            chosen: dict[tuple[float, bool], str | None] = {}
            for budget, alone in itertools.product((math.inf, 0.5, 0.1, 0.001, -math.inf), (False, True)):
                by_slot = fast.prefill(request, fleet, None, budget, alone)
                chosen[budget, alone] = by_slot and by_slot.worker.worker_id
                by_worker = slow.prefill(request, list(fleet), None, budget, alone)
                assert (by_slot is None) == (by_worker is None), (name, i)
                if by_slot is not None and by_worker is not None:
                    assert (by_slot.worker.worker_id, by_slot.kind, by_slot.tokens) == (
                        by_worker.worker.worker_id,
                        by_worker.kind,
                        by_worker.tokens,
                    ), (name, i, budget, alone)
            if name == "switchyard":
                alone_differs += any(chosen[b, False] != chosen[b, True] for b in (0.5, 0.1, 0.001))
                assert all(chosen[b, False] == chosen[b, True] for b in (math.inf, -math.inf)), (i, chosen)
            decoded = fast.decode(request, fleet)
            expected = slow.decode(request, list(fleet))
            assert (decoded and decoded.worker_id) == (expected and expected.worker_id), (name, i)
    assert alone_differs > 0  # the second limit was taken, and compared


@pytest.mark.parametrize("seed", range(4))
def test_a_hold_is_the_same_in_c_and_in_numpy_and_every_choice_fits_it(seed: int) -> None:
    """With ``hold_s`` set (the core's shortest first on a busy fleet), the C loop and the
    numpy path still choose alike, and a worker that hands its prompts over takes a prompt
    only within ``hold_s`` of prefill at its rate, or idle; with none lent, a colocated
    worker keeps its whole budget."""
    rng = random.Random(seed)
    index = PrefixIndex()
    assert index.native, "scheduler/_native.c did not build: `make install` (it needs a C compiler)"
    fleet = Fleet()
    for i in range(12):
        fleet.add(new_worker(f"w{i:02d}", rng.choice(ROLES), rng))
    colocated = [w for w in fleet.prefill.values() if w.role == "both"]
    if seed % 2 and len(colocated) > 1:
        fleet.lend(colocated[0].worker_id)  # then the other colocated ones hand over too
    config = SchedulerConfig(policy="switchyard")
    placer = Placer(config, index)
    changed = 0
    for i in range(200):
        hold_s = rng.choice([0.05, 0.15])
        for worker in fleet:
            worker.load_tokens = rng.choice([0, 0, 300, 900, 3_000])
            worker.prefill_rate = rng.choice([8_000.0, 6_000.0])
        spec = make_spec(f"r{i}", prompt_len=rng.choice([100, 700, 2_500]))
        request = Tracked(spec=spec, enqueued_at=0.0, order=i)
        fleet.hold_s = 0.0
        unheld = placer.prefill(request, fleet, None)
        fleet.hold_s = hold_s
        index.native = True
        in_c = placer.prefill(request, fleet, None)
        index.native = False
        in_numpy = placer.prefill(request, fleet, None)
        assert (in_c and (in_c.worker.worker_id, in_c.tokens)) == (
            in_numpy and (in_numpy.worker.worker_id, in_numpy.tokens)
        ), i
        changed += (in_c and in_c.worker.worker_id) != (unheld and unheld.worker.worker_id)
        if in_c is None:
            continue
        worker = in_c.worker
        if worker.load_tokens and (worker.role == "prefill" or fleet.lent):
            assert worker.load_tokens + in_c.tokens <= min(worker.token_budget, hold_s * worker.prefill_rate), i
    assert changed > 0  # the hold was in play: it moved or held some prompts
