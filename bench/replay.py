"""One trace, one policy, one fleet: the real ``SchedulerCore`` driven in virtual time.

The driver is the core's thin loop, as ``scheduler.service`` is on NATS, with the bus
replaced by direct calls at the event's virtual time: a request arrives -> ``submit``;
a simulated worker finishes something -> ``on_event`` / ``on_kv_events``; the core's
actions are carried out at once (a ``Dispatch`` reaches its worker, a
``RequestSnapshot`` is answered from that worker's cache).

What the workers report reaches the core late, as over a bus and a worker's publish
loop: its KV event batches (and snapshots) after ``kv_event_delay_s``, its worker events
(``PrefillDone``, ``RequestFinished``: what releases the core's ledger) after
``report_delay_s``, each stream in order per worker. So the core places on a slightly
stale index and ledger. A request's own outcome (its first and last token) is recorded
when the worker produced it, not when the core hears of it. A delay of 0 delivers at
once, inside the worker's call, as before delays existed. Workers register with one
``LoadReport`` each and never expire (no heartbeats are simulated); ``tick`` runs every
``tick_s`` of virtual time while anything is outstanding.

Wall-clock time spent inside core calls is measured separately from the simulation,
so ``decisions_per_s`` is the core's own speed (a decision: a dispatch or a rejection).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from typing import Any

from switchyard.bench.costmodel import CostModel
from switchyard.bench.fleet import TICK, EventLoop, FleetShape, SimWorker, TierCounts
from switchyard.bench.traces import TRACE_BLOCK_SIZE, TraceRequest, block_keys, tenant_salt
from switchyard.scheduler import Dispatch, FailStream, RequestSnapshot, SchedulerConfig, SchedulerCore
from switchyard.schemas import (
    KvEventBatch,
    LoadReport,
    PrefillDone,
    Rejected,
    RequestFinished,
    RequestSpec,
    SamplingParams,
    WorkerEvent,
)

MODEL = "llama-3.3-70b-sim"
TENANT = "trace"
NEVER = 1e12  # worker expiry: no heartbeats in virtual time


@dataclass(frozen=True)
class ReplaySettings:
    policy: str
    shape: FleetShape
    cost: CostModel = CostModel()
    max_queued_tokens: int = SchedulerConfig().max_queued_tokens
    local_prefill_max_tokens: int = 0
    seed: int = 0
    tick_s: float = 1.0
    time_scale: float = 1.0
    kv_event_delay_s: float = 0.0  # worker -> core, KV event batches and snapshots
    report_delay_s: float = 0.0  # worker -> core, PrefillDone and RequestFinished
    ttft_slo_s: float = 2.0
    tpot_slo_s: float = 0.05

    def scheduler_config(self) -> SchedulerConfig:
        """The core's config. Fields the core does not have yet are left out (and noted)."""
        wanted: dict[str, Any] = {
            "policy": self.policy,
            "max_queued_tokens": self.max_queued_tokens,
            "worker_expiry_s": NEVER,
            "local_prefill_max_tokens": self.local_prefill_max_tokens,
            "seed": self.seed,
            "ttft_slo_s": self.ttft_slo_s,
            "tpot_slo_s": self.tpot_slo_s,
        }
        known = set(SchedulerConfig.__struct_fields__)
        return SchedulerConfig(**{k: v for k, v in wanted.items() if k in known})


@dataclass
class Outcomes:
    """Per request of the trace, by index; NaN-free: -1.0 means never."""

    first_token: list[float]
    last_token: list[float]
    cached: list[int]
    status: list[str]  # "pending", "done", "rejected", "failed"
    served: list[TierCounts]  # its cached tokens by the tier they came from (its first prefill)

    @classmethod
    def empty(cls, n: int) -> Outcomes:
        return cls([-1.0] * n, [-1.0] * n, [0] * n, ["pending"] * n, [TierCounts()] * n)


@dataclass
class CoreTiming:
    wall_s: float = 0.0
    calls: int = 0
    decisions: int = 0
    dispatches: dict[str, int] = field(default_factory=lambda: {"prefill": 0, "decode": 0, "local": 0})
    rejections: dict[str, int] = field(default_factory=dict)
    by_method: dict[str, list[float]] = field(default_factory=dict)  # name -> [calls, wall seconds]


@dataclass
class ReplayResult:
    settings: ReplaySettings
    requests: list[TraceRequest]
    outcomes: Outcomes
    timing: CoreTiming
    workers: dict[str, SimWorker]
    index_entries: int
    index_bytes: int
    makespan_s: float
    events: int
    wall_s: float


class Replay:
    def __init__(
        self,
        requests: list[TraceRequest],
        settings: ReplaySettings,
        progress: Callable[[int, int, float], None] | None = None,
    ) -> None:
        self.requests, self.settings = requests, settings
        self.core = SchedulerCore(settings.scheduler_config())
        self.loop = EventLoop()
        self.timing = CoreTiming()
        self.outcomes = Outcomes.empty(len(requests))
        shape = settings.shape
        self.workers = {
            wid: SimWorker(
                wid,
                role,
                settings.cost,
                shape.cache_blocks,
                self.loop,
                self,
                host_cache_blocks=shape.host_cache_blocks,
                disk_cache_blocks=shape.disk_cache_blocks,
                on_served=self._served,
            )
            for wid, role in shape.roles.items()
        }
        self._salt = tenant_salt(TENANT)
        self._progress = progress
        self._arrived = 0
        self._outstanding = 0
        self._in_transit = 0  # worker -> core messages on their way
        self._delivered_at: dict[tuple[str, str], float] = {}  # (worker, stream) -> last delivery

    def run(self) -> ReplayResult:
        started = time.perf_counter()
        self._register()
        scale = self.settings.time_scale
        for i, request in enumerate(self.requests):
            self.loop.at(request.arrival_s * scale, partial(self._arrive, i))
        self.loop.at(0.0, self._tick, TICK)
        self.loop.run()
        index = self.core.index
        return ReplayResult(
            self.settings,
            self.requests,
            self.outcomes,
            self.timing,
            self.workers,
            index.entries,
            index.approx_bytes(),
            self.loop.now,
            self.loop.processed,
            time.perf_counter() - started,
        )

    # --- the core, timed -------------------------------------------------------------------

    def _call(self, method, *args):
        started = time.perf_counter()
        result = method(*args)
        spent = time.perf_counter() - started
        self.timing.wall_s += spent
        self.timing.calls += 1
        tally = self.timing.by_method.setdefault(method.__name__, [0, 0.0])
        tally[0] += 1
        tally[1] += spent
        return result

    def _register(self) -> None:
        cost = self.settings.cost
        for wid, worker in self.workers.items():
            # prefill and colocated workers: a budget of uncached tokens in flight; decode
            # workers (and the KV side of colocated ones): the KV tokens they can hold
            budget = cost.kv_capacity_tokens if worker.role == "decode" else self.settings.shape.prefill_token_budget
            report = LoadReport(
                worker_id=wid,
                role=worker.role,
                seq=1,
                engine="sim",
                model=MODEL,
                block_size=TRACE_BLOCK_SIZE,
                token_budget=budget,
                inflight_tokens=0,
                running=0,
                interval_s=NEVER,
                kv_capacity_tokens=cost.kv_capacity_tokens,
            )
            self._carry_out(self._call(self.core.on_event, report, 0.0), 0.0)

    def _arrive(self, i: int, now: float) -> None:
        request = self.requests[i]
        spec = RequestSpec(
            request_id=str(i),
            ingress_id="bench",
            model=MODEL,
            prompt_tokens=[0] * request.input_tokens,
            block_size=TRACE_BLOCK_SIZE,
            block_keys=block_keys(request.block_ids, self._salt),
            sampling=SamplingParams(max_tokens=request.output_tokens, temperature=0.0),
            tenant=TENANT,
        )
        reply, actions = self._call(self.core.submit, spec, now)
        if isinstance(reply, Rejected):
            self.outcomes.status[i] = "rejected"
            self.timing.decisions += 1
            self.timing.rejections[reply.reason] = self.timing.rejections.get(reply.reason, 0) + 1
        else:
            self._outstanding += 1
        self._carry_out(actions, now)
        self._arrived += 1
        if self._progress is not None:
            self._progress(self._arrived, len(self.requests), now)

    def _tick(self, now: float) -> None:
        self._carry_out(self._call(self.core.tick, now), now)
        pending = self._arrived < len(self.requests) or self._in_transit > 0
        if pending or (self._outstanding and any(w.active for w in self.workers.values())):
            self.loop.at(now + self.settings.tick_s, self._tick, TICK)

    # --- the core's actions ------------------------------------------------------------------

    def _carry_out(self, actions: list, now: float) -> None:
        for action in actions:
            match action:
                case Dispatch(worker_id=wid, task=task):
                    self.timing.decisions += 1
                    kind = str(task.__struct_config__.tag)  # "prefill", "decode" or "local"
                    self.timing.dispatches[kind] = self.timing.dispatches.get(kind, 0) + 1
                    self.workers[wid].accept(task, now)
                case RequestSnapshot(worker_id=wid):
                    snapshot = self.workers[wid].snapshot()  # as of now, behind the batches sent before
                    self._deliver(wid, "kv", self.settings.kv_event_delay_s, now, self.core.on_kv_snapshot, snapshot)
                case FailStream(request_id=rid):
                    self._settle(int(rid), "failed")
                case _:
                    pass  # BindSession: persistence, nothing to simulate

    # --- the workers' outputs (Sink) ---------------------------------------------------------

    def worker_event(self, event: WorkerEvent, now: float) -> None:
        match event:
            case PrefillDone(request_id=rid, usage=usage, finished=finished):
                i = int(rid)
                if self.outcomes.first_token[i] < 0:
                    self.outcomes.first_token[i] = now
                    self.outcomes.cached[i] = usage.cached_tokens
                if finished:
                    self.outcomes.last_token[i] = now
                    self._settle(i, "done")
            case RequestFinished(request_id=rid):
                self.outcomes.last_token[int(rid)] = now
                self._settle(int(rid), "done")
        self._deliver(event.worker_id, "report", self.settings.report_delay_s, now, self.core.on_event, event)

    def kv_events(self, batch: KvEventBatch, now: float) -> None:
        self._deliver(batch.worker_id, "kv", self.settings.kv_event_delay_s, now, self.core.on_kv_events, batch)

    def _served(self, request_id: str, served: TierCounts) -> None:
        i = int(request_id)
        if self.outcomes.first_token[i] < 0:  # told just before its PrefillDone
            self.outcomes.served[i] = served

    def _deliver(
        self, worker_id: str, stream: str, delay: float, now: float, method: Callable[[Any, float], list], message: Any
    ) -> None:
        """``method(message)`` on the core, ``delay`` after ``now``, never before what the same
        worker sent earlier on the same stream."""
        if delay <= 0:
            self._carry_out(self._call(method, message, now), now)
            return
        when = max(now + delay, self._delivered_at.get((worker_id, stream), 0.0))
        self._delivered_at[worker_id, stream] = when
        self._in_transit += 1

        def arrive(at: float) -> None:
            self._in_transit -= 1
            self._carry_out(self._call(method, message, at), at)

        self.loop.at(when, arrive)

    def _settle(self, i: int, status: str) -> None:
        if self.outcomes.status[i] == "pending":
            self.outcomes.status[i] = status
            self._outstanding -= 1


def replay(
    requests: list[TraceRequest], settings: ReplaySettings, progress: Callable[[int, int, float], None] | None = None
) -> ReplayResult:
    return Replay(requests, settings, progress).run()


__all__ = ["CoreTiming", "Outcomes", "Replay", "ReplayResult", "ReplaySettings", "replay"]
