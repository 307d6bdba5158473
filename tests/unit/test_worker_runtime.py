"""What a worker's heartbeat says of its engine, read through the engine protocols
(``EngineLifecycle.boot_s``, ``CountingEngine.counters``) and the role's ``kv_fallbacks``;
roll calls; and a prefill role's serve loop when a cancel empties its queue."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field

import anyio
import pytest

from switchyard.schemas import (
    EngineStats,
    LoadReport,
    LocalTask,
    PrefillTask,
    RequestSpec,
    Role,
    RollCall,
    SamplingParams,
    WorkerEvent,
    codec,
)
from switchyard.workers.config import WorkerConfig
from switchyard.workers.decode import DecodeRole
from switchyard.workers.prefill import PrefillRole
from switchyard.workers.runtime import WorkerRuntime
from switchyard.workers.sim import SimEngine, SimEngineConfig

pytestmark = pytest.mark.anyio


@dataclass
class _Counters:
    prompt_tokens: int = 0
    external_hit_tokens: int = 0

    def wire(self) -> dict[str, int]:
        return {"prompt_tokens": self.prompt_tokens, "external_hit_tokens": self.external_hit_tokens}


class _BootingEngine(SimEngine):
    """A sim engine that boots and counts, as a vLLM engine does."""

    def __init__(self) -> None:
        super().__init__(SimEngineConfig(), "w")
        self.boot_s = 0.0
        self.counters = _Counters()

    async def start(self) -> None:
        self.boot_s = 12.5

    async def stop(self) -> None:
        pass

    @asynccontextmanager
    async def serving(self) -> AsyncIterator[None]:  # the lifecycle as a context (start/stop inside)
        await self.start()
        try:
            yield
        finally:
            await self.stop()


@dataclass
class _RecordingBus:
    events: list[WorkerEvent] = field(default_factory=list)

    async def event(self, event: WorkerEvent) -> None:
        self.events.append(event)


async def _report(runtime: WorkerRuntime) -> LoadReport:
    bus = _RecordingBus()
    await runtime._report(bus)  # a WorkerBus, as far as a report goes: only ``event`` is used
    (report,) = bus.events
    assert isinstance(report, LoadReport)
    return report


def _config(role: Role) -> WorkerConfig:
    return WorkerConfig(role=role, worker_id="w")


async def test_a_sim_worker_reports_no_boot_time_and_what_it_prefilled() -> None:
    engine = SimEngine(SimEngineConfig(), "w")
    engine.counters.prompt_tokens, engine.counters.computed_tokens = 40, 8
    for role in (PrefillRole(engine, "w", 100), DecodeRole(engine, "w", 100)):
        report = await _report(WorkerRuntime(_config("decode"), role))
        assert (report.boot_s, report.stats) == (0.0, EngineStats(prompt_tokens=40, computed_tokens=8))


async def test_a_booting_counting_engine_reports_its_boot_time_counters_and_the_roles_fallbacks() -> None:
    engine = _BootingEngine()
    await engine.start()
    engine.counters.prompt_tokens, engine.counters.external_hit_tokens = 96, 64
    role = DecodeRole(engine, "w", 100)
    role.kv_fallbacks = 2
    report = await _report(WorkerRuntime(_config("decode"), role))
    assert report.boot_s == 12.5
    assert report.stats == EngineStats(prompt_tokens=96, external_hit_tokens=64, kv_fallbacks=2)


async def test_a_prefill_role_has_no_kv_fallbacks() -> None:
    report = await _report(WorkerRuntime(_config("prefill"), PrefillRole(_BootingEngine(), "w", 100)))
    assert report.stats == EngineStats(kv_fallbacks=0)


@dataclass
class _Msg:
    data: bytes
    subject: str = "roll-call"


class _OneRollCall:
    """A subscription that delivers one roll call, then ends."""

    def __init__(self, scheduler_id: str) -> None:
        self._data = codec.ROLL_CALL.encode(RollCall(scheduler_id=scheduler_id))

    @property
    async def messages(self) -> AsyncIterator[_Msg]:
        yield _Msg(self._data)


async def test_a_roll_call_is_answered_with_every_held_request_in_reports_that_fit_a_message() -> None:
    engine = SimEngine(SimEngineConfig(), "w")
    runtime = WorkerRuntime(_config("decode"), DecodeRole(engine, "w", 10**9))
    rids = [f"r{i}" for i in range(4500)]
    for rid in rids:
        spec = RequestSpec(
            request_id=rid,
            ingress_id="i",
            model="m",
            prompt_tokens=[1, 2],
            block_size=16,
            block_keys=[],
            sampling=SamplingParams(max_tokens=3),
        )
        runtime.held.accepted(LocalTask(spec=spec, queued_s=0.0, charged_tokens=5))
    bus = _RecordingBus()
    await runtime._serve_roll_calls(_OneRollCall("sched-new"), bus)  # type: ignore[arg-type]
    reports = [e for e in bus.events if isinstance(e, LoadReport)]
    assert [len(r.held or []) for r in reports] == [2000, 2000, 500]
    assert [h.request_id for r in reports for h in r.held or []] == rids
    assert max(len(codec.WORKER_EVENT.encode(r)) for r in reports) < 1 << 20  # NATS's default max payload
    empty = WorkerRuntime(_config("decode"), DecodeRole(engine, "w", 100))
    bus = _RecordingBus()
    await empty._serve_roll_calls(_OneRollCall("sched-new"), bus)  # type: ignore[arg-type]
    assert [r.held for r in bus.events if isinstance(r, LoadReport)] == [[]]  # holds nothing: says so


@dataclass
class _StreamingBus(_RecordingBus):
    chunks: list = field(default_factory=list)

    async def stream(self, ingress_id: str, chunks: list) -> None:
        self.chunks.extend(chunks)

    async def kv_changes(self) -> None:
        pass


def _prefill_task(rid: str) -> PrefillTask:
    spec = RequestSpec(
        request_id=rid,
        ingress_id="i",
        model="m",
        prompt_tokens=[1, 2, 3],
        block_size=16,
        block_keys=[],
        sampling=SamplingParams(max_tokens=3),
    )
    return PrefillTask(spec=spec, queued_s=0.0)


async def test_a_prefill_job_cancelled_before_the_worker_woke_leaves_it_serving_the_next() -> None:
    role = PrefillRole(SimEngine(SimEngineConfig(), "w"), "w", 100)
    bus = _StreamingBus()
    async with anyio.create_task_group() as tg:
        tg.start_soon(role.serve, bus)  # type: ignore[arg-type]  # the outbound calls a role makes
        await anyio.sleep(0.05)  # idle, waiting to be woken
        assert role.offer(_prefill_task("gone"), {}) is None
        role.cancel("gone")  # before the woken worker ran: it wakes to an empty queue
        await anyio.sleep(0.05)
        assert role.offer(_prefill_task("next"), {}) is None
        with anyio.fail_after(5):
            while not bus.events:
                await anyio.sleep(0.01)
        tg.cancel_scope.cancel()
    assert [(type(e).__name__, e.request_id) for e in bus.events] == [("PrefillDone", "next")]
    assert role.running() == 0 and role.inflight_tokens() == 0
