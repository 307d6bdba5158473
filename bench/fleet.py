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

Every worker has a bounded LRU prefix cache of block keys, looked up when a prompt's
first chunk is scheduled and filled when its prefill ends. Prefill and ``both`` workers
report its changes as ``KvEventBatch``es (seq from 1) and answer snapshots from it.
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
from collections import OrderedDict, deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

from switchyard.bench.costmodel import CostModel
from switchyard.schemas import (
    BlocksRemoved,
    BlocksStored,
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
    WorkerEvent,
    WorkerTask,
)

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


@dataclass(slots=True)
class _Prompt:
    task: PrefillTask | LocalTask
    arrived: float
    total: int
    decode_here: bool
    cached: int = -1  # -1 until its first chunk is scheduled (the cache lookup)
    done: int = 0  # prompt positions computed so far (cached ones count as computed)
    started: float = 0.0


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
    """A bounded LRU of block keys; ``lookup`` counts the leading hits and refreshes them."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._blocks: OrderedDict[int, None] = OrderedDict()

    def lookup(self, keys: list[int]) -> int:
        blocks = self._blocks
        hits = 0
        for key in keys:
            if key not in blocks:
                break
            blocks.move_to_end(key)
            hits += 1
        return hits

    def insert(self, keys: list[int], stored: list[int], removed: list[int]) -> None:
        if self.capacity <= 0:
            return
        blocks = self._blocks
        for key in keys:
            if key in blocks:
                blocks.move_to_end(key)
            else:
                blocks[key] = None
                stored.append(key)
        while len(blocks) > self.capacity:
            removed.append(blocks.popitem(last=False)[0])

    def keys(self) -> list[int]:
        return list(self._blocks)

    def __len__(self) -> int:
        return len(self._blocks)


@dataclass
class WorkerStats:
    busy_s: float = 0.0
    iterations: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0


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
    ) -> None:
        self.worker_id, self.role, self.cost = worker_id, role, cost
        self.reports_kv = True if reports_kv is None else reports_kv
        self.cache = PrefixCache(cache_blocks)
        self._loop, self._sink = loop, sink
        self._prompts: deque[_Prompt] = deque()
        self._joining: list[_Joining] = []  # ready to decode from the next iteration on
        # (iteration it ends in, order, request id, its KV tokens then, tokens generated)
        self._finishing: list[tuple[int, int, str, int, int]] = []
        self._order = 0
        self._iteration = 0
        self._running = 0
        self._kv_tokens = 0
        self._busy = False
        self._kicked = False
        self._in_flight: list[_Chunk] = []
        self._link_free_at = 0.0
        self._transfers = 0
        self._kv_seq = 0
        self.stats = WorkerStats()

    # --- inputs ------------------------------------------------------------------------

    def accept(self, task: WorkerTask, now: float) -> None:
        if isinstance(task, DecodeTask):
            self._receive(task, now)
            return
        decode_here = isinstance(task, LocalTask) or self.role == "both"
        assert self.role != "decode" or isinstance(task, LocalTask), f"{self.worker_id} got {task!r}"
        self._prompts.append(_Prompt(task, now, len(task.spec.prompt_tokens), decode_here))
        self._kick(now)

    def snapshot(self) -> KvSnapshot:
        blocks = {"device": self.cache.keys()} if self.reports_kv else {}
        return KvSnapshot(worker_id=self.worker_id, seq=self._kv_seq, blocks=blocks)

    @property
    def active(self) -> bool:
        """Busy, about to be, or waiting for a transfer: virtual time still matters to it."""
        return self._busy or self._kicked or self._transfers > 0

    # --- decode handoff ------------------------------------------------------------------

    def _receive(self, task: DecodeTask, now: float) -> None:
        spec = task.spec
        start = max(now, self._link_free_at)
        self._link_free_at = start + self.cost.transfer_s(len(spec.prompt_tokens))
        self._transfers += 1
        joining = _Joining(spec.request_id, len(spec.prompt_tokens) + 1, spec.sampling.max_tokens)

        def arrived(when: float) -> None:
            self._transfers -= 1
            if self.reports_kv:  # a decode worker that keeps and reports what it was handed
                stored: list[int] = []
                removed: list[int] = []
                self.cache.insert(spec.block_keys, stored, removed)
                self._publish(stored, removed, when)
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
            end = min(prompt.total, prompt.done + budget)
            work += self.cost.chunk_work(prompt.done, end)
            budget -= end - prompt.done
            chunks.append(_Chunk(prompt, end))
        if not chunks and not self._running:
            return
        duration = self.cost.iteration_s(work, self._running, self._kv_tokens)
        self._busy, self._in_flight = True, chunks
        self.stats.busy_s += duration
        self.stats.iterations += 1
        self._loop.at(now + duration, self._end)

    def _look_up(self, prompt: _Prompt, now: float) -> None:
        spec = prompt.task.spec
        hits = self.cache.lookup(spec.block_keys)
        # Even a fully cached prompt computes its last position, for the first token's logits.
        prompt.cached = min(hits * spec.block_size, prompt.total - 1)
        prompt.done, prompt.started = prompt.cached, now
        self.stats.prompt_tokens += prompt.total
        self.stats.cached_tokens += prompt.cached

    def _end(self, now: float) -> None:
        # Outputs first, while still busy: dispatches they cause land in the next iteration.
        self._iteration += 1
        self._kv_tokens += self._running
        stored: list[int] = []
        removed: list[int] = []
        done = self._advance_prompts(stored, removed)
        self._publish(stored, removed, now)
        for prompt in done:
            self._prefill_done(prompt, now)
        self._finish_sequences(now)
        self._busy, self._in_flight = False, []
        self._kick(now)

    def _advance_prompts(self, stored: list[int], removed: list[int]) -> list[_Prompt]:
        done = []
        for chunk in self._in_flight:
            chunk.prompt.done = chunk.end
        while self._prompts and self._prompts[0].done >= self._prompts[0].total:
            prompt = self._prompts.popleft()
            self.cache.insert(prompt.task.spec.block_keys, stored, removed)
            done.append(prompt)
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
        self._joining.clear()

    def _finish_sequences(self, now: float) -> None:
        finishing = self._finishing
        while finishing and finishing[0][0] <= self._iteration:
            _, _, request_id, final_kv, generated = heapq.heappop(finishing)
            self._running -= 1
            self._kv_tokens -= final_kv
            self._sink.worker_event(
                RequestFinished(
                    worker_id=self.worker_id, request_id=request_id, generated_tokens=generated, reason="length"
                ),
                now,
            )

    def _publish(self, stored: list[int], removed: list[int], now: float) -> None:
        if not self.reports_kv:
            return
        events: list[KvEvent] = []
        if stored:
            events.append(BlocksStored(keys=stored))
        if removed:
            events.append(BlocksRemoved(keys=removed))
        if events:
            self._kv_seq += 1
            self._sink.kv_events(KvEventBatch(worker_id=self.worker_id, seq=self._kv_seq, events=events), now)


@dataclass
class FleetShape:
    prefill: int
    decode: int
    colocated: bool = False
    cache_blocks: int = CostModel().kv_capacity_tokens // 512  # HBM only
    prefill_token_budget: int = 65_536
    roles: dict[str, Role] = field(init=False)

    def __post_init__(self) -> None:
        if self.colocated:
            self.roles = {f"both-{i}": "both" for i in range(self.prefill + self.decode)}
        else:
            self.roles = {f"prefill-{i}": "prefill" for i in range(self.prefill)}
            self.roles |= {f"decode-{i}": "decode" for i in range(self.decode)}


__all__ = ["EVENT", "KICK", "TICK", "EventLoop", "FleetShape", "PrefixCache", "SimWorker", "Sink", "WorkerStats"]
