"""``switchyard bench scheduler``: the decision core alone, at fleet scale, on one core.

    switchyard bench scheduler --out bench/results/scheduler --repeats 3
    switchyard bench scheduler --policies switchyard --check-digest bench/results/scheduler/results.json

One process, no bus: the real ``SchedulerCore`` driven in virtual time, as
``bench.replay`` drives it, with every worker reduced to what the core hears from it.

1. **Fleet.** ``--prefill`` + ``--decode`` workers (750 + 250) register with one
   ``LoadReport`` each and answer the core's snapshot request with an empty cache.
2. **Fill** (untimed for decisions, timed for ingestion). Seeded conversations are
   prefilled on their home worker, and each worker's cache (an LRU of
   ``--entries / --prefill`` blocks, so the fleet holds ``--entries`` (block, worker)
   pairs when full) reports what it stored and evicted as ``KvEventBatch``es, until the
   index holds about ``--entries`` pairs.
3. **Timed phase.** ``--requests`` more requests of the same workload (after ``--warmup``
   untimed ones) arrive, Poisson, at ``--rate-per-worker`` per prefill worker; the core
   places them; each prefill ends after the cost model's time for its uncached tokens,
   its worker publishes the blocks it computed and evicted (a ``KvEventBatch``) and then
   its ``PrefillDone``; the decode ends ``decode_s_per_token`` (25 ms) per output token
   later with a ``RequestFinished``. ``tick`` runs every ``tick_s`` (0.1 s).

The workload (``Workload``; un-flagged knobs are ``BenchSettings`` fields): 32
``system_prompts`` of 1-6 blocks (Zipf-popular), then a conversation: a new one (a
``new_share`` of 0.5) brings 4-28 new blocks, a later turn extends its conversation's
prefix by 1-4 blocks; at most 8 turns.
Blocks are 512 tokens, as in the Mooncake trace, and a request's shape is close to it:
that trace averages 24 blocks a request of which 15 were never seen before; this one
averages about 22 of which about 9 were never seen before.

KV events beside the requests: each prefill publishes its computed blocks and the ones
it evicted for them, as a vLLM worker does. At the default 0.5 requests/s per prefill
worker (about half a worker's prefill throughput at the cost model's 13k tokens/s on
12k-token prompts) that is about 10 blocks stored and as many removed per request, a few
per second per worker: the Mooncake trace's churn (15 new 512-token blocks a request)
at its request shape.

Measured (``time.perf_counter`` around every core call; only the timed phase counts):
- ``decisions_per_s``: placements (prefill and decode dispatches) over all the time spent
  in the core, KV ingestion and ticks included: what one core sustains in the service.
  ``decide_per_s``: the same over the time of ``submit`` and ``on_event`` only.
- ``submit`` latency p50/p99 (a submit places its own request when anything fits), and
  ``on_event`` p99 (a ``PrefillDone`` places its decode).
- KV ingestion: blocks per second of ``on_kv_events``, in the fill and in the timed phase.
- Index memory after the fill: a ``sys.getsizeof`` walk of every object reachable from
  the ``PrefixIndex`` (``gc.get_referents``, each object once; types, modules and
  functions excluded), so it follows whatever structure the index uses. Divided by
  (block, worker) entries and by distinct blocks. ``approx_bytes()`` beside it; the same
  walk after the timed phase; and the index lookup alone (``match_counts``, and
  ``match_slots``), timed on 2,000 more prompts after the timed phase.

The heap as the service runs it: once the fill is done, what exists is frozen out of the
cyclic collector (``gc.freeze``, as ``SchedulerService`` does once settled:
``scheduler.heap``), so a full collection inside a timed call walks what was made since,
not the interpreter's modules and the harness's 20,000 conversations (a pass of about 0.1 s,
which landed in a timed call in some runs and not others). ``gc_frozen_objects`` says how
many.

A seeded run places identically every time: every dispatch (request, worker, kind) is
hashed into ``digest``; ``--check-digest FILE`` compares with a previous
``results.json`` run with the same settings (exit 1 on a difference). ``--repeats N`` runs
each policy N times from a fresh fleet (the same placements, checked) and reports the run of
the median decisions/s, every run's figures beside it: this figure swings by a third between
runs on a shared host.

Writes ``results.json`` and ``scheduler.png`` (decisions/s and submit p99 per policy)
into ``--out`` and prints a table.
"""

from __future__ import annotations

import argparse
import gc
import hashlib
import heapq
import json
import math
import os
import random
import sys
import time
import types
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from switchyard.bench import plots
from switchyard.bench.costmodel import CostModel
from switchyard.bench.sim import parse_policies, positive_int
from switchyard.bench.stats import percentile
from switchyard.scheduler import Dispatch, FailStream, RequestSnapshot, SchedulerConfig, SchedulerCore
from switchyard.schemas import (
    BlocksRemoved,
    BlocksStored,
    KvEvent,
    KvEventBatch,
    KvSnapshot,
    LoadReport,
    PrefillDone,
    PromptUsage,
    Rejected,
    RequestFinished,
    RequestSpec,
    Role,
    SamplingParams,
    SimKvHandle,
)

DEFAULT_POLICIES = "switchyard,sglang_cache_aware,dynamo_kv,llmd,llmd_precise"
BLOCK_SIZE = 512  # tokens a block, as in the Mooncake trace
MODEL = "bench-scheduler"
NEVER = 1e12  # worker expiry: no heartbeats in virtual time
MAX_TURNS = 8
FILL_SHARE = 0.98  # the fill ends once the index holds this share of --entries


@dataclass(frozen=True)
class BenchSettings:
    prefill: int = 750
    decode: int = 250
    entries: int = 1_000_000
    requests: int = 10_000
    warmup: int = 2_000
    rate_per_worker: float = 0.5
    seed: int = 0
    system_prompts: int = 32
    conversations: int = 20_000
    new_share: float = 0.5
    prefill_token_budget: int = 65_536
    decode_s_per_token: float = 0.025
    tick_s: float = 0.1

    @property
    def cache_blocks(self) -> int:
        return max(1, math.ceil(self.entries / self.prefill))

    def scheduler_config(self, policy: str) -> SchedulerConfig:
        # The index's own bound above what the caches hold: its LRU must not drop pairs
        # the workers still hold (that would measure eviction, not the fleet's state).
        bound = max(SchedulerConfig().index_max_entries, int(self.entries * 1.1))
        return SchedulerConfig(policy=policy, worker_expiry_s=NEVER, index_max_entries=bound)


# --- the workload ---------------------------------------------------------------------------


@dataclass
class Conversation:
    home: int  # the prefill worker that served it during the fill
    system: int
    keys: list[int] = field(default_factory=list)
    turns: int = 0


@dataclass(frozen=True)
class Prompt:
    keys: list[int]
    output_tokens: int
    home: int


class Workload:
    """Seeded prompts with prefix structure: a shared system prompt, then a conversation
    whose every turn extends the prefix of the one before (see the module's note)."""

    def __init__(self, settings: BenchSettings) -> None:
        self.rng = random.Random(settings.seed)
        self.settings = settings
        self.systems = [self._new_keys(self.rng.randint(1, 6)) for _ in range(settings.system_prompts)]
        self._zipf = [1 / (rank + 1) ** 1.1 for rank in range(settings.system_prompts)]
        self._pool: list[Conversation] = []

    def _new_keys(self, n: int) -> list[int]:
        return [self.rng.getrandbits(63) for _ in range(n)]

    def next(self) -> Prompt:
        rng, pool = self.rng, self._pool
        if not pool or rng.random() < self.settings.new_share:
            conv = self._start()
        else:
            slot = rng.randrange(len(pool))
            conv = pool[slot]
            if conv.turns >= MAX_TURNS:
                conv = pool[slot] = self._start(replace=False)
            else:
                conv.keys += self._new_keys(rng.randint(1, 4))
        conv.turns += 1
        return Prompt(self.systems[conv.system] + conv.keys, rng.randint(50, 650), conv.home)

    def _start(self, replace: bool = True) -> Conversation:
        rng = self.rng
        system = rng.choices(range(len(self.systems)), self._zipf)[0]
        conv = Conversation(rng.randrange(self.settings.prefill), system, self._new_keys(rng.randint(4, 28)))
        if replace:
            if len(self._pool) < self.settings.conversations:
                self._pool.append(conv)
            else:
                self._pool[rng.randrange(len(self._pool))] = conv
        return conv


class WorkerCache:
    """A worker's prefix cache as its KV events describe it: an LRU of blocks.

    A plain dict in insertion order, not an ``OrderedDict``: a dict of ints only is one the
    cyclic collector untracks, so its full passes do not walk the fleet's million cached
    blocks. Those live on the workers in a deployment, not in the scheduler's process, and a
    pass over them landing inside a timed core call once cost a third of a second."""

    def __init__(self, worker_id: str, capacity: int) -> None:
        self.worker_id, self.capacity = worker_id, capacity
        self.blocks: dict[int, None] = {}
        self.seq = 0

    def compute(self, keys: list[int]) -> KvEventBatch | None:
        """Prefill ``keys``: the blocks it lacked are stored, the oldest evicted for them."""
        stored = [k for k in keys if k not in self.blocks]
        blocks = self.blocks
        for key in reversed(keys):  # back to front, as the index does: prefixes stay newest
            blocks.pop(key, None)  # (re)inserted last: the most recent
            blocks[key] = None
        removed = []
        while len(blocks) > self.capacity:
            oldest = next(iter(blocks))
            del blocks[oldest]
            removed.append(oldest)
        removed = [k for k in removed if k not in stored]  # stored then evicted at once: never said
        stored = [k for k in stored if k in self.blocks]
        events: list[KvEvent] = []
        if stored:
            events.append(BlocksStored(keys=stored))
        if removed:
            events.append(BlocksRemoved(keys=removed))
        if not events:
            return None
        self.seq += 1
        return KvEventBatch(worker_id=self.worker_id, seq=self.seq, events=events)

    def snapshot(self) -> KvSnapshot:
        return KvSnapshot(worker_id=self.worker_id, seq=self.seq, blocks={"device": list(self.blocks)})


# --- timing ---------------------------------------------------------------------------------


@dataclass
class Timing:
    on: bool = False
    by_method: dict[str, list[float]] = field(default_factory=dict)  # name -> [calls, seconds]
    submit_s: list[float] = field(default_factory=list)
    event_s: list[float] = field(default_factory=list)
    decisions: int = 0
    dispatches: dict[str, int] = field(default_factory=dict)
    rejected: int = 0
    failed: int = 0
    kv_blocks: int = 0
    prompt_tokens: int = 0
    charged_tokens: int = 0

    def seconds(self, *names: str) -> float:
        return sum(self.by_method.get(name, [0, 0.0])[1] for name in names)


# --- the run --------------------------------------------------------------------------------

ARRIVE, PREFILL_DONE, FINISHED, TICK = 0, 1, 2, 3


class Bench:
    def __init__(self, settings: BenchSettings, policy: str) -> None:
        self.settings, self.policy = settings, policy
        self.core = SchedulerCore(settings.scheduler_config(policy))
        self.cost = CostModel()
        self.prefill_ids = [f"prefill-{i:04d}" for i in range(settings.prefill)]
        self.decode_ids = [f"decode-{i:04d}" for i in range(settings.decode)]
        self.caches = {wid: WorkerCache(wid, settings.cache_blocks) for wid in self.prefill_ids}
        self.workload = Workload(settings)
        self.rng = random.Random(settings.seed + 1)  # arrivals: apart from the workload's draws
        self.timing = Timing()
        self.digest = hashlib.sha256()
        self.placements = 0
        self.specs: dict[str, RequestSpec] = {}
        self.charged: dict[str, int] = {}  # request -> uncached tokens its prefill computes
        self._events: list[tuple[float, int, int, str]] = []  # (time, order, kind, request id)
        self._order = 0
        self._prompts: dict[int, list[int]] = {}
        self.now = 0.0

    # --- the core, timed ------------------------------------------------------------------

    def _call(self, method: Callable[..., Any], *args: Any, samples: list[float] | None = None) -> Any:
        started = time.perf_counter()
        result = method(*args)
        spent = time.perf_counter() - started
        if self.timing.on:
            tally = self.timing.by_method.setdefault(method.__name__, [0, 0.0])
            tally[0] += 1
            tally[1] += spent
            if samples is not None:
                samples.append(spent)
        return result

    def _carry_out(self, actions: list) -> None:
        for action in actions:
            match action:
                case Dispatch(worker_id=wid, task=task):
                    kind = str(task.__struct_config__.tag)
                    rid = task.spec.request_id
                    self.digest.update(f"{rid}>{wid}:{kind}\n".encode())
                    self.placements += 1
                    if self.timing.on:
                        self.timing.decisions += 1
                        self.timing.dispatches[kind] = self.timing.dispatches.get(kind, 0) + 1
                    self._dispatched(wid, kind, task)
                case RequestSnapshot(worker_id=wid):
                    cache = self.caches.get(wid)
                    snapshot = cache.snapshot() if cache else KvSnapshot(worker_id=wid, seq=0, blocks={})
                    self._carry_out(self._call(self.core.on_kv_snapshot, snapshot, self.now))
                case FailStream(request_id=rid):
                    self.specs.pop(rid, None)
                    self.timing.failed += self.timing.on
                case _:
                    pass  # BindSession: no sessions here

    def _dispatched(self, wid: str, kind: str, task: Any) -> None:
        spec = task.spec
        if kind == "prefill":
            charged = task.charged_tokens or 0
            if self.timing.on:
                self.timing.prompt_tokens += len(spec.prompt_tokens)
                self.timing.charged_tokens += charged
            self.charged[spec.request_id] = charged
            self._at(self.now + self._prefill_s(charged), PREFILL_DONE, f"{spec.request_id}@{wid}")
        else:
            decode_s = self.settings.decode_s_per_token * spec.sampling.max_tokens
            self._at(self.now + decode_s, FINISHED, f"{spec.request_id}@{wid}")

    def _prefill_s(self, charged: int) -> float:
        return self.cost.prefill_base_s + self.cost.per_token_s * charged

    def _at(self, when: float, kind: int, rid: str) -> None:
        self._order += 1
        heapq.heappush(self._events, (when, self._order, kind, rid))

    # --- phases -----------------------------------------------------------------------------

    def register(self) -> None:
        for wid in self.prefill_ids + self.decode_ids:
            role: Role = "prefill" if wid in self.caches else "decode"
            budget = self.settings.prefill_token_budget if role == "prefill" else self.cost.kv_capacity_tokens
            report = LoadReport(
                worker_id=wid,
                role=role,
                seq=1,
                engine="sim",
                model=MODEL,
                block_size=BLOCK_SIZE,
                token_budget=budget,
                inflight_tokens=0,
                running=0,
                interval_s=NEVER,
                kv_capacity_tokens=self.cost.kv_capacity_tokens,
            )
            self._carry_out(self._call(self.core.on_event, report, 0.0))

    def fill(self) -> dict:
        """KV events until the index holds about ``entries`` pairs (each prompt on its home)."""
        target = FILL_SHARE * min(self.settings.entries, self.settings.prefill * self.settings.cache_blocks)
        blocks, seconds, batches, prompts = 0, 0.0, 0, 0
        while self.core.index.entries < target:
            prompt = self.workload.next()
            prompts += 1
            batch = self.caches[self.prefill_ids[prompt.home]].compute(prompt.keys)
            if batch is None:
                continue
            started = time.perf_counter()
            actions = self.core.on_kv_events(batch, 0.0)
            seconds += time.perf_counter() - started
            assert not actions, f"the fill lost a batch: {actions}"
            blocks += _blocks(batch)
            batches += 1
        return {
            "prompts": prompts,
            "batches": batches,
            "blocks": blocks,
            "wall_s": seconds,
            "blocks_per_s": blocks / seconds if seconds else None,
        }

    def run(self) -> None:
        s = self.settings
        rate = s.rate_per_worker * s.prefill
        when = self.now
        for i in range(s.warmup + s.requests):
            when += self.rng.expovariate(rate)
            self._at(when, ARRIVE, str(i))
        self._at(self.now, TICK, "")
        arrived = 0
        while self._events:
            self.now, _, kind, rid = heapq.heappop(self._events)
            if kind == ARRIVE:
                arrived += 1
                self.timing.on = arrived > s.warmup
                self._arrive(rid)
            elif kind == PREFILL_DONE:
                self._prefill_done(*rid.split("@"))
            elif kind == FINISHED:
                self._finished(*rid.split("@"))
            else:
                self._carry_out(self._call(self.core.tick, self.now))
                if arrived < s.warmup + s.requests or self.specs:  # until every request ended
                    self._at(self.now + s.tick_s, TICK, "")

    def _arrive(self, rid: str) -> None:
        prompt = self.workload.next()
        spec = RequestSpec(
            request_id=rid,
            ingress_id="bench",
            model=MODEL,
            prompt_tokens=self._prompt_of(len(prompt.keys) * BLOCK_SIZE + BLOCK_SIZE // 2),
            block_size=BLOCK_SIZE,
            block_keys=prompt.keys,
            sampling=SamplingParams(max_tokens=prompt.output_tokens, temperature=0.0),
        )
        reply, actions = self._call(self.core.submit, spec, self.now, samples=self.timing.submit_s)
        if isinstance(reply, Rejected):
            self.timing.rejected += self.timing.on
        else:
            self.specs[rid] = spec
        self._carry_out(actions)

    def _prompt_of(self, tokens: int) -> list[int]:
        # Only its length matters to the core: one shared list a length, not 12k ints a request.
        prompt = self._prompts.get(tokens)
        if prompt is None:
            prompt = self._prompts[tokens] = [0] * tokens
        return prompt

    def _prefill_done(self, rid: str, wid: str) -> None:
        spec = self.specs[rid]
        batch = self.caches[wid].compute(spec.block_keys)
        if batch is not None:  # the worker publishes its cache changes, then its result
            if self.timing.on:
                self.timing.kv_blocks += _blocks(batch)
            self._carry_out(self._call(self.core.on_kv_events, batch, self.now))
        tokens, charged = len(spec.prompt_tokens), self.charged.pop(rid)
        # The cost model's time for what it computed: the core learns each worker's rate.
        usage = PromptUsage(prompt_tokens=tokens, cached_tokens=tokens - charged, prefill_s=self._prefill_s(charged))
        done = PrefillDone(
            worker_id=wid,
            request_id=rid,
            handle=SimKvHandle(worker_id=wid, block_keys=spec.block_keys, num_tokens=tokens),
            first_token=1,
            usage=usage,
            finished=False,
        )
        self._carry_out(self._call(self.core.on_event, done, self.now, samples=self.timing.event_s))

    def _finished(self, rid: str, wid: str) -> None:
        spec = self.specs.pop(rid)
        finished = RequestFinished(
            worker_id=wid, request_id=rid, generated_tokens=spec.sampling.max_tokens, reason="length"
        )
        self._carry_out(self._call(self.core.on_event, finished, self.now, samples=self.timing.event_s))

    # --- results ------------------------------------------------------------------------------

    def summary(self) -> dict:
        t = self.timing
        all_s = sum(seconds for _, seconds in t.by_method.values())
        decide_s = t.seconds("submit", "on_event")
        ms = [1e3 * x for x in t.submit_s]
        return {
            "policy": self.policy,
            "decisions": t.decisions,
            "dispatches": dict(sorted(t.dispatches.items())),
            "rejected": t.rejected,
            "failed": t.failed,
            "decisions_per_s": t.decisions / all_s if all_s else None,
            "decide_per_s": t.decisions / decide_s if decide_s else None,
            "core_s": all_s,
            "submit_p50_ms": percentile(ms, 50),
            "submit_p99_ms": percentile(ms, 99),
            "submit_max_ms": max(ms) if ms else None,
            "event_p99_ms": percentile([1e3 * x for x in t.event_s], 99),
            "kv_blocks": t.kv_blocks,
            "kv_blocks_per_s": t.kv_blocks / t.seconds("on_kv_events") if t.seconds("on_kv_events") else None,
            "kv_blocks_per_decision": t.kv_blocks / t.decisions if t.decisions else None,
            "prefill_hit_ratio": 1 - t.charged_tokens / t.prompt_tokens if t.prompt_tokens else None,
            "by_method": {
                name: {"calls": int(calls), "s": seconds, "us_per_call": 1e6 * seconds / calls}
                for name, (calls, seconds) in sorted(t.by_method.items())
            },
            "placements": self.placements,
            "digest": self.digest.hexdigest(),
        }


def _blocks(batch: KvEventBatch) -> int:
    return sum(len(e.keys) for e in batch.events if isinstance(e, BlocksStored | BlocksRemoved))


def deep_bytes(root: object) -> tuple[int, int]:
    """``sys.getsizeof`` summed over every object reachable from ``root``, each once
    (types, modules, functions and code excluded); and how many objects that was.
    Interned strings shared with the rest of the core (worker ids) count here once."""
    skip = (type, types.ModuleType, types.FunctionType, types.BuiltinFunctionType, types.CodeType)
    seen: set[int] = set()
    stack = [root]
    total = 0
    while stack:
        obj = stack.pop()
        if id(obj) in seen or isinstance(obj, skip):
            continue
        seen.add(id(obj))
        total += sys.getsizeof(obj)
        stack.extend(gc.get_referents(obj))
        if isinstance(obj, dict):  # a dict of str keys does not report its keys to the gc
            stack.extend(obj)
    return total, len(seen)


def index_memory(bench: Bench) -> dict:
    index = bench.core.index
    held = [cache.blocks for cache in bench.caches.values()]
    distinct = len(set().union(*held)) if held else 0
    entries = index.entries
    walked, objects = deep_bytes(index)
    return {
        "entries": entries,
        "entries_by_caches": sum(map(len, held)),
        "distinct_blocks": distinct,
        "bytes": walked,
        "objects": objects,
        "bytes_per_entry": walked / entries if entries else None,
        "bytes_per_distinct_block": walked / distinct if distinct else None,
        "approx_bytes": index.approx_bytes(),
        "method": "sys.getsizeof over gc.get_referents from the PrefixIndex, each object once",
    }


LOOKUPS = 2_000


def lookup_us(bench: Bench) -> dict:
    """The index lookup alone (``match_counts``, what every placement starts with, and
    ``match_slots``, the same answer as arrays by worker slot), on the workload's next
    prompts: after the timed phase, so it cannot change a placement."""
    prompts = [bench.workload.next().keys for _ in range(LOOKUPS)]
    index = bench.core.index
    counts, slots = _timed(index.match_counts, prompts), _timed(index.match_slots, prompts)
    return {
        "lookup_p50_us": percentile(counts, 50),
        "lookup_mean_us": sum(counts) / len(counts),
        "lookup_slots_p50_us": percentile(slots, 50),
        "lookup_slots_mean_us": sum(slots) / len(slots),
    }


def _timed(lookup: Callable[[list[int]], object], prompts: list[list[int]]) -> list[float]:
    spent = []
    for keys in prompts:
        started = time.perf_counter()
        lookup(keys)
        spent.append(1e6 * (time.perf_counter() - started))
    return spent


def memory_after_run(bench: Bench) -> dict:
    """The index's bytes again after the timed phase: its churn and lookups included."""
    walked, _ = deep_bytes(bench.core.index)
    entries = bench.core.index.entries
    return {"bytes_after_run": walked, "bytes_per_entry_after_run": walked / entries if entries else None}


def run_policy(settings: BenchSettings, policy: str, measure_memory: bool = False) -> tuple[dict, dict | None]:
    bench = Bench(settings, policy)
    bench.register()
    fill = bench.fill()
    memory = index_memory(bench) if measure_memory else None
    # What the fleet's registration and the fill made is out of the collector's passes, as
    # the service's startup heap is once it settles (``scheduler.heap``): the core's time
    # counts the collection of what it makes while running, not a walk of the harness's
    # objects that happened to land in a timed call. Undone after, so each policy's run
    # starts alike and the previous run's cycles are collected.
    gc.collect()
    gc.freeze()
    frozen = gc.get_freeze_count()
    try:
        bench.run()
    finally:
        gc.unfreeze()
    if memory is not None:
        memory |= memory_after_run(bench) | lookup_us(bench)
    summary = bench.summary() | {
        "fill": fill,
        "index_entries_after": bench.core.index.entries,
        "gc_frozen_objects": frozen,
    }
    return summary, memory


def benchmark(
    settings: BenchSettings, policies: list[str], log: Callable[[str], None] = print, repeats: int = 1
) -> dict:
    """Each policy ``repeats`` times, from a fresh fleet each time: a seeded run places the same
    way every time (a different digest is an error), so only the timings differ, and each
    policy reports its run of the median decisions/s (the lower middle of an even count),
    with every run's figures beside it (``runs``): one run on a noisy host can be a third
    off its neighbour."""
    if repeats < 1:
        raise ValueError(f"repeats must be at least 1, got {repeats}")
    results, memory = [], None
    for i, policy in enumerate(policies):
        runs: list[dict] = []
        for repeat in range(repeats):
            started = time.perf_counter()
            summary, measured = run_policy(settings, policy, measure_memory=i == 0 and repeat == 0)
            memory = memory or measured
            if runs and summary["digest"] != runs[0]["digest"]:
                raise RuntimeError(f"{policy}: run {repeat + 1} placed differently from run 1 with the same seed")
            runs.append(summary)
            of = f" (run {repeat + 1} of {repeats})" if repeats > 1 else ""
            log(
                f"  {policy}: {summary['decisions']} decisions, {summary['decisions_per_s']:.0f}/s, "
                f"digest {summary['digest'][:16]} ({time.perf_counter() - started:.0f} s wall){of}"
            )
        median = sorted(runs, key=lambda r: r["decisions_per_s"])[(len(runs) - 1) // 2]
        figures = ("decisions_per_s", "decide_per_s", "submit_p99_ms", "event_p99_ms", "submit_max_ms", "core_s")
        results.append(median | {"runs": [{k: r[k] for k in figures} for r in runs]})
    # On a shared machine another process moves every figure: say how busy it was.
    load = dict(zip(("1m", "5m", "15m"), os.getloadavg(), strict=True))
    return {
        "settings": asdict(settings),
        "repeats": repeats,
        "index": memory,
        "policies": results,
        "load_average": load,
    }


# --- the command ------------------------------------------------------------------------------


def add_arguments(p: argparse.ArgumentParser) -> None:
    # The CLI imports ``switchyard.bench.<name>`` for ``bench <name>``: this module is not
    # ``bench/scheduler.py`` (a name that reads as the scheduler itself), so it says which.
    p.set_defaults(bench="scheduler_bench")
    d = BenchSettings()
    p.add_argument("--policies", default=DEFAULT_POLICIES, help="comma-separated prefill placement policies")
    p.add_argument("--prefill", type=positive_int, default=d.prefill, help="prefill workers")
    p.add_argument("--decode", type=positive_int, default=d.decode, help="decode workers")
    p.add_argument("--entries", type=positive_int, default=d.entries, help="(block, worker) pairs the fill indexes")
    p.add_argument("--requests", type=positive_int, default=d.requests, help="timed requests")
    p.add_argument("--warmup", type=int, default=d.warmup, help="untimed requests before them")
    p.add_argument(
        "--rate-per-worker",
        type=float,
        default=d.rate_per_worker,
        help="virtual arrivals per second per prefill worker (KV churn follows: each prefill publishes its blocks)",
    )
    p.add_argument("--conversations", type=positive_int, default=d.conversations, help="conversations kept going")
    p.add_argument("--seed", type=int, default=d.seed, help="the workload's and the arrivals' seed")
    p.add_argument("--out", type=Path, default=Path("bench/results/scheduler"), help="results folder")
    p.add_argument("--check-digest", type=Path, default=None, help="a results.json: exit 1 if placements differ")
    p.add_argument(
        "--repeats",
        type=positive_int,
        default=1,
        help="runs of each policy (the same placements each time); each reports its median run's decisions/s",
    )


def run(args: argparse.Namespace) -> int:
    policies = parse_policies(args.policies)
    settings = BenchSettings(
        prefill=args.prefill,
        decode=args.decode,
        entries=args.entries,
        requests=args.requests,
        warmup=args.warmup,
        rate_per_worker=args.rate_per_worker,
        conversations=args.conversations,
        seed=args.seed,
    )
    if args.check_digest is not None and not args.check_digest.is_file():
        # Before the run, not after minutes of it.
        raise SystemExit(f"--check-digest: no such file: {args.check_digest} (a results.json of an earlier run)")
    print(
        f"{settings.prefill} prefill + {settings.decode} decode workers, {settings.entries} indexed pairs "
        f"({settings.cache_blocks} blocks a worker), {settings.requests} timed requests after {settings.warmup}",
        flush=True,
    )
    results = benchmark(settings, policies, lambda line: print(line, flush=True), repeats=args.repeats)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "results.json").write_text(json.dumps(results, indent=2) + "\n")
    print(table(results), flush=True)
    plot(results, args.out / "scheduler.png")
    print(f"\nwrote {args.out / 'results.json'}, {args.out / 'scheduler.png'}")
    if args.check_digest is not None:
        return check_digests(results, json.loads(args.check_digest.read_text()))
    return 0


def check_digests(results: dict, before: dict) -> int:
    """0 when every policy run before with the same settings placed the same way."""
    if before["settings"] != results["settings"]:
        print(f"--check-digest: settings differ, nothing to compare: {before['settings']}")
        return 1
    old = {r["policy"]: r["digest"] for r in before["policies"]}
    differ = 0
    for r in results["policies"]:
        if r["policy"] in old:
            same = old[r["policy"]] == r["digest"]
            differ += not same
            print(f"  {r['policy']}: placements {'identical' if same else 'DIFFER'}")
    return 1 if differ else 0


def table(results: dict) -> str:
    m = results["index"]
    lines = [
        "",
        f"index after the fill: {m['entries']} (block, worker) entries, {m['distinct_blocks']} distinct blocks, "
        f"{m['bytes'] / 2**20:.0f} MiB: {m['bytes_per_entry']:.0f} B/entry, "
        f"{m['bytes_per_distinct_block']:.0f} B/distinct block (approx_bytes {m['approx_bytes'] / 2**20:.0f} MiB)",
        f"after the timed phase: {m['bytes_after_run'] / 2**20:.0f} MiB, {m['bytes_per_entry_after_run']:.0f} B/entry",
        f"index lookup alone: match_counts p50 {m['lookup_p50_us']:.0f} us, mean {m['lookup_mean_us']:.0f} us; "
        f"match_slots p50 {m['lookup_slots_p50_us']:.0f} us, mean {m['lookup_slots_mean_us']:.0f} us",
        f"load average over the run: {results['load_average']['5m']:.2f} (5 min), on {os.cpu_count()} cores",
        "",
        "| policy | decisions/s | of runs | decide only/s | submit p50 ms | submit p99 ms | event p99 ms "
        "| KV blocks/s | hit ratio | digest |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results["policies"]:
        each = sorted(run["decisions_per_s"] for run in r.get("runs", [r]))
        spread = f"{each[0]:.0f}" if len(each) == 1 else f"{len(each)}: {each[0]:.0f}-{each[-1]:.0f}"
        lines.append(
            f"| {r['policy']} | {r['decisions_per_s']:.0f} | {spread} | {r['decide_per_s']:.0f} "
            f"| {r['submit_p50_ms']:.3f} "
            f"| {r['submit_p99_ms']:.3f} | {r['event_p99_ms']:.3f} | {r['kv_blocks_per_s']:.0f} "
            f"| {r['prefill_hit_ratio']:.3f} | {r['digest'][:12]} |"
        )
    return "\n".join(lines)


def plot(results: dict, path: Path) -> None:
    rows = results["policies"]
    names = [r["policy"] for r in rows]
    fig, ax = plots.figure()
    xs = range(len(rows))
    ax.bar([x - 0.2 for x in xs], [r["decisions_per_s"] for r in rows], width=0.4, label="decisions/s (left)")
    ax.set_xticks(list(xs), names, rotation=15, fontsize=8)
    right = ax.twinx()
    right.bar([x + 0.2 for x in xs], [r["submit_p99_ms"] for r in rows], width=0.4, color="C1", label="submit p99")
    right.set_ylabel("submit p99 (ms, right, orange)")
    s = results["settings"]
    title = f"scheduler core alone: {s['prefill']}+{s['decode']} workers, {results['index']['entries']} entries"
    plots.save(fig, ax, path, title=title, xlabel="policy", ylabel="decisions per second")


__all__ = ["BenchSettings", "Workload", "benchmark", "check_digests", "deep_bytes", "run_policy"]
