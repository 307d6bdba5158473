"""The global prefix index: which worker holds which prefix, on which tier.

Fed by the workers' KV events (``KvEventBatch``, per-worker ``seq``) and snapshots
(``KvSnapshot``, on join and after a gap). Pure data structure: no I/O, no clock.

Contract (what the scheduler core relies on):
- ``apply(batch)`` applies a batch whose seq is exactly the worker's last + 1 and
  returns True; on a gap (or a worker never snapshotted) it applies nothing and
  returns False: the caller must ask that worker for a snapshot.
- ``load_snapshot(snapshot)`` replaces everything known of that worker.
- ``match(block_keys)`` returns, per worker holding at least the first block, how many
  leading blocks it holds on its device tier and how many on any tier (a ``cluster``
  block counts for every worker), in time linear in the blocks matched.
- Memory is bounded by ``max_entries`` (key, worker) pairs; past it, the least recently
  stored or matched keys are dropped (the index may then under-report, never over-report).

Design: no Python object per key
--------------------------------
- **Workers are bits.** Each known worker has a slot (``_slot``, reused after it is
  forgotten); a set of workers is a Python int with those bits set.
- **One open-addressed table** (linear probing, a power-of-two capacity, Fibonacci
  hashing) in four flat ``array.array`` columns: the 64-bit key, its LRU stamp, its
  holder, its tier bits (device/host/disk/cluster). ``array`` and not numpy for the
  columns because one element read is a Python int, three times faster than a numpy
  scalar, and this table is read one key at a time; numpy views of the same buffers
  (``np.frombuffer``) do the whole-table sweeps: rebuilding, forgetting a worker,
  choosing what to evict. A removed key leaves a tombstone, unless the slot after it is
  free (then it and the tombstones before it are freed); the table is rebuilt (in numpy)
  once keys and tombstones fill 80% of it, at a size that puts its load back between
  35% and 70%.
- **Sparse holders.** Most keys have one holder: its worker slot and its tier bits sit
  in the table. A key held by several workers names a row of ``_Rows`` instead (its
  holder column is ``_MULTI - row``): four worker masks, one per tier, in one flat list,
  and the row's slot in the table (kept up to date by a rebuild). It goes back inline
  when one holder is left. A key is in the cluster tier while any holder reports it
  there, so a forgotten worker's reports go with it.
- **match** ANDs masks along the prompt: the workers still matching on any tier and on
  the device tier are two ints; a key in the cluster tier keeps everybody still matching;
  the workers that stop at block ``i`` are ``before & ~after``, and only those are ever
  turned back into worker ids. A lookup costs a probe and a few big-int operations a
  block, whatever the fleet's size, plus one dict entry per worker it reports (``_Names``
  makes those cheap). ``match_slots`` answers the same as two arrays by worker slot
  (``worker_slots``), for a caller that scores the fleet as arrays: no ids at all.
- **LRU as stamps.** Every store or match of a key gives it the next stamp; eviction
  takes the smallest. Candidates are the smallest ``1/64`` of the live stamps, found
  with one ``argpartition`` and consumed in order; a candidate whose stamp changed since
  (touched, removed, stored again) is skipped, and stamps only grow, so each eviction
  takes exactly the least recently used key, as a linked list would. Keys of one
  ``BlocksStored`` are stamped back to front, so a prefix is always more recent than its
  extensions and the LRU drops leaves first: a key whose parent is gone can never be
  matched again, so keeping it would waste the bound.
- Forgetting, clearing or re-snapshotting a worker sweeps the table's holder column
  (numpy, about 1 ms at 2M slots) and the rows (Python): rare events, so no per-worker
  key set is kept.
- Keys outside ``[0, 2**64)`` (no block hash is) are never stored, so never matched.

Measured (``bench scheduler``: ``sys.getsizeof`` over every object reachable from the
index, CPython 3.11): 21 bytes a table slot, so 30-60 bytes a key as the table's load
goes from 70% to 35%; a key several workers hold adds its row, 40 bytes (four list
entries and its slot), plus its masks of more than the first eight workers as ints of
their own (~130 B each at 1,000 workers). The bench's fleet (750 prefill workers, 980k
pairs on 931k keys, 105 held by several workers, in 2M slots): 42 MiB, 45 B a pair and
47 B a distinct block, against 393 and 414 with the ``OrderedDict`` of holder dicts this
replaced; ``match_counts`` 35-46 us at p50 against 420 (``docs/bench-scheduler.md``).
``bench sim``'s six workers share most keys: 40 B a pair there (339 before). ``_Names``
keeps up to 32 maps of a prefix's workers besides (~40 KB each at 1,000 workers).
``approx_bytes`` adds up the columns and the rows, sampling the masks.
"""

from __future__ import annotations

import sys
from array import array
from collections.abc import Iterable
from dataclasses import dataclass, field
from itertools import islice
from typing import Any

import numpy as np
import numpy.typing as npt

from switchyard.scheduler.native import native as _native
from switchyard.schemas import AllBlocksCleared, BlocksRemoved, BlocksStored, KvEvent, KvEventBatch, KvSnapshot

DEVICE, HOST, DISK, CLUSTER = 1, 2, 4, 8
OWN = DEVICE | HOST | DISK  # tiers private to one worker
ALL_TIERS = OWN | CLUSTER
TIER_BITS = {"device": DEVICE, "host": HOST, "disk": DISK, "cluster": CLUSTER}
_TIER_ORDER = (DEVICE, HOST, DISK, CLUSTER)  # the order of a multi-holder key's masks

# The holder column: a worker slot (>= 0), free, a tombstone, or ``_MULTI - row`` for a key
# held by several workers, whose masks are that row of ``_Rows``.
_EMPTY, _TOMB, _MULTI = -1, -2, -3

_KEY_LIMIT = 1 << 64
_GOLDEN = 0x9E3779B97F4A7C15  # 2**64 / the golden ratio: Fibonacci hashing
_MIN_BITS = 4  # 16 slots at least
_MAX_USED = 0.8  # rebuild once keys and tombstones fill this share of the table
_MAX_LOAD = 0.7  # a rebuilt table is at most this full (and more than half that)
_VICTIM_SHARE = 64  # eviction candidates: the least recent 1/64 of the keys
_SAMPLE = 256  # multi-holder keys sampled by approx_bytes
_DECODE_LOOP = 16  # masks of at most this many workers are decoded bit by bit
_KEPT_NAMES = 32  # fleet-wide maps _Names keeps


@dataclass(frozen=True, slots=True)
class WorkerMatch:
    worker_id: str
    device_blocks: int  # leading blocks on the worker's own device tier
    blocks: int  # leading blocks reachable by it on any tier (device, host, disk, cluster)


class PrefixIndex:
    def __init__(self, max_entries: int = 4_000_000) -> None:
        if max_entries < 1:
            raise ValueError(f"max_entries must be positive, got {max_entries}")
        self.max_entries = max_entries
        self._seq: dict[str, int] = {}  # known workers -> seq of the last batch applied
        self._slot: dict[str, int] = {}  # known workers -> their bit
        self._ids: list[str | None] = []  # bit -> worker (None: free)
        self._known = 0  # the mask of every known worker
        self.ids_version = 0  # bumped whenever a slot's worker changes (``worker_slots``)
        self.native = _native is not None  # the C loops; False: the Python ones (tests compare)
        self._rows = _Rows()  # the holders of keys held by 2+ workers
        self._pairs = 0
        self._live = 0  # keys in the table
        self._tombs = 0
        self._clock = 0  # the last stamp given
        self._victims: list[tuple[int, int]] = []  # (stamp, key), least recent last
        self._names = _Names()
        self._allocate(_MIN_BITS)

    def _allocate(self, bits: int) -> None:
        size = 1 << bits
        self._bits, self._mask, self._shift = bits, size - 1, 64 - bits
        self._max_used = int(_MAX_USED * size)
        # Repeated, not built from bytes: an array grown from bytes is over-allocated by 1/16.
        self._keys = array("Q", [0]) * size
        self._stamp = array("q", [0]) * size
        self._holder = array("i", [_EMPTY]) * size
        self._tiers = array("B", [0]) * size

    # --- updates -----------------------------------------------------------------

    def apply(self, batch: KvEventBatch) -> bool:
        last = self._seq.get(batch.worker_id)
        if last is None or batch.seq > last + 1:
            return False  # never snapshotted, or we missed a batch: nothing applies
        if batch.seq <= last:
            return True  # a duplicate, or already in the snapshot we loaded
        worker = self._slot[batch.worker_id]
        for event in batch.events:
            if self.native and isinstance(event, BlocksStored):  # the common events, without the dispatch below
                keys = event.keys
                self._reserve(len(keys))
                self._store_native(worker, keys, TIER_BITS[event.tier])
            elif self.native and isinstance(event, BlocksRemoved):
                self._unset_native(worker, event.keys, TIER_BITS[event.tier])
            else:
                self._apply_event(worker, event)
        self._seq[batch.worker_id] = batch.seq
        return True

    def load_snapshot(self, snapshot: KvSnapshot) -> None:
        worker = self._slot.get(snapshot.worker_id)
        if worker is None:
            worker = self._join(sys.intern(snapshot.worker_id))  # one str shared with the core's
        else:
            self._clear(worker)
        self._seq[self._ids[worker]] = snapshot.seq  # type: ignore[index]
        for tier, keys in snapshot.blocks.items():
            bit = TIER_BITS.get(tier)
            if bit is not None:  # a tier this scheduler does not know (a newer worker): skipped
                self._store(worker, keys, bit)

    def forget_worker(self, worker_id: str) -> None:
        worker = self._slot.pop(worker_id, None)
        if worker is not None:
            self._clear(worker)
            del self._seq[worker_id]
            self._ids[worker] = None
            self._known &= ~(1 << worker)
            self._names.clear()
            self.ids_version += 1

    def _join(self, worker_id: str) -> int:
        """The lowest free bit for a new worker (so masks stay as short as the fleet)."""
        free = next((i for i, w in enumerate(self._ids) if w is None), len(self._ids))
        if free == len(self._ids):
            self._ids.append(worker_id)
        else:
            self._ids[free] = worker_id
        self._slot[worker_id] = free
        self._known |= 1 << free
        self._names.clear()
        self.ids_version += 1
        return free

    def _apply_event(self, worker: int, event: KvEvent) -> None:
        match event:
            case BlocksStored(keys=keys, tier=tier):
                self._store(worker, keys, TIER_BITS[tier])
            case BlocksRemoved(keys=keys, tier=tier):
                if self.native:
                    self._unset_native(worker, keys, TIER_BITS[tier])
                else:
                    for key in keys:
                        self._unset(worker, key, TIER_BITS[tier])
            case AllBlocksCleared():
                self._clear(worker)  # everything it reported, every tier

    def _store(self, worker: int, keys: list[int], bit: int) -> None:
        self._reserve(len(keys))  # no rebuild in the loop: the columns stay these
        if self.native:
            self._store_native(worker, keys, bit)
            return
        holder, tiers, stamp = self._holder, self._tiers, self._stamp
        # Back to front: the prefix ends up more recent than its extensions (see the note).
        for key in reversed(keys):
            if not 0 <= key < _KEY_LIMIT:
                continue  # not a block hash: never stored, so never matched
            slot = self._probe(key)
            if slot < 0:
                slot = self._insert(-1 - slot, key, worker, bit)
            elif holder[slot] == worker:
                tiers[slot] |= bit  # the common case of a key it holds already
            else:
                self._add_holder(slot, key, worker, bit)
            self._clock += 1
            stamp[slot] = self._clock
            if self._pairs > self.max_entries:
                self._evict_over_bound()

    def _store_native(self, worker: int, keys: list[int], bit: int) -> None:
        """``_store``'s loop in C, which hands back a key another worker holds and the
        bound being passed: the same steps in the same order."""
        pos = len(keys) - 1
        while pos >= 0:
            code, pos, slot, self._clock, self._live, self._tombs, self._pairs = _native.store(
                self._keys, self._stamp, self._holder, self._tiers, self._shift, keys, pos, worker, bit,
                self._clock, self._live, self._tombs, self._pairs, self.max_entries,
            )  # fmt: skip
            if code == _native.NEEDS_PYTHON:
                self._add_holder(slot, keys[pos], worker, bit)
                self._clock += 1
                self._stamp[slot] = self._clock
                pos -= 1
            if code != _native.DONE and self._pairs > self.max_entries:
                self._evict_over_bound()

    def _unset_native(self, worker: int, keys: list[int], bits: int) -> None:
        """``_unset`` of every key in C, which hands back the keys several workers hold."""
        pos = 0
        while pos < len(keys):
            code, pos, slot, self._live, self._tombs, self._pairs = _native.unset(
                self._keys, self._stamp, self._holder, self._tiers, self._shift, keys, pos, worker, bits,
                self._live, self._tombs, self._pairs,
            )  # fmt: skip
            if code != _native.NEEDS_PYTHON:
                return
            self._unset_multi(slot, _MULTI - self._holder[slot], worker, bits)
            pos += 1

    def _add_holder(self, slot: int, key: int, worker: int, bit: int) -> None:
        """``worker`` stores ``key``, which others hold."""
        holder, rows = self._holder[slot], self._rows
        if holder <= _MULTI:
            row = _MULTI - holder
            if not rows.held(row) >> worker & 1:
                self._pairs += 1
            rows.masks[4 * row + _TIER_ORDER.index(bit)] |= 1 << worker
        else:  # a second holder: the key's holders move out of the table
            masks = [(1 << holder if self._tiers[slot] & tier else 0) for tier in _TIER_ORDER]
            masks[_TIER_ORDER.index(bit)] |= 1 << worker
            self._holder[slot], self._tiers[slot] = _MULTI - rows.add(slot, masks), 0
            self._pairs += 1

    def _unset(self, worker: int, key: int, bits: int) -> None:
        slot = self._probe(key)
        if slot < 0:
            return
        holder = self._holder[slot]
        if holder == worker:
            left = self._tiers[slot] & ~bits
            if left:
                self._tiers[slot] = left
            else:
                self._delete(slot)
        elif holder <= _MULTI:
            self._unset_multi(slot, _MULTI - holder, worker, bits)

    def _unset_multi(self, slot: int, row: int, worker: int, bits: int) -> None:
        rows, me = self._rows, 1 << worker
        if not rows.held(row) & me:
            return  # not one of its holders
        for i, tier in enumerate(_TIER_ORDER):
            if bits & tier:
                rows.masks[4 * row + i] &= ~me
        held = rows.held(row)
        if held & me:
            return
        self._pairs -= 1
        if held & (held - 1) == 0:  # one holder left: back into the table
            self._tiers[slot] = sum(tier for i, tier in enumerate(_TIER_ORDER) if rows.masks[4 * row + i])
            self._holder[slot] = held.bit_length() - 1
            rows.remove(row)

    def _clear(self, worker: int) -> None:
        """Everything ``worker`` holds, every tier: a sweep of the table, then of the
        multi-holder keys."""
        holders = np.frombuffer(self._holder, dtype=np.int32)
        mine = np.flatnonzero(holders == worker)
        holders[mine] = _TOMB
        del holders  # the array may not be resized while numpy sees its buffer
        self._live -= len(mine)
        self._tombs += len(mine)
        self._pairs -= len(mine)
        for row in self._rows.holding(worker):
            self._unset_multi(self._rows.slot[row], row, worker, ALL_TIERS)

    def _delete(self, slot: int) -> None:
        self._holder[slot] = _TOMB
        self._live -= 1
        self._tombs += 1
        self._pairs -= 1
        self._free_tombs_before((slot + 1) & self._mask)

    def _free_tombs_before(self, slot: int) -> None:
        """If ``slot`` is free, the tombstones just before it are too: no probe passes a
        free slot, so none needs them (about half the removals at the table's usual load)."""
        holder, mask = self._holder, self._mask
        if holder[slot] != _EMPTY:
            return
        slot = (slot - 1) & mask
        while holder[slot] == _TOMB:  # ends: the table always has a free slot
            holder[slot] = _EMPTY
            self._tombs -= 1
            slot = (slot - 1) & mask

    def _evict_over_bound(self) -> None:
        while self._pairs > self.max_entries:
            slot = self._least_recent()
            holder = self._holder[slot]
            if holder <= _MULTI:
                self._pairs -= self._rows.held(_MULTI - holder).bit_count() - 1  # _delete counts one
                self._rows.remove(_MULTI - holder)
            self._delete(slot)

    def _least_recent(self) -> int:
        """The slot of the least recently stamped key (see the note)."""
        while True:
            if not self._victims:
                self._pick_victims()
            stamp, key = self._victims.pop()
            slot = self._probe(key)
            if slot >= 0 and self._stamp[slot] == stamp:
                return slot

    def _pick_victims(self) -> None:
        live = self._live_slots()
        stamps = np.frombuffer(self._stamp, dtype=np.int64)[live]
        n = min(len(live), max(16, len(live) // _VICTIM_SHARE))
        chosen = np.argpartition(stamps, n - 1)[:n] if n < len(live) else np.arange(len(live))
        keys = np.frombuffer(self._keys, dtype=np.uint64)[live[chosen]]
        self._victims = sorted(zip(stamps[chosen].tolist(), keys.tolist(), strict=True), reverse=True)

    def _live_slots(self) -> npt.NDArray[np.intp]:
        holders = np.frombuffer(self._holder, dtype=np.int32)
        return np.flatnonzero((holders != _EMPTY) & (holders != _TOMB))

    # --- the table ---------------------------------------------------------------

    def _probe(self, key: int) -> int:
        """The slot holding ``key``; if none does, ``-1 - slot`` for the slot it would
        take: the first tombstone or free slot on its probe. One probe for both, since most
        stored keys are new."""
        keys, holder, mask = self._keys, self._holder, self._mask
        i = ((key * _GOLDEN) & (_KEY_LIMIT - 1)) >> self._shift
        reuse = -1
        while True:
            h = holder[i]
            if h == _EMPTY:
                return -1 - (i if reuse < 0 else reuse)
            if h == _TOMB:
                if reuse < 0:
                    reuse = i
            elif keys[i] == key:
                return i
            i = (i + 1) & mask

    def _reserve(self, new_keys: int) -> None:
        """Room for ``new_keys`` more keys (at most: some may be in already) without a
        rebuild: one now if they would fill the table past ``_MAX_USED``."""
        if self._live + self._tombs + new_keys > self._max_used:
            self._rebuild(self._live + new_keys)

    def _insert(self, slot: int, key: int, worker: int, bit: int) -> int:
        """A new key, held by ``worker`` on ``bit``, at the free ``slot`` its probe found
        (``_reserve`` made the room)."""
        if self._holder[slot] == _TOMB:
            self._tombs -= 1
        self._keys[slot], self._holder[slot], self._tiers[slot] = key, worker, bit
        self._live += 1
        self._pairs += 1
        return slot

    def _rebuild(self, keys_needed: int) -> None:
        """A fresh table, without tombstones, at most ``_MAX_LOAD`` full once it holds
        ``keys_needed``; placed in numpy, a round per probe step."""
        live = self._live_slots()
        columns: list[npt.NDArray[Any]] = [np.frombuffer(c, dtype=d)[live] for c, d in self._columns()]
        bits = _MIN_BITS
        while keys_needed > _MAX_LOAD * (1 << bits):
            bits += 1
        self._allocate(bits)
        slots = _place(columns[0], bits)
        for (column, dtype), values in zip(self._columns(), columns, strict=True):
            np.frombuffer(column, dtype=dtype)[slots] = values
        holders = columns[2]
        multi = holders <= _MULTI  # their rows follow them to their new slots
        np.frombuffer(self._rows.slot, dtype=np.int64)[_MULTI - holders[multi]] = slots[multi]
        self._tombs = 0  # (the eviction candidates name keys, not slots: they stay good)

    def _columns(self) -> list[tuple[array[int], type]]:
        return [(self._keys, np.uint64), (self._stamp, np.int64), (self._holder, np.int32), (self._tiers, np.uint8)]

    def _holders_of(self, slot: int) -> tuple[int, int, bool]:
        """(device mask, own-tier mask, in the cluster tier) of the key at ``slot``."""
        holder = self._holder[slot]
        if holder <= _MULTI:
            row = 4 * (_MULTI - holder)
            device, host, disk, cluster = self._rows.masks[row : row + 4]
            return device, device | host | disk, cluster != 0
        tiers, me = self._tiers[slot], 1 << holder
        return (me if tiers & DEVICE else 0), (me if tiers & OWN else 0), tiers & CLUSTER != 0

    # --- queries -----------------------------------------------------------------

    def knows(self, worker_id: str) -> bool:
        return worker_id in self._seq

    def last_seq(self, worker_id: str) -> int | None:
        """The seq of the last batch (or snapshot) applied for this worker."""
        return self._seq.get(worker_id)

    def match(self, block_keys: list[int], workers: Iterable[str] | None = None) -> dict[str, WorkerMatch]:
        blocks, device = self.match_counts(block_keys, workers)
        return {w: WorkerMatch(w, device.get(w, 0), n) for w, n in blocks.items() if n > 0}

    def match_counts(
        self, block_keys: list[int], workers: Iterable[str] | None = None
    ) -> tuple[dict[str, int], dict[str, int]]:
        """``match`` as two plain maps, worker -> leading blocks on any tier and on its
        device tier (a worker absent or at 0 matched nothing): what placement reads,
        without an object per worker when a prefix is held fleet-wide."""
        walk = self._walk(block_keys, self._wanted(workers))
        names, ids = self._names, self._ids
        return names.counts(walk.stopped, ids, block_keys), names.counts(walk.device_stopped, ids, block_keys)

    def match_slots(
        self, block_keys: list[int], workers: Iterable[str] | None = None, wanted: int | None = None
    ) -> tuple[npt.NDArray[np.int32], npt.NDArray[np.int32]]:
        """``match_counts`` as two arrays by worker slot (``worker_slots``): leading blocks
        on any tier and on the device tier, 0 for a worker that matched nothing or a free
        slot. For a caller that scores the fleet as arrays: no worker id is looked at.
        ``wanted``: the workers as a ``mask`` made before (instead of ``workers``); the walk
        stops at the first block none of them holds."""
        wanted = self._wanted(workers) if wanted is None else wanted
        if not self.native:
            walk = self._walk(block_keys, wanted)
            return by_slot(walk.stopped, len(self._ids)), by_slot(walk.device_stopped, len(self._ids))
        n = len(self._ids)
        both = np.empty(2 * n, dtype=np.int32)  # one allocation; the walk zeroes it
        blocks, device = both[:n], both[n:]
        self._clock = _native.walk(
            self._keys, self._stamp, self._holder, self._tiers, self._shift, self._rows.masks, wanted,
            block_keys, self._clock, blocks, device,
        )  # fmt: skip
        return blocks, device

    def worker_slots(self) -> list[str | None]:
        """Slot -> worker id (None: free), the index of ``match_slots``' arrays. A slot keeps
        its worker until the worker is forgotten; a new worker takes the lowest free one."""
        return list(self._ids)

    def mask(self, workers: Iterable[str]) -> int:
        """``workers`` as ``match_slots``' ``wanted``: made once, valid until ``ids_version``
        changes."""
        return self._wanted(workers)

    def _wanted(self, workers: Iterable[str] | None) -> int:
        if workers is None:
            return self._known
        slots = (self._slot.get(w) for w in workers)
        return sum_masks({1 << s for s in slots if s is not None})

    def _walk(self, block_keys: list[int], wanted: int) -> _Walk:
        walk = _Walk(reach=wanted, device=wanted)
        slots = []
        for i, key in enumerate(block_keys):
            slot = self._probe(key)
            if slot < 0 or not walk.step(i, *self._holders_of(slot)):
                break
            slots.append(slot)
        walk.finish(len(slots))
        for slot in reversed(slots):  # a hit is a use: the prefix stays the newest
            self._clock += 1
            self._stamp[slot] = self._clock
        return walk

    @property
    def entries(self) -> int:
        """(key, worker) pairs held: what ``max_entries`` bounds."""
        return self._pairs

    def approx_bytes(self) -> int:
        """Memory held, from ``sys.getsizeof``: the table's columns exactly, the
        multi-holder keys from a sample. It leaves out the worker id strings (shared, one
        per worker)."""
        columns = sum(sys.getsizeof(c) for c, _ in self._columns())
        maps = sum(sys.getsizeof(c) for c in (self._seq, self._slot, self._ids, self._victims))
        return int(columns + self._rows.approx_bytes() + maps)

    def check_invariants(self) -> None:
        """The table, the multi-holder keys and the workers agree; O(table): for tests."""
        holders = self._holder.tolist()
        live = [i for i, h in enumerate(holders) if h >= 0 or h <= _MULTI]
        assert len(live) == self._live and holders.count(_TOMB) == self._tombs
        assert self._live + self._tombs <= self._max_used and _EMPTY in holders
        assert all(self._probe(self._keys[i]) == i for i in live)  # every key reachable, once
        multi = {_MULTI - holders[i]: i for i in live if holders[i] <= _MULTI}
        assert multi == {row: self._rows.slot[row] for row in self._rows.in_use()}
        for row in multi:
            held = self._rows.held(row)
            assert held & (held - 1) and held & ~self._known == 0  # 2+ holders, all known
        assert all(self._tiers[i] and (self._known >> holders[i] & 1) for i in live if holders[i] >= 0)
        pairs = sum(1 if holders[i] >= 0 else self._rows.held(_MULTI - holders[i]).bit_count() for i in live)
        assert pairs == self._pairs <= self.max_entries
        assert self._seq.keys() == self._slot.keys()
        assert all(self._ids[s] == w for w, s in self._slot.items())
        assert self._known == sum_masks({1 << s for s in self._slot.values()})


def sum_masks(masks: Iterable[int]) -> int:
    """The union of worker masks."""
    union = 0
    for mask in masks:
        union |= mask
    return union


class _Rows:
    """The holders of the keys several workers hold: a row of four worker masks each
    (device, host, disk, cluster) in one flat list, and the row's slot in the table,
    whose holder column names the row. A mask is a list entry (8 B) and, past the first
    eight workers, an int of its own (ints up to 256 are CPython's shared ones). Freed
    rows are reused; they hold zeros meanwhile."""

    def __init__(self) -> None:
        self.masks: list[int] = []  # row r is masks[4r : 4r + 4]
        self.slot = array("q")  # row -> its key's table slot
        self._free: list[int] = []

    def add(self, slot: int, masks: list[int]) -> int:
        if self._free:
            row = self._free.pop()
            self.masks[4 * row : 4 * row + 4] = masks
            self.slot[row] = slot
        else:
            row = len(self.slot)
            self.masks += masks
            self.slot.append(slot)
        return row

    def remove(self, row: int) -> None:
        self.masks[4 * row : 4 * row + 4] = _NO_MASKS
        self._free.append(row)

    def held(self, row: int) -> int:
        """Every worker holding the row's key, on any tier."""
        m = self.masks
        return m[4 * row] | m[4 * row + 1] | m[4 * row + 2] | m[4 * row + 3]

    def holding(self, worker: int) -> list[int]:
        return [row for row in range(len(self.slot)) if self.held(row) >> worker & 1]

    def in_use(self) -> set[int]:
        return set(range(len(self.slot))) - set(self._free)

    def approx_bytes(self) -> int:
        """The lists and the array, and the masks that are ints of their own (sampled)."""
        sampled = min(len(self.masks), 4 * _SAMPLE)
        own = sum(sys.getsizeof(m) for m in islice(self.masks, sampled) if m > 256)
        containers = sum(sys.getsizeof(c) for c in (self.masks, self.slot, self._free))
        return containers + (len(self.masks) * own // sampled if sampled else 0)


_NO_MASKS = [0, 0, 0, 0]


def _place(keys: npt.NDArray[np.uint64], bits: int) -> npt.NDArray[np.int64]:
    """Slots for distinct ``keys`` in an empty table of ``2**bits``, as inserting them one
    by one with linear probing would (each at or after its home, with no free slot
    between): every round, each key still unplaced claims its current slot, the first
    claimant of a free slot takes it, the others step on."""
    size = 1 << bits
    home = (keys * np.uint64(_GOLDEN)) >> np.uint64(64 - bits)  # wraps mod 2**64, as _probe's mask does
    at = home.astype(np.int64)
    slots = np.empty(len(keys), dtype=np.int64)
    taken = np.zeros(size, dtype=bool)
    pending = np.arange(len(keys))
    while len(pending):
        free = ~taken[at[pending]]
        claim, index = np.unique(at[pending[free]], return_index=True)
        winners = pending[free][index]
        slots[winners], taken[claim] = claim, True
        placed = np.zeros(len(keys), dtype=bool)
        placed[winners] = True
        pending = pending[~placed[pending]]
        at[pending] = (at[pending] + 1) & (size - 1)
    return slots


def by_slot(stopped: list[tuple[int, int]], slots: int) -> npt.NDArray[np.int32]:
    """Counts by slot, from (bitset of slots, count) pairs of disjoint bitsets; 0 elsewhere."""
    counts = np.zeros(slots, dtype=np.int32)
    for mask, blocks in stopped:
        raw = np.frombuffer(mask.to_bytes((slots + 7) // 8, "little"), dtype=np.uint8)
        counts[np.unpackbits(raw, count=slots, bitorder="little").view(bool)] = blocks
    return counts


def _bits_of(mask: int) -> list[int]:
    """The positions of the set bits of ``mask``, lowest first."""
    if mask.bit_count() <= _DECODE_LOOP:
        out = []
        while mask:
            low = mask & -mask
            out.append(low.bit_length() - 1)
            mask ^= low
        return out
    raw = np.frombuffer(mask.to_bytes((mask.bit_length() + 7) // 8, "little"), dtype=np.uint8)
    positions: list[int] = np.flatnonzero(np.unpackbits(raw, bitorder="little")).tolist()
    return positions


@dataclass(slots=True)
class _Walk:
    """One ``match``: the workers still matching, as masks, and where the others stopped.

    Invariant: ``device`` is a subset of ``reach`` (a key on a worker's device tier is
    reachable by it).
    """

    reach: int  # still matching on some tier (their own, or the cluster's)
    device: int  # still matching on their device tier
    stopped: list[tuple[int, int]] = field(default_factory=list)  # (workers, leading blocks they match)
    device_stopped: list[tuple[int, int]] = field(default_factory=list)  # the same, device tier

    def step(self, i: int, device: int, own: int, in_cluster: bool) -> bool:
        """Take key ``i``; False when no worker can match it (the walk ends before it)."""
        reach = self.reach if in_cluster else self.reach & own
        if not reach and not in_cluster:
            return False
        self._stop(self.stopped, self.reach & ~reach, i)
        self.reach = reach
        kept = self.device & device
        self._stop(self.device_stopped, self.device & ~kept, i)
        self.device = kept
        return True

    def finish(self, end: int) -> None:
        if end:
            self.stopped.append((self.reach, end))
            self.device_stopped.append((self.device, end))

    @staticmethod
    def _stop(stopped: list[tuple[int, int]], workers: int, blocks: int) -> None:
        if workers and blocks:  # stopping at 0 is matching nothing: not reported
            stopped.append((workers, blocks))


class _Names:
    """Worker masks back to ``{worker id: blocks}``, the shape ``match_counts`` returns.

    A prefix held fleet-wide (a system prompt) stops hundreds of workers at its end,
    each lookup a slightly different set of them as caches churn. Building that map costs
    ~40 us at 750 workers, copying one ~4: so the last map built for each prefix is kept
    (``_KEPT_NAMES`` of them, ~40 KB each at 750 workers), and a mask close to its mask
    starts from a copy and fixes the difference. The worker of a bit changes only on a
    join or a departure, which drops them all (``clear``).
    """

    def __init__(self) -> None:
        self._kept: dict[int, tuple[int, dict[str, int]]] = {}  # last key of the prefix -> (mask, map)

    def clear(self) -> None:
        self._kept.clear()

    def counts(self, stopped: list[tuple[int, int]], ids: list[str | None], keys: list[int]) -> dict[str, int]:
        """``stopped`` as a map; ``keys`` are the prompt's, which name the prefixes."""
        out: dict[str, int] = {}
        for mask, blocks in stopped:
            if mask.bit_count() <= _DECODE_LOOP:
                for slot in _bits_of(mask):
                    out[ids[slot]] = blocks  # type: ignore[index]
            elif out:
                out.update(self._named(mask, blocks, ids, keys[blocks - 1]))
            else:
                out = self._named(mask, blocks, ids, keys[blocks - 1])
        return out

    def _named(self, mask: int, blocks: int, ids: list[str | None], prefix: int) -> dict[str, int]:
        """A new map of the workers of ``mask`` to ``blocks``, the length of ``prefix``."""
        kept_mask, kept = self._kept.get(prefix, (0, {}))
        if 4 * (kept_mask ^ mask).bit_count() < mask.bit_count():
            named = kept.copy()
            for slot in _bits_of(kept_mask & ~mask):
                del named[ids[slot]]  # type: ignore[arg-type]
            named.update(dict.fromkeys([ids[slot] for slot in _bits_of(mask & ~kept_mask)], blocks))  # type: ignore[misc]
            return named
        if len(self._kept) >= _KEPT_NAMES:
            self._kept.clear()
        named = dict.fromkeys([ids[slot] for slot in _bits_of(mask)], blocks)  # type: ignore[misc]
        self._kept[prefix] = (mask, named)
        return named.copy()
