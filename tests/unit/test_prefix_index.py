"""PrefixIndex: tiers, sequence numbers, snapshots, the LRU bound, and a brute-force model;
and the index fed by a real sim engine's cache reports.

Keys are real chained block keys (``kvbus.keys``) where a test is about prompts, and small
ints where it is about the bookkeeping: the index treats a key as an opaque integer.
"""

from __future__ import annotations

import os
import random
import tracemalloc
from collections import OrderedDict
from collections.abc import Iterator

import pytest

from switchyard.kvbus.keys import block_keys, salt_for
from switchyard.scheduler.index import PrefixIndex, WorkerMatch
from switchyard.schemas import (
    AllBlocksCleared,
    BlocksRemoved,
    BlocksStored,
    KvEvent,
    KvEventBatch,
    KvSnapshot,
    PrefillTask,
    codec,
)
from switchyard.workers.kv_events import KvReporter
from switchyard.workers.sim import SimEngine, SimEngineConfig
from tests.support.factories import make_spec, prompt_of

BLOCK = 16
TIERS = ("device", "host", "disk", "cluster")
SEEDS = [int(os.environ["SWITCHYARD_SEED"])] if "SWITCHYARD_SEED" in os.environ else list(range(20))


# --- factories --------------------------------------------------------------------------------


def chain(blocks: int, start: int = 0) -> list[int]:
    """The chained keys of a deterministic prompt of ``blocks`` full blocks."""
    return list(block_keys(prompt_of(blocks * BLOCK, start), BLOCK, salt_for("default", "m")))


def stored(keys: list[int], tier: str = "device") -> BlocksStored:
    return BlocksStored(keys=keys, tier=tier)  # type: ignore[arg-type]


def removed(keys: list[int], tier: str = "device") -> BlocksRemoved:
    return BlocksRemoved(keys=keys, tier=tier)  # type: ignore[arg-type]


def batch(worker: str, seq: int, *events: KvEvent) -> KvEventBatch:
    return KvEventBatch(worker_id=worker, seq=seq, events=list(events))


def snapshot(worker: str, seq: int = 0, **tiers: list[int]) -> KvSnapshot:
    return KvSnapshot(worker_id=worker, seq=seq, blocks=dict(tiers))


def index_with(*workers: str, max_entries: int = 1_000_000) -> PrefixIndex:
    """An index that has had an empty snapshot (seq 0) of each worker."""
    index = PrefixIndex(max_entries)
    for worker in workers:
        index.load_snapshot(snapshot(worker))
    return index


def matches(index: PrefixIndex, keys: list[int], workers=None) -> dict[str, tuple[int, int]]:
    """``match`` as {worker: (device_blocks, blocks)}, checking the index on the way."""
    index.check_invariants()
    return as_pairs(index.match(keys, workers))


def as_pairs(got: dict[str, WorkerMatch]) -> dict[str, tuple[int, int]]:
    assert all(m.worker_id == w and 0 <= m.device_blocks <= m.blocks for w, m in got.items())
    return {w: (m.device_blocks, m.blocks) for w, m in got.items()}


# --- prefixes and tiers -------------------------------------------------------------------------


def test_a_stored_prompt_matches_its_leading_blocks() -> None:
    index = index_with("p1")
    keys = chain(6)
    assert index.apply(batch("p1", 1, stored(keys[:4])))
    assert matches(index, keys) == {"p1": (4, 4)}
    assert matches(index, keys[:2]) == {"p1": (2, 2)}
    assert matches(index, chain(6, start=99)) == {}
    assert index.match([]) == {}


def test_a_missing_block_ends_the_match_even_if_later_ones_are_held() -> None:
    index = index_with("p1")
    keys = chain(5)
    index.apply(batch("p1", 1, stored(keys), removed([keys[2]])))
    assert matches(index, keys) == {"p1": (2, 2)}
    assert matches(index, keys[1:]) == {"p1": (1, 1)}  # a prompt that starts at block 1


def test_each_worker_is_counted_on_its_own() -> None:
    index = index_with("p1", "p2", "p3")
    keys = chain(8)
    index.apply(batch("p1", 1, stored(keys[:8])))
    index.apply(batch("p2", 1, stored(keys[:3])))
    index.apply(batch("p3", 1, stored(keys[1:8])))  # no first block: no match at all
    assert matches(index, keys) == {"p1": (8, 8), "p2": (3, 3)}
    assert matches(index, keys, workers=["p2", "p3", "stranger"]) == {"p2": (3, 3)}


def test_host_and_disk_blocks_count_as_reachable_not_as_device() -> None:
    index = index_with("p1")
    keys = chain(6)
    index.apply(batch("p1", 1, stored(keys[:2]), stored(keys[2:4], "host"), stored(keys[4:], "disk")))
    assert matches(index, keys) == {"p1": (2, 6)}


def test_a_block_on_several_tiers_stays_until_its_last_tier_goes() -> None:
    index = index_with("p1")
    keys = chain(3)
    index.apply(batch("p1", 1, stored(keys), stored(keys, "host")))
    assert index.entries == 3  # one (key, worker) pair each, whatever the tiers
    index.apply(batch("p1", 2, removed(keys)))  # evicted from the GPU, still in host memory
    assert matches(index, keys) == {"p1": (0, 3)}
    index.apply(batch("p1", 3, removed(keys[1:], "host")))
    assert matches(index, keys) == {"p1": (0, 1)}
    assert index.entries == 1


def test_removing_from_a_tier_that_does_not_hold_the_block_changes_nothing() -> None:
    index = index_with("p1")
    keys = chain(2)
    index.apply(batch("p1", 1, stored(keys), removed(keys, "disk"), removed(chain(2, start=5))))
    assert matches(index, keys) == {"p1": (2, 2)}


def test_cluster_blocks_are_reachable_by_every_known_worker() -> None:
    index = index_with("p1", "p2", "d1")
    keys = chain(6)
    index.apply(batch("p1", 1, stored(keys[:4], "cluster"), stored(keys[:2])))
    index.apply(batch("p2", 1, stored(keys[:5], "host")))
    # p1: 2 on device, then blocks 2-3 from the store; p2 its own 5; d1 only the store's 4.
    assert matches(index, keys) == {"p1": (2, 4), "p2": (0, 5), "d1": (0, 4)}
    assert matches(index, keys, workers=["d1"]) == {"d1": (0, 4)}


def test_cluster_blocks_can_bridge_a_gap_in_a_workers_own_blocks() -> None:
    index = index_with("p1", "p2")
    keys = chain(6)
    index.apply(batch("p1", 1, stored(keys[:2]), stored(keys[3:])))
    index.apply(batch("p2", 1, stored([keys[2]], "cluster")))
    assert matches(index, keys) == {"p1": (2, 6)}  # p2 lacks block 0: it matches nothing


def test_a_cluster_block_stays_while_one_reporter_still_reports_it() -> None:
    index = index_with("p1", "p2", "d1")
    keys = chain(2)
    index.apply(batch("p1", 1, stored(keys, "cluster")))
    index.apply(batch("p2", 1, stored(keys, "cluster")))
    index.apply(batch("p1", 2, removed(keys, "cluster")))
    assert matches(index, keys) == {"p1": (0, 2), "p2": (0, 2), "d1": (0, 2)}
    index.forget_worker("p2")
    assert matches(index, keys) == {}


# --- sequence numbers -----------------------------------------------------------------------------


def test_a_worker_never_snapshotted_is_refused() -> None:
    index = PrefixIndex()
    assert not index.knows("p1")
    assert index.apply(batch("p1", 1, stored(chain(2)))) is False
    assert index.entries == 0 and not index.knows("p1")


def test_a_gap_applies_nothing_and_the_next_batch_in_order_still_applies() -> None:
    index = index_with("p1")
    keys = chain(4)
    assert index.apply(batch("p1", 1, stored(keys[:1])))
    assert index.apply(batch("p1", 3, stored(keys))) is False  # batch 2 went missing
    assert matches(index, keys) == {"p1": (1, 1)}
    assert index.apply(batch("p1", 2, stored(keys[:2])))
    assert matches(index, keys) == {"p1": (2, 2)}


def test_a_duplicate_batch_is_ignored_but_accepted() -> None:
    index = index_with("p1")
    keys = chain(3)
    index.apply(batch("p1", 1, stored(keys)))
    index.apply(batch("p1", 2, removed(keys[1:])))
    assert index.apply(batch("p1", 1, stored(keys))) is True  # redelivered: already applied
    assert matches(index, keys) == {"p1": (1, 1)}


def test_batches_after_a_snapshot_apply_on_top_of_it() -> None:
    index = PrefixIndex()
    keys = chain(4)
    index.load_snapshot(snapshot("p1", seq=7, device=keys[:2]))
    assert index.apply(batch("p1", 7, removed(keys))) is True  # already in the snapshot
    assert index.apply(batch("p1", 9, stored(keys))) is False
    assert index.apply(batch("p1", 8, stored(keys[:3])))
    assert matches(index, keys) == {"p1": (3, 3)}


def test_a_snapshot_replaces_everything_known_of_its_worker_only() -> None:
    index = index_with("p1", "p2")
    old, new = chain(3), chain(3, start=50)
    index.apply(batch("p1", 1, stored(old), stored(old, "cluster")))
    index.apply(batch("p2", 1, stored(old[:1])))
    index.load_snapshot(snapshot("p1", seq=4, host=new))
    assert matches(index, old) == {"p2": (1, 1)}
    assert matches(index, new) == {"p1": (0, 3)}
    assert index.apply(batch("p1", 5, stored(new[:1])))


def test_a_snapshot_with_an_unknown_tier_keeps_the_tiers_it_knows() -> None:
    index = PrefixIndex()
    keys = chain(2)
    index.load_snapshot(KvSnapshot(worker_id="p1", seq=0, blocks={"device": keys, "hbm-v9": chain(2, 9)}))
    assert matches(index, keys) == {"p1": (2, 2)}
    assert index.entries == 2


def test_all_blocks_cleared_drops_every_tier_of_that_worker() -> None:
    index = index_with("p1", "p2")
    keys = chain(3)
    index.apply(batch("p1", 1, stored(keys), stored(keys, "disk"), stored(keys, "cluster")))
    index.apply(batch("p2", 1, stored(keys)))
    index.apply(batch("p1", 2, AllBlocksCleared(), stored(keys[:1], "host")))
    assert matches(index, keys) == {"p1": (0, 1), "p2": (3, 3)}


def test_a_forgotten_worker_is_unknown_and_holds_nothing() -> None:
    index = index_with("p1", "p2")
    keys = chain(3)
    index.apply(batch("p1", 1, stored(keys)))
    index.apply(batch("p2", 1, stored(keys)))
    index.forget_worker("p1")
    index.forget_worker("never-there")
    assert not index.knows("p1") and index.knows("p2")
    assert matches(index, keys) == {"p2": (3, 3)}
    assert index.entries == 3
    assert index.apply(batch("p1", 2, stored(keys))) is False  # it must snapshot again


# --- the bound ------------------------------------------------------------------------------------


def test_the_bound_drops_the_least_recently_stored_or_matched_keys() -> None:
    index = index_with("p1", max_entries=6)
    a, b, c = chain(2, 1), chain(2, 2), chain(2, 3)
    index.apply(batch("p1", 1, stored(a), stored(b), stored(c)))
    assert index.entries == 6
    assert matches(index, a) == {"p1": (2, 2)}  # a is now the most recent
    index.apply(batch("p1", 2, stored(chain(2, 4))))  # b, the oldest, makes room
    assert matches(index, b) == {}
    assert matches(index, a) == {"p1": (2, 2)} and matches(index, c) == {"p1": (2, 2)}
    assert index.entries == 6


def test_the_bound_counts_key_worker_pairs_and_drops_leaves_before_their_prefix() -> None:
    index = index_with("p1", "p2", max_entries=5)
    keys = chain(3)
    index.apply(batch("p1", 1, stored(keys)))
    index.apply(batch("p2", 1, stored(keys)))  # 6 pairs: the key stored least recently goes
    assert index.entries <= 5
    # The last block went, not the first: both workers still match the prefix.
    assert matches(index, keys) == {"p1": (2, 2), "p2": (2, 2)}


def test_an_oversized_snapshot_keeps_within_the_bound() -> None:
    index = PrefixIndex(max_entries=10)
    keys = chain(40)
    index.load_snapshot(snapshot("p1", device=keys))
    assert index.entries == 10
    assert matches(index, keys) == {"p1": (10, 10)}  # the prefix survived, not the tail


def test_max_entries_must_be_positive() -> None:
    with pytest.raises(ValueError, match="max_entries"):
        PrefixIndex(0)


class LinkedLru:
    """The bound's meaning, the way the index once kept it: an ``OrderedDict`` of key ->
    holders, a store or a match moves keys to the end (back to front), and while the pairs
    exceed the bound the oldest key goes with all its holders. Device tier only."""

    def __init__(self, workers: tuple[str, ...], bound: int) -> None:
        self.workers, self.bound = workers, bound
        self.keys: OrderedDict[int, set[str]] = OrderedDict()

    def store(self, worker: str, keys: list[int]) -> None:
        for key in reversed(keys):
            self.keys.setdefault(key, set()).add(worker)
            self.keys.move_to_end(key)
            while sum(map(len, self.keys.values())) > self.bound:
                self.keys.popitem(last=False)

    def remove(self, worker: str, keys: list[int]) -> None:
        for key in keys:
            holders = self.keys.get(key, set())
            holders.discard(worker)
            if not holders:
                self.keys.pop(key, None)

    def match(self, keys: list[int]) -> dict[str, tuple[int, int]]:
        reach, out, walked = set(self.workers), {}, []
        for i, key in enumerate(keys):
            kept = reach & self.keys.get(key, set())
            if not kept:
                break
            out |= {w: (i, i) for w in reach - kept if i}
            reach = kept
            walked.append(key)
        for key in reversed(walked):
            self.keys.move_to_end(key)
        return out | {w: (len(walked), len(walked)) for w in reach if walked}


@pytest.mark.parametrize("seed", SEEDS)
def test_the_bound_evicts_exactly_what_a_linked_lru_would(seed: int) -> None:
    """Stamps and a batch of eviction candidates, refreshed again and again (a bound of 60
    is 16 candidates at a time), take the very keys a linked list would, in its order."""
    print(f"seed={seed} (rerun one with SWITCHYARD_SEED={seed})")
    rng, workers = random.Random(seed), ("w0", "w1", "w2")
    index, model = index_with(*workers, max_entries=60), LinkedLru(workers, 60)
    prompts = [chain(rng.randint(1, 8), start=10 * p) for p in range(12)]
    seq = dict.fromkeys(workers, 0)
    for _ in range(400):
        worker, keys = rng.choice(workers), rng.choice(prompts)
        keys = keys[: rng.randint(1, len(keys))]
        roll = rng.random()
        if roll < 0.5:
            seq[worker] += 1
            index.apply(batch(worker, seq[worker], stored(keys)))
            model.store(worker, keys)
        elif roll < 0.7:
            gone = keys[rng.randint(0, len(keys) - 1) :]
            seq[worker] += 1
            index.apply(batch(worker, seq[worker], removed(gone)))
            model.remove(worker, gone)
        assert matches(index, keys) == model.match(keys)
        assert index.entries == sum(map(len, model.keys.values())) <= 60


# --- memory ---------------------------------------------------------------------------------------


def test_approx_bytes_is_within_a_quarter_of_what_is_allocated() -> None:
    rng = random.Random(1)
    keys = [rng.getrandbits(64) for _ in range(20_000)]
    # Four workers, each sharing half its keys with the next; decoded off the wire inside the
    # measurement, as the service does, so the key ints the index keeps are counted.
    wire = [codec.KV_SNAPSHOT.encode(snapshot(f"p{i}", host=keys[i * 4000 : (i + 2) * 4000])) for i in range(4)]
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        index = PrefixIndex()
        for data in wire:
            index.load_snapshot(codec.KV_SNAPSHOT.decode(data))
        allocated = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    estimate = index.approx_bytes()
    print(
        f"{index.entries} pairs on {index._live} keys: approx_bytes {estimate}, "
        f"allocated {allocated} ({allocated / index.entries:.0f} B per pair)"
    )
    assert 0.75 * allocated <= estimate <= 1.25 * allocated


def test_an_empty_index_is_small() -> None:
    assert 0 < PrefixIndex().approx_bytes() < 2_000


# --- seeded property test against a brute-force model ---------------------------------------------


class Model:
    """The index's meaning, computed the slow way: each worker's set of (key, tier)."""

    def __init__(self) -> None:
        self.held: dict[str, set[tuple[int, str]]] = {}

    def apply(self, worker: str, events: list[KvEvent]) -> None:
        held = self.held[worker]
        for event in events:
            match event:
                case BlocksStored():
                    held |= {(k, event.tier) for k in event.keys}
                case BlocksRemoved():
                    held -= {(k, event.tier) for k in event.keys}
                case AllBlocksCleared():
                    held.clear()

    def match(self, keys: list[int], workers=None) -> dict[str, tuple[int, int]]:
        cluster = {k for held in self.held.values() for k, tier in held if tier == "cluster"}
        wanted = self.held.keys() if workers is None else self.held.keys() & set(workers)
        out = {}
        for worker in wanted:
            own = {k for k, tier in self.held[worker] if tier != "cluster"}
            device = {k for k, tier in self.held[worker] if tier == "device"}
            blocks = _leading(keys, own | cluster)
            if blocks:
                out[worker] = (_leading(keys, device), blocks)
        return out


def _leading(keys: list[int], present: set[int]) -> int:
    n = 0
    while n < len(keys) and keys[n] in present:
        n += 1
    return n


class RandomFleet:
    """Random stored/removed/cleared batches, duplicates, gaps, snapshots and departures."""

    WORKERS = ("w0", "w1", "w2", "w3")

    def __init__(self, seed: int, max_entries: int) -> None:
        self.rng = random.Random(seed)
        self.index = PrefixIndex(max_entries)
        self.model = Model()
        self.seq: dict[str, int] = {}
        # Prompts sharing prefixes, as real traffic does: a few roots, branches off them.
        roots = [chain(12, start=s) for s in range(3)]
        self.prompts = [
            r[: self.rng.randint(1, 12)] + chain(self.rng.randint(0, 6), start=100 + i) for i, r in enumerate(roots * 3)
        ]

    def keys(self) -> list[int]:
        prompt = self.rng.choice(self.prompts)
        start = self.rng.randint(0, len(prompt) - 1) if self.rng.random() < 0.2 else 0
        return prompt[start : self.rng.randint(start + 1, len(prompt))]

    def event(self) -> KvEvent:
        roll, tier = self.rng.random(), self.rng.choice(TIERS)
        if roll < 0.6:
            return stored(self.keys(), tier)
        if roll < 0.97:
            return removed(self.keys(), tier)
        return AllBlocksCleared()

    def step(self) -> None:
        self.index.check_invariants()
        worker, roll = self.rng.choice(self.WORKERS), self.rng.random()
        if worker not in self.seq or roll < 0.03:
            self.snapshot(worker)
        elif roll < 0.05:
            self.index.forget_worker(worker)
            del self.model.held[worker], self.seq[worker]
        elif roll < 0.10:
            self.replay_or_skip(worker)
        else:
            events = [self.event() for _ in range(self.rng.randint(1, 4))]
            self.seq[worker] += 1
            assert self.index.apply(batch(worker, self.seq[worker], *events))
            self.model.apply(worker, events)

    def snapshot(self, worker: str) -> None:
        content: dict[str, set[int]] = {t: set() for t in TIERS}
        for _ in range(self.rng.randint(0, 3)):
            content[self.rng.choice(TIERS)] |= set(self.keys())
        self.seq[worker] = self.rng.randint(0, 50)
        self.index.load_snapshot(snapshot(worker, self.seq[worker], **{t: sorted(k) for t, k in content.items()}))
        self.model.held[worker] = {(k, t) for t, keys in content.items() for k in keys}

    def replay_or_skip(self, worker: str) -> None:
        """A duplicate is accepted and changes nothing; a gap is refused and changes nothing."""
        last = self.seq[worker]
        if self.rng.random() < 0.5 and last > 0:
            assert self.index.apply(batch(worker, self.rng.randint(1, last), stored(self.keys()))) is True
        else:
            assert self.index.apply(batch(worker, last + self.rng.randint(2, 5), stored(self.keys()))) is False

    def queries(self) -> Iterator[tuple[dict, dict]]:
        """(index, model) answers to a few random prompts, some for a subset of workers."""
        for _ in range(3):
            keys = self.keys()
            workers = None if self.rng.random() < 0.7 else self.rng.sample(self.WORKERS, 2)
            yield as_pairs(self.index.match(keys, workers)), self.model.match(keys, workers)


@pytest.mark.parametrize("seed", SEEDS)
def test_random_events_match_the_brute_force_model(seed: int) -> None:
    print(f"seed={seed} (rerun one with SWITCHYARD_SEED={seed})")
    fleet = RandomFleet(seed, max_entries=1_000_000)
    for _ in range(300):
        fleet.step()
        for got, want in fleet.queries():
            assert got == want
    assert fleet.index.entries == sum(len({k for k, _ in held}) for held in fleet.model.held.values())


@pytest.mark.parametrize("seed", SEEDS)
def test_a_small_bound_only_ever_under_reports(seed: int) -> None:
    print(f"seed={seed} (rerun one with SWITCHYARD_SEED={seed})")
    fleet = RandomFleet(seed, max_entries=25)
    for _ in range(300):
        fleet.step()
        assert fleet.index.entries <= 25
        for got, want in fleet.queries():
            for worker, (device, blocks) in got.items():
                assert worker in want, (worker, got, want)
                assert device <= want[worker][0] and blocks <= want[worker][1]


def test_match_touches_only_the_workers_that_match() -> None:
    """Linear in the blocks matched: 1,000 workers holding other prefixes cost nothing."""
    index = PrefixIndex()
    for i in range(1000):
        index.load_snapshot(snapshot(f"w{i}", device=chain(4, start=1000 + i)))
    keys = chain(30, start=7)
    index.apply(batch("w3", 1, stored(keys)))
    seen: list[int] = []

    class Counting(list):
        """Counts every worker id the lookup turns a worker bit back into."""

        def __getitem__(self, slot):
            seen.append(slot)
            return super().__getitem__(slot)

    index._ids = Counting(index._ids)
    assert index.match(keys) == {"w3": WorkerMatch("w3", 30, 30)}
    assert set(seen) == {index._slot["w3"]} and len(seen) <= 2  # its blocks and its device blocks


def test_match_slots_is_match_counts_by_worker_slot() -> None:
    fleet = RandomFleet(seed=3, max_entries=1_000_000)
    for _ in range(200):
        fleet.step()
    for _ in range(50):
        keys, index = fleet.keys(), fleet.index
        blocks, device = index.match_counts(keys)
        by_slot, device_by_slot = index.match_slots(keys)
        names = index.worker_slots()
        assert len(by_slot) == len(device_by_slot) == len(names)
        assert {names[s]: int(n) for s, n in enumerate(by_slot) if n} == blocks
        assert {names[s]: int(n) for s, n in enumerate(device_by_slot) if n} == device


def test_a_workers_slot_goes_to_the_next_worker_with_none_of_its_blocks() -> None:
    """Fleet-wide prefixes are named from kept maps (see ``_Names``): a departure drops them."""
    workers = [f"w{i}" for i in range(40)]
    index = index_with(*workers)
    keys = chain(4)
    for w in workers:
        index.apply(batch(w, 1, stored(keys[:2])))
    index.apply(batch("w0", 2, stored(keys)))
    want = {w: (2, 2) for w in workers} | {"w0": (4, 4)}
    assert matches(index, keys) == want
    index.forget_worker("w7")
    index.load_snapshot(snapshot("newcomer"))  # takes w7's slot
    assert index.worker_slots()[7] == "newcomer"
    assert matches(index, keys) == {w: m for w, m in want.items() if w != "w7"}


def test_churn_through_many_rebuilds_keeps_every_key() -> None:
    """Keys stored and removed until the table has grown, filled with tombstones and been
    rebuilt many times: what is left matches, what went does not."""
    index, rng = index_with("p1", "p2"), random.Random(5)
    held: dict[str, list[int]] = {"p1": [], "p2": []}
    seq = {"p1": 0, "p2": 0}
    for step in range(300):
        worker = rng.choice(("p1", "p2"))
        new = [rng.getrandbits(64) for _ in range(rng.randint(1, 40))]
        gone, held[worker] = held[worker][: len(new) // 2], held[worker][len(new) // 2 :] + new
        seq[worker] += 1
        index.apply(batch(worker, seq[worker], stored(new), removed(gone)))
        if step % 50 == 0:
            index.check_invariants()
    index.check_invariants()
    for worker, keys in held.items():
        assert all(index.match([k]) == {worker: WorkerMatch(worker, 1, 1)} for k in keys)
    assert index.entries == sum(map(len, held.values()))


def test_a_key_outside_64_bits_is_never_stored() -> None:
    index = index_with("p1")
    index.apply(batch("p1", 1, stored([-1, 1 << 64, 5])))
    assert index.entries == 1
    assert matches(index, [5]) == {"p1": (1, 1)} and matches(index, [-1]) == {}


# --- fed by a real engine: the sim engine's reports through a KvReporter ---------------------------


def prefill_tasks(*prompts: list[int]) -> list[PrefillTask]:
    return [PrefillTask(spec=make_spec(prompt=p), queued_s=0.0) for p in prompts]


def held_by(index: PrefixIndex, worker: str, universe: set[int]) -> set[int]:
    """The keys of ``universe`` the index has ``worker`` hold on its device tier."""
    return {k for k in universe if index.match([k], [worker]).get(worker, WorkerMatch(worker, 0, 0)).device_blocks}


@pytest.mark.anyio
async def test_the_sim_engine_reports_its_cache_changes_net() -> None:
    engine = SimEngine(SimEngineConfig(cache_blocks=2), worker_id="p1")
    keys = make_spec(prompt=prompt_of(3 * BLOCK)).block_keys
    assert engine.take_kv_events() == []
    await engine.prefill(prefill_tasks(prompt_of(3 * BLOCK)))
    # Block 0 was stored and evicted within the batch: never told.
    assert engine.take_kv_events() == [stored(keys[1:])]
    assert engine.cached_blocks() == {"device": keys[1:]}
    await engine.prefill(prefill_tasks(prompt_of(BLOCK)))  # block 0 back, block 1 out
    await engine.prefill(prefill_tasks(prompt_of(2 * BLOCK)))  # block 1 back, block 2 out
    assert engine.take_kv_events() == [stored(keys[:1]), removed(keys[2:])]
    assert engine.take_kv_events() == []


def test_a_reporter_numbers_only_batches_with_changes() -> None:
    class Scripted:
        def __init__(self) -> None:
            self.pending: list[list[KvEvent]] = [[stored([1])], [], [removed([1])]]

        def cached_blocks(self) -> dict:
            return {"device": [7]}

        def take_kv_events(self) -> list[KvEvent]:
            return self.pending.pop(0)

    reporter = KvReporter("p1", Scripted())
    assert reporter.snapshot() == snapshot("p1", 0, device=[7])
    assert reporter.next_batch() == batch("p1", 1, stored([1]))
    assert reporter.next_batch() is None
    assert reporter.next_batch() == batch("p1", 2, removed([1]))
    assert reporter.snapshot().seq == 2


@pytest.mark.anyio
@pytest.mark.parametrize("seed", SEEDS[:10])
async def test_an_index_fed_by_a_sim_engine_equals_its_cache(seed: int) -> None:
    """Batches lost, snapshots answered between a cache change and its batch's numbering or
    between numbering and delivery: whenever the index is not knowingly behind, it equals the cache."""
    print(f"seed={seed} (rerun one with SWITCHYARD_SEED={seed})")
    rng = random.Random(seed)
    engine = SimEngine(SimEngineConfig(cache_blocks=24), worker_id="p1")
    reporter, index = KvReporter("p1", engine), PrefixIndex()
    prompts = [prompt_of(rng.randint(1, 10) * BLOCK + rng.randint(0, 15), start=rng.randint(0, 4)) for _ in range(12)]
    universe = {k for p in prompts for k in make_spec(prompt=p).block_keys}
    behind = True  # never snapshotted yet
    for _ in range(60):
        await engine.prefill(prefill_tasks(*rng.sample(prompts, rng.randint(1, 3))))
        if rng.random() < 0.15:  # the cache changed, its batch is not numbered yet
            index.load_snapshot(reporter.snapshot())
            behind = False
        numbered = reporter.next_batch()
        if rng.random() < 0.15:  # numbered, not yet delivered
            index.load_snapshot(reporter.snapshot())
            behind = False
        if numbered is None:
            pass
        elif rng.random() < 0.1:
            behind = True  # lost on the wire: the next batch will show the gap
        elif not index.apply(numbered):
            index.load_snapshot(reporter.snapshot())  # what the scheduler does on a gap
            behind = False
        if not behind:
            assert held_by(index, "p1", universe) == set(engine.cached_blocks()["device"])
            assert index.entries == len(engine.cached_blocks()["device"])
