"""Simulated workers in virtual time: the engines of ``switchyard bench sim``.

One class plays every role, because every role runs the same engine loop (vLLM's
continuous batching with chunked prefill): an iteration decodes one token for each
running sequence and fills the rest of its token budget with prompt chunks, first
come first served; its duration comes from ``CostModel.iteration_s``.

- ``prefill`` workers only ever hold prompt chunks (no running sequences): batches of
  ``chunk_tokens`` prompt tokens, the time ``a + b x work``.
- ``decode`` workers receive a ``DecodeTask``, wait for the KV to arrive over their link
  (one transfer at a time), then decode. A ``LocalTask`` is prefilled there first.
- ``both`` (colocated) workers prefill and then decode the same request: their prompt
  chunks ride in the same iterations as their decodes, so decode slows while they run.

Every worker has a tiered prefix cache of block keys (``PrefixCache``): the device
(HBM), then optionally host DRAM and local disk, an LRU each; a block evicted from one
tier moves to the next. It is looked up when a prompt's first chunk is scheduled and
filled when its prefill ends. Blocks found on host or disk are loaded to the device
first (``CostModel.fetch_s``, one load at a time per worker): the prompt waits for its
load while the worker's other prompts and decodes go on, as under vLLM's asynchronous
KV connectors (a request in ``WAITING_FOR_REMOTE_KVS`` is skipped by the scheduler, not
waited for). Prefill and ``both`` workers report the cache's changes as
``KvEventBatch``es (seq from 1) whose events name their tier, and answer snapshots with
every tier.
Decode workers, like ``workers.decode``, keep the blocks handed to them (and those of
their local prefills) and report them too, so conditional disaggregation finds a
conversation's earlier turns where they were decoded; ``reports_kv=False`` turns that
off, to measure what it gives.

Sequences are not stepped one by one: a running sequence's finishing iteration is
known when it joins (its join iteration + its remaining tokens), so an iteration costs
O(1) plus the sequences that end in it, whatever the batch size.
"""

from __future__ import annotations

import heapq
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

from switchyard.bench.costmodel import CostModel
from switchyard.schemas import (
    DecodeTask,
    KvEvent,
    KvEventBatch,
    KvSnapshot,
    LocalTask,
    PrefillDone,
    PrefillTask,
    PromptUsage,
    RequestFinished,
    Role,
    SimKvHandle,
    Tier,
    WorkerEvent,
    WorkerTask,
)
from switchyard.workers import TierCache

# Same-time order: what happened (arrivals, iteration ends, transfers) before workers
# start their next iteration, so that work arriving at one instant shares a batch.
EVENT, KICK, TICK = 0, 1, 2


class EventLoop:
    """Virtual time: a heap of (time, order, seq, callback)."""

    def __init__(self) -> None:
        self.now = 0.0
        self._heap: list[tuple[float, int, int, Callable[[float], None]]] = []
        self._seq = 0
        self.processed = 0

    def at(self, when: float, callback: Callable[[float], None], order: int = EVENT) -> None:
        self._seq += 1
        heapq.heappush(self._heap, (when, order, self._seq, callback))

    def run(self) -> None:
        heap = self._heap
        while heap:
            when, _, _, callback = heapq.heappop(heap)
            self.now = when
            self.processed += 1
            callback(when)

    def __len__(self) -> int:
        return len(self._heap)


class Sink(Protocol):
    """Where a worker's output goes (the replay driver, which feeds the core)."""

    def worker_event(self, event: WorkerEvent, now: float) -> None: ...

    def kv_events(self, batch: KvEventBatch, now: float) -> None: ...


@dataclass(frozen=True, slots=True)
class TierCounts:
    """Of a prompt's leading cached blocks (or their tokens), how many came from each tier."""

    device: int = 0
    host: int = 0
    disk: int = 0

    @property
    def total(self) -> int:
        return self.device + self.host + self.disk


@dataclass(slots=True)
class _Prompt:
    task: PrefillTask | LocalTask
    arrived: float
    total: int
    decode_here: bool
    cached: int = -1  # -1 until its first chunk is scheduled (the cache lookup)
    done: int = 0  # prompt positions computed so far (cached ones count as computed)
    started: float = 0.0
    served: TierCounts = TierCounts()  # its cached tokens, by the tier they were found on
    loading: bool = False  # its host/disk blocks are on their way to the device


@dataclass(slots=True)
class _Chunk:
    prompt: _Prompt
    end: int


@dataclass(slots=True)
class _Joining:
    request_id: str
    context: int  # prompt + the first token
    tokens: int  # the whole output, the first token (from prefill) included


class PrefixCache:
    """A worker's tiered prefix cache: device (HBM), then host DRAM, then local disk, an LRU
    each. A block evicted from one tier moves to the next (from the last it is gone); a block
    found below the device is loaded back up to it. Tiers are exclusive: a key is on one.

    ``lookup`` counts a prompt's leading blocks found on any tier and brings them all to the
    device (as recent); ``insert`` stores a prefilled prompt's blocks on the device. Both only
    move keys; what a load costs is the worker's business (``CostModel.fetch_s``).
    """

    def __init__(self, device: int, host: int = 0, disk: int = 0) -> None:
        self.tiers = [TierCache("device", device), TierCache("host", host), TierCache("disk", disk)]
        self.capacity = device

    def lookup(self, keys: list[int]) -> TierCounts:
        found = [0, 0, 0]
        for key in keys:
            level = self._level(key)
            if level is None:
                break
            found[level] += 1
        hits = TierCounts(*found)
        self.insert(keys[: hits.total])
        return hits

    def on_device(self, keys: list[int]) -> int:
        """How many of a prompt's leading blocks are on the device tier (nothing moves)."""
        device, held = self.tiers[0], 0
        for key in keys:
            if key not in device:
                break
            held += 1
        return held

    def insert(self, keys: list[int]) -> None:
        """``keys`` on the device tier, the last most recent; what they push out moves down."""
        device = self.tiers[0]
        if device.capacity <= 0:
            return
        for key in keys:
            level = self._level(key)
            if level == 0:
                device.touch(key)
                continue
            if level is not None:
                self.tiers[level].discard(key)
            self._place(0, key)

    def _place(self, level: int, key: int) -> None:
        """``key`` onto tier ``level``; each eviction cascades to the next tier there is."""
        for tier in self.tiers[level:]:
            if tier.capacity <= 0:
                continue  # no such tier
            evicted = tier.add(key)  # one key added: at most one evicted
            if not evicted:
                return
            (key,) = evicted

    def _level(self, key: int) -> int | None:
        for level, tier in enumerate(self.tiers):
            if key in tier:
                return level
        return None

    def take_events(self) -> list[KvEvent]:
        """The changes since the last call, per tier (device first)."""
        return [event for tier in self.tiers for event in tier.take_events()]

    def keys(self, tier: Tier = "device") -> list[int]:
        return self.tiers[_LEVELS[tier]].keys()

    def snapshot(self) -> dict[str, list[int]]:
        """Every tier that can hold anything -> its keys, least recent first."""
        return {tier.tier: tier.keys() for tier in self.tiers if tier.capacity > 0 or tier.tier == "device"}

    def __len__(self) -> int:
        return sum(len(tier) for tier in self.tiers)


_LEVELS: dict[str, int] = {"device": 0, "host": 1, "disk": 2}


@dataclass
class WorkerStats:
    busy_s: float = 0.0
    iterations: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    fetch_s: float = 0.0  # host/disk -> device loads, summed


class SimWorker:
    def __init__(
        self,
        worker_id: str,
        role: Role,
        cost: CostModel,
        cache_blocks: int,
        loop: EventLoop,
        sink: Sink,
        reports_kv: bool | None = None,
        *,
        host_cache_blocks: int = 0,
        disk_cache_blocks: int = 0,
        on_served: Callable[[str, TierCounts], None] | None = None,
    ) -> None:
        self.worker_id, self.role, self.cost = worker_id, role, cost
        self.reports_kv = True if reports_kv is None else reports_kv
        self.cache = PrefixCache(cache_blocks, host_cache_blocks, disk_cache_blocks)
        self._on_served = on_served  # told each prefilled prompt's cached tokens by tier
        self._loop, self._sink = loop, sink
        self._prompts: deque[_Prompt] = deque()
        self._joining: list[_Joining] = []  # ready to decode from the next iteration on
        # (iteration it ends in, order, request id, its KV tokens then, tokens generated)
        self._finishing: list[tuple[int, int, str, int, int]] = []
        self._stepping: list[str] = []  # joined in the iteration running now: its first step
        self._first_step_at: dict[str, float] = {}  # when each sequence's first step ended
        self._order = 0
        self._iteration = 0
        self._running = 0
        self._kv_tokens = 0
        self._busy = False
        self._kicked = False
        self._in_flight: list[_Chunk] = []
        self._link_free_at = 0.0
        self._transfers = 0
        self._fetch_free_at = 0.0  # host/disk -> device loads, one at a time
        self._fetches = 0
        self._kv_seq = 0
        self.stats = WorkerStats()

    # --- inputs ------------------------------------------------------------------------

    def accept(self, task: WorkerTask, now: float) -> None:
        if isinstance(task, DecodeTask):
            self._receive(task, now)
            return
        decode_here = isinstance(task, LocalTask)
        assert self.role != "decode" or isinstance(task, LocalTask), f"{self.worker_id} got {task!r}"
        self._prompts.append(_Prompt(task, now, len(task.spec.prompt_tokens), decode_here))
        self._kick(now)

    def snapshot(self) -> KvSnapshot:
        blocks = self.cache.snapshot() if self.reports_kv else {}
        return KvSnapshot(worker_id=self.worker_id, seq=self._kv_seq, blocks=blocks)

    @property
    def active(self) -> bool:
        """Busy, about to be, or waiting for a transfer or a load: virtual time still matters to it."""
        return self._busy or self._kicked or self._transfers > 0 or self._fetches > 0

    # --- decode handoff ------------------------------------------------------------------

    def _receive(self, task: DecodeTask, now: float) -> None:
        spec = task.spec
        start = max(now, self._link_free_at)
        # Only what its device lacks crosses the link: vLLM's connector is asked for the
        # tokens past the local prefix-cache hit (the blocks its running decodes share).
        held = self.cache.on_device(spec.block_keys) * spec.block_size
        self._link_free_at = start + self.cost.transfer_s(len(spec.prompt_tokens) - held)
        self._transfers += 1
        joining = _Joining(spec.request_id, len(spec.prompt_tokens) + 1, spec.sampling.max_tokens)

        def arrived(when: float) -> None:
            self._transfers -= 1
            if self.reports_kv:  # a decode worker that keeps and reports what it was handed
                self.cache.insert(spec.block_keys)
                self._publish(when)
            self._joining.append(joining)
            self._kick(when)

        self._loop.at(self._link_free_at, arrived)

    # --- the engine loop -------------------------------------------------------------------

    def _kick(self, now: float) -> None:
        if not self._busy and not self._kicked and (self._prompts or self._joining or self._running):
            self._kicked = True
            self._loop.at(now, self._start, KICK)

    def _start(self, now: float) -> None:
        self._kicked = False
        if self._busy:
            return
        self._join(self._iteration)
        budget = self.cost.chunk_tokens - self._running
        work = 0.0
        chunks: list[_Chunk] = []
        for prompt in self._prompts:
            if budget <= 0:
                break
            if prompt.cached < 0:
                self._look_up(prompt, now)
            if prompt.loading:
                continue  # like vLLM's WAITING_FOR_REMOTE_KVS: the prompts behind it go on
            end = min(prompt.total, prompt.done + budget)
            work += self.cost.chunk_work(prompt.done, end)
            budget -= end - prompt.done
            chunks.append(_Chunk(prompt, end))
            self._commit(prompt, end)
        self._publish(now)  # what the lookups moved between tiers, and the blocks scheduled
        if not chunks and not self._running:
            return
        duration = self.cost.iteration_s(work, self._running, self._kv_tokens)
        self._busy, self._in_flight = True, chunks
        self.stats.busy_s += duration
        self.stats.iterations += 1
        self._loop.at(now + duration, self._end)

    def _commit(self, prompt: _Prompt, end: int) -> None:
        """The prompt's whole blocks up to ``end`` are cached from the iteration that computes
        them on, as vLLM does (``KVCacheManager.allocate_slots`` caches the blocks of the tokens
        it schedules, and its KV events say so then): a prompt scheduled after this one, in this
        iteration or a later one, finds them. (A layer writes every token's KV before its
        attention reads it, so one forward pass serves both.) With its last chunk, all of its
        blocks, as when it is done (``_advance_prompts``)."""
        spec = prompt.task.spec
        whole = len(spec.block_keys) if end >= prompt.total else end // spec.block_size
        if whole:
            self.cache.insert(spec.block_keys[:whole])

    def _look_up(self, prompt: _Prompt, now: float) -> None:
        spec = prompt.task.spec
        hits = self.cache.lookup(spec.block_keys)
        # Even a fully cached prompt computes its last position, for the first token's logits.
        prompt.cached = min(hits.total * spec.block_size, prompt.total - 1)
        prompt.done, prompt.started = prompt.cached, now
        prompt.served = _tokens_by_tier(hits, spec.block_size, prompt.cached)
        self.stats.prompt_tokens += prompt.total
        self.stats.cached_tokens += prompt.cached
        if prompt.served.host or prompt.served.disk:
            self._load(prompt, now)

    def _load(self, prompt: _Prompt, now: float) -> None:
        """Bring a prompt's host/disk blocks to the device before its first chunk; the
        worker's other prompts and decodes go on meanwhile (an asynchronous KV connector)."""
        seconds = self.cost.fetch_s(prompt.served.host, prompt.served.disk)
        start = max(now, self._fetch_free_at)
        self._fetch_free_at = start + seconds
        self._fetches += 1
        prompt.loading = True
        self.stats.fetch_s += seconds

        def loaded(when: float) -> None:
            self._fetches -= 1
            prompt.loading = False
            self._kick(when)

        self._loop.at(self._fetch_free_at, loaded)

    def _end(self, now: float) -> None:
        # Outputs first, while still busy: dispatches they cause land in the next iteration.
        self._iteration += 1
        self._kv_tokens += self._running
        for request_id in self._stepping:
            self._first_step_at[request_id] = now
        self._stepping.clear()
        done = self._advance_prompts()
        self._publish(now)
        for prompt in done:
            self._prefill_done(prompt, now)
        self._finish_sequences(now)
        self._busy, self._in_flight = False, []
        self._kick(now)

    def _advance_prompts(self) -> list[_Prompt]:
        """The prompts whose last chunk just ran, in queue order, out of the queue and into
        the cache. (Not only the queue's head: a prompt still loading lets later ones pass.)"""
        for chunk in self._in_flight:
            chunk.prompt.done = chunk.end
        done = [chunk.prompt for chunk in self._in_flight if chunk.end >= chunk.prompt.total]
        if done:
            self._prompts = deque(p for p in self._prompts if p.done < p.total)
        for prompt in done:
            self.cache.insert(prompt.task.spec.block_keys)
        return done

    def _prefill_done(self, prompt: _Prompt, now: float) -> None:
        spec = prompt.task.spec
        finished = spec.sampling.max_tokens <= 1
        usage = PromptUsage(
            prompt_tokens=prompt.total,
            cached_tokens=prompt.cached,
            queued_s=prompt.started - prompt.arrived,
            prefill_s=now - prompt.started,
        )
        handle = SimKvHandle(worker_id=self.worker_id, block_keys=spec.block_keys, num_tokens=prompt.total)
        if self._on_served is not None:
            self._on_served(spec.request_id, prompt.served)
        if prompt.decode_here and not finished:
            self._joining.append(_Joining(spec.request_id, prompt.total + 1, spec.sampling.max_tokens))
        self._sink.worker_event(
            PrefillDone(
                worker_id=self.worker_id,
                request_id=spec.request_id,
                handle=handle,
                first_token=0,
                usage=usage,
                finished=finished,
            ),
            now,
        )

    def _join(self, iteration: int) -> None:
        for seq in self._joining:
            self._order += 1
            remaining = seq.tokens - 1
            heapq.heappush(
                self._finishing,
                (iteration + remaining, self._order, seq.request_id, seq.context + remaining, seq.tokens),
            )
            self._running += 1
            self._kv_tokens += seq.context
            self._stepping.append(seq.request_id)
        self._joining.clear()

    def _finish_sequences(self, now: float) -> None:
        finishing = self._finishing
        while finishing and finishing[0][0] <= self._iteration:
            _, _, request_id, final_kv, generated = heapq.heappop(finishing)
            self._running -= 1
            self._kv_tokens -= final_kv
            steps = generated - 1  # its tokens after the first, one a step
            first = self._first_step_at.pop(request_id)
            self._sink.worker_event(
                RequestFinished(
                    worker_id=self.worker_id,
                    request_id=request_id,
                    generated_tokens=generated,
                    reason="length",
                    step_s=(now - first) / (steps - 1) if steps > 1 else 0.0,
                ),
                now,
            )

    def _publish(self, now: float) -> None:
        events = self.cache.take_events()
        if events and self.reports_kv:
            self._kv_seq += 1
            self._sink.kv_events(KvEventBatch(worker_id=self.worker_id, seq=self._kv_seq, events=events), now)


def _tokens_by_tier(hits: TierCounts, block_size: int, cached: int) -> TierCounts:
    """A prompt's ``cached`` tokens split by the tier its blocks were found on. ``cached``
    may be short of the blocks' tokens (a short last block, the last position always
    computed): the shortfall is taken from the deepest tiers, so a load is never overcounted."""
    device = min(hits.device * block_size, cached)
    host = min(hits.host * block_size, cached - device)
    return TierCounts(device, host, cached - device - host)


@dataclass
class FleetShape:
    prefill: int
    decode: int
    colocated: bool = False
    cache_blocks: int = CostModel().kv_capacity_tokens // 512  # HBM only
    prefill_token_budget: int = 65_536
    host_cache_blocks: int = 0  # below the device tier, per worker; 0: none
    disk_cache_blocks: int = 0
    # Disaggregated, with prefill workers of role "both": they prefill and hand over as prefill
    # workers do, and ``switchyard`` may lend them to decoding (``scheduler.lending``).
    lendable: bool = False
    roles: dict[str, Role] = field(init=False)

    def __post_init__(self) -> None:
        if self.colocated:
            self.roles = {f"both-{i}": "both" for i in range(self.prefill + self.decode)}
        else:
            self.roles = {f"prefill-{i}": "both" if self.lendable else "prefill" for i in range(self.prefill)}
            self.roles |= {f"decode-{i}": "decode" for i in range(self.decode)}


__all__ = [
    "EVENT",
    "KICK",
    "TICK",
    "EventLoop",
    "FleetShape",
    "PrefixCache",
    "SimWorker",
    "Sink",
    "TierCounts",
    "WorkerStats",
]
