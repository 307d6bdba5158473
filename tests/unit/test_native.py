"""The scheduler's C loops (``scheduler/_native.c``) against the Python they stand in for:
the same table, bit for bit, after every KV event, snapshot and lookup, and the same
placements (``test_fleet.py`` runs its placement comparison both ways too)."""

from __future__ import annotations

import contextlib
import math
import random
from array import array
from collections.abc import Iterator

import msgspec
import numpy as np
import pytest

from switchyard.scheduler.index import PrefixIndex
from switchyard.scheduler.native import native
from switchyard.scheduler.state import Fleet, LedgerBlocks, WorkerState
from switchyard.schemas import AllBlocksCleared, BlocksRemoved, BlocksStored, KvEvent, KvEventBatch, KvSnapshot
from tests.support.factories import make_spec

TIERS = ("device", "device", "host", "disk", "cluster")


def require_native() -> None:
    assert native is not None, "scheduler/_native.c did not build: `make install` (it needs a C compiler)"


def state(index: PrefixIndex) -> tuple:
    """Everything the two paths could differ in."""
    return (
        index._keys.tobytes(),
        index._stamp.tobytes(),
        index._holder.tobytes(),
        index._tiers.tobytes(),
        list(index._rows.masks),
        index._rows.slot.tobytes(),
        sorted(index._rows._free),
        (index._live, index._tombs, index._pairs, index._clock, index._bits),
    )


class Pair:
    """The same index twice, one on each path, fed the same things."""

    def __init__(self, max_entries: int) -> None:
        self.c, self.py = PrefixIndex(max_entries), PrefixIndex(max_entries)
        self.py.native = False
        self.seq: dict[str, int] = {}

    def both(self, call) -> tuple:
        got = call(self.c), call(self.py)
        assert state(self.c) == state(self.py)
        return got

    def batch(self, worker: str, *events: KvEvent) -> None:
        self.seq[worker] += 1
        applied = self.both(
            lambda i: i.apply(KvEventBatch(worker_id=worker, seq=self.seq[worker], events=list(events)))
        )
        assert applied == (True, True)

    def snapshot(self, worker: str, blocks: dict[str, list[int]]) -> None:
        self.seq[worker] = 0
        self.both(lambda i: i.load_snapshot(KvSnapshot(worker_id=worker, seq=0, blocks=blocks)))


@pytest.mark.parametrize("seed", range(8))
def test_the_c_table_is_the_python_table_after_every_event(seed: int) -> None:
    """Random traffic over 70-140 workers (masks of several words), every tier, keys several
    workers hold, keys that are no block hash, duplicates in a batch, removals of keys held
    by others or not at all, clears, departures, and a bound small enough to evict: the
    columns, the rows and the counters agree after every step, and so do the lookups."""
    require_native()
    print(f"seed={seed}")
    rng = random.Random(seed)
    workers = [f"w{i:03d}" for i in range(rng.choice([70, 140]))]
    pair = Pair(max_entries=rng.choice([300, 2_000, 1_000_000]))
    prefixes = [[rng.randrange(1 << 64) for _ in range(12)] for _ in range(30)]
    odd = [-1, 1 << 64, (1 << 64) + 5, 0, (1 << 64) - 1]  # not block hashes, and the edges

    def some_keys() -> list[int]:
        keys = rng.choice(prefixes)[: rng.randrange(1, 13)]
        if rng.random() < 0.2:
            keys = [*keys, *rng.sample(odd, 2)]
        if rng.random() < 0.1:
            keys = [*keys, *keys[:2]]  # a key twice in one batch
        return keys

    for wid in workers[:40]:
        pair.snapshot(wid, {rng.choice(TIERS): some_keys()})
    for step in range(1_500):
        roll = rng.random()
        known = [w for w in workers if w in pair.seq]
        wid = rng.choice(workers if rng.random() < 0.1 or not known else known)
        if wid not in pair.seq or roll < 0.02:
            pair.snapshot(wid, {tier: some_keys() for tier in rng.sample(TIERS, 2)})
        elif roll < 0.55:
            pair.batch(wid, BlocksStored(keys=some_keys(), tier=rng.choice(TIERS)))
        elif roll < 0.85:
            pair.batch(wid, BlocksRemoved(keys=some_keys(), tier=rng.choice(TIERS)))
        elif roll < 0.87:
            pair.batch(wid, AllBlocksCleared(), BlocksStored(keys=some_keys()))
        elif roll < 0.89:
            pair.both(lambda i, w=wid: i.forget_worker(w))
            del pair.seq[wid]
        else:
            keys = [*some_keys(), rng.randrange(1 << 64)]
            wanted = rng.sample(workers, 30) if rng.random() < 0.3 else None
            (c_blocks, c_device), (py_blocks, py_device) = pair.both(lambda i, k=keys, w=wanted: i.match_slots(k, w))
            assert c_blocks.tolist() == py_blocks.tolist() and c_device.tolist() == py_device.tolist(), step
        if step % 100 == 0:
            pair.c.check_invariants()
    pair.c.check_invariants()
    assert pair.c.entries > 0


def test_a_lookup_in_c_reads_what_match_counts_says() -> None:
    """The arrays by slot name the workers and counts ``match_counts`` gives."""
    require_native()
    index = PrefixIndex()
    for wid, tiers in [
        ("a", {"device": [1, 2, 3]}),
        ("b", {"device": [1], "host": [2, 3]}),
        ("c", {"cluster": [1, 2]}),
    ]:
        index.load_snapshot(KvSnapshot(worker_id=wid, seq=0, blocks=tiers))
    blocks, device = index.match_slots([1, 2, 3, 4])
    names = index.worker_slots()
    assert {names[s]: int(n) for s, n in enumerate(blocks) if n} == {"a": 3, "b": 3, "c": 2}
    assert {names[s]: int(n) for s, n in enumerate(device) if n} == {"a": 3, "b": 1}
    assert index.match_counts([1, 2, 3, 4]) == ({"a": 3, "b": 3, "c": 2}, {"a": 3, "b": 1})


def test_bad_buffers_are_errors_not_crashes() -> None:
    require_native()
    keys, stamp, holder, tiers = array("Q", [0]) * 16, array("q", [0]) * 16, array("i", [-1]) * 16, array("B", [0]) * 16
    out = np.zeros(4, dtype=np.int32)
    with pytest.raises(ValueError, match="disagree"):
        native.walk(keys, stamp, holder, array("B", [0]) * 8, 60, [], 0, [1], 0, out, out.copy())
    with pytest.raises(TypeError, match="items of 4 bytes"):
        native.walk(keys, stamp, holder, tiers, 60, [], 0, [1], 0, np.zeros(4), out)
    with pytest.raises(TypeError, match="block keys are ints"):
        native.walk(keys, stamp, holder, tiers, 60, [], 0, ["x"], 0, out, out.copy())
    with pytest.raises(IndexError):
        native.store(keys, stamp, holder, tiers, 60, [1], 5, 0, 1, 0, 0, 0, 0, 10)
    with pytest.raises(TypeError, match="takes 14 arguments"):  # the arguments are read by hand
        native.store(keys, stamp, holder, tiers, 60, [1], 0, 0, 1, 0, 0, 0, 0)
    with pytest.raises(TypeError, match="argument 6 must be list"):
        native.store(keys, stamp, holder, tiers, 60, (1,), 0, 0, 1, 0, 0, 0, 0, 10)
    with pytest.raises(OverflowError, match="C int"):
        native.store(keys, stamp, holder, tiers, 60, [1], 0, 1 << 40, 1, 0, 0, 0, 0, 10)
    fleet = [np.zeros(3) for _ in range(7)]
    with pytest.raises(ValueError, match="differ in length"):  # a rank of another fleet's size
        native.choose_decode(*fleet[:3], np.zeros(2, dtype=np.int64), np.array([0], dtype=np.intp), 10, None, 1.0)
    with pytest.raises(IndexError, match="past the fleet"):
        native.choose_decode(*fleet[:3], np.zeros(3, dtype=np.int64), np.array([3], dtype=np.intp), 10, None, 1.0)
    scalars = (10, 16, 0.0, 10, False, 1.0, 1.0, 4.0, True)  # prompt .. kv_tie
    with pytest.raises(IndexError, match="past the fleet"):
        native.choose_prefill(
            *fleet, np.zeros(3, dtype=np.int64), np.array([7], dtype=np.intp), np.zeros(3, dtype=np.intp),
            out, out.copy(), *scalars, np.zeros(3), np.zeros(3), np.ones(3), math.nan, math.nan, np.zeros(3), True,
        )  # fmt: skip
    with pytest.raises(ValueError, match="differ in length"):  # a room edge of another fleet's size
        native.choose_prefill(
            *fleet, np.zeros(3, dtype=np.int64), np.array([0], dtype=np.intp), np.zeros(3, dtype=np.intp),
            out, out.copy(), *scalars, np.zeros(3), np.zeros(2), np.ones(3), math.nan, math.nan, np.zeros(3), True,
        )  # fmt: skip


def test_a_lookup_writes_only_the_slots_it_was_given() -> None:
    """Workers past the arrays' length (a mask wider than the fleet) are never written."""
    require_native()
    index = PrefixIndex()
    index.load_snapshot(KvSnapshot(worker_id="a", seq=0, blocks={"cluster": [5, 6]}))
    room, device_room = np.zeros(64, dtype=np.int32), np.zeros(64, dtype=np.int32)
    blocks, device = room[:1], device_room[:1]  # one slot, in front of memory it must not touch
    blocks[0], device[0] = 7, 7  # what was there before: the walk zeroes its slots first
    wide = (1 << 10) | (1 << 63) | 1  # the cluster tier keeps every wanted worker matching
    native.walk(
        index._keys, index._stamp, index._holder, index._tiers, index._shift, index._rows.masks, wide, [5, 6], 0,
        blocks, device,
    )  # fmt: skip
    assert room.tolist() == [2] + [0] * 63 and not device_room.any()
    for past in (1 << 64, 1 << 95, -1):  # past the one word of one slot, in a digit that spans two words; negative
        with pytest.raises(OverflowError):
            native.walk(
                index._keys, index._stamp, index._holder, index._tiers, index._shift, index._rows.masks, past, [5], 0,
                blocks, device,
            )  # fmt: skip


# --- decodes' shared blocks (``LedgerBlocks``, ``Fleet.hold_keys``, ``Fleet.decode_sharing``) ---


def _decode_fleet(c: bool) -> Fleet:
    fleet = Fleet()
    fleet.native = c
    for i in range(70):  # past 64 slots: holder bitsets of more than one word
        fleet.add(WorkerState(worker_id=f"d{i:02d}", role="decode", token_budget=10**9, block_size=4, last_seen=0.0))
    return fleet


@contextlib.contextmanager
def _loops_in_c(c: bool) -> Iterator[None]:
    """The ledger's shared-block loops in C or in Python (a class setting), for a while."""
    was = LedgerBlocks.native
    LedgerBlocks.native = c
    try:
        yield
    finally:
        LedgerBlocks.native = was


@pytest.mark.parametrize("seed", range(3))
def test_the_shared_blocks_kept_in_c_are_the_ones_kept_in_python(seed: int) -> None:
    """Decodes starting and ending at random on 70 decode workers, and workers leaving
    and coming back with their decodes: in C and in Python the same counts per worker,
    the same holders of each key, the same saved tokens, and the same shared tokens by
    slot for random prompts (keys chained down a small tree, so prefixes are shared)."""
    require_native()
    print(f"seed={seed}")
    rng = random.Random(seed)
    fleets = {c: _decode_fleet(c) for c in (True, False)}
    live: dict[str, str] = {}  # request -> worker

    def prompt() -> list[int]:
        keys, node = [], 0
        for _ in range(rng.randrange(1, 9)):
            node = node * 3 + rng.randrange(1, 4)
            keys.append(node)
        return keys

    for step in range(3_000):
        roll = rng.random()
        if live and roll < 0.4:
            rid = rng.choice(sorted(live))
            wid = live.pop(rid)
            for c, fleet in fleets.items():
                with _loops_in_c(c):
                    fleet.workers[wid].release(rid)
        elif roll < 0.42:  # a worker leaves with its decodes, and comes back empty
            wid = f"d{rng.randrange(70):02d}"
            live = {r: w for r, w in live.items() if w != wid}
            for fleet in fleets.values():
                gone = fleet.remove(wid)
                assert gone is not None
                fleet.add(WorkerState(worker_id=wid, role="decode", token_budget=10**9, block_size=4, last_seen=0.0))
        else:
            rid, wid, keys = f"r{step}", f"d{rng.randrange(70):02d}", prompt()
            live[rid] = wid
            for c, fleet in fleets.items():
                with _loops_in_c(c):
                    fleet.workers[wid].assign_decode(rid, 4 * len(keys) + 10, keys)
        c_fleet, py_fleet = fleets[True], fleets[False]
        assert c_fleet._held_by == py_fleet._held_by, seed
        assert c_fleet._holding == py_fleet._holding, seed
        assert c_fleet.decode_saved == py_fleet.decode_saved, seed
        spec = make_spec(f"q{step}", prompt_len=4)
        spec = msgspec.structs.replace(spec, block_keys=prompt(), block_size=4)
        ours, theirs = c_fleet.decode_sharing(spec), py_fleet.decode_sharing(spec)
        assert (ours is None) == (theirs is None), seed
        if ours is not None and theirs is not None:
            assert ours.tolist() == theirs.tolist(), seed
    for fleet in fleets.values():
        fleet.check_invariants()
    for wid, worker in fleets[True].workers.items():
        other = fleets[False].workers[wid]
        assert (worker.shared and worker.shared._refs) == (other.shared and other.shared._refs)
        assert (worker.shared and worker.shared.saved) == (other.shared and other.shared.saved)


def test_bad_arguments_to_the_shared_block_loops_are_errors_not_crashes() -> None:
    require_native()
    with pytest.raises(TypeError, match="share_add"):
        native.share_add([], [1], None)
    with pytest.raises(TypeError, match="sequence"):
        native.share_add({}, 5, None)
    with pytest.raises(KeyError):  # a key never counted
        native.share_remove({1: 1}, [1, 2], None)
    with pytest.raises(TypeError, match="hold_keys"):
        native.hold_keys({}, [], 0, [1], True)
    with pytest.raises(KeyError):  # no slot holds it
        native.hold_keys({}, {}, 3, [9], False)
    with pytest.raises(TypeError, match="items of 4 bytes"):
        native.decode_sharing({1: 0}, {}, [1], 16, np.zeros(4))
    with pytest.raises(OverflowError, match="past the fleet"):  # a holder beyond the array
        native.decode_sharing({1: 9}, {}, [1], 16, np.zeros(4, dtype=np.int32))
    out = np.zeros(4, dtype=np.int32)
    assert native.decode_sharing({}, {}, [1], 16, out) is False and not out.any()
    assert native.decode_sharing({}, {}, [], 16, out) is False
    refs: dict[int, int] = {}
    fresh: list[int] = []
    assert native.share_add(refs, (5, 6, 5), fresh) == 1 and refs == {5: 2, 6: 1} and fresh == [5, 6]
    gone: list[int] = []
    assert native.share_remove(refs, [5, 6], gone) == 1 and refs == {5: 1} and gone == [6]
