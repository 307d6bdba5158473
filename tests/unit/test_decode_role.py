"""The decode role's batching of steps into bus messages (a recording bus, a sim engine)."""

from __future__ import annotations

import anyio
import pytest

from switchyard.schemas import DecodeTask, PromptUsage, SimKvHandle, StreamError
from switchyard.workers.decode import DecodeRole
from switchyard.workers.engine import StepOutput
from switchyard.workers.sim import SimCostModel, SimEngine, SimEngineConfig
from tests.support.factories import make_spec

pytestmark = pytest.mark.anyio


@pytest.fixture
def anyio_backend():
    return "asyncio"


class RecordingBus:
    def __init__(self) -> None:
        self.batches: list[tuple[str, list]] = []
        self.events: list = []
        self.kv_reports = 0

    async def stream(self, ingress_id, chunks) -> None:
        self.batches.append((ingress_id, list(chunks)))

    async def event(self, event) -> None:
        self.events.append(event)

    async def kv_changes(self) -> None:
        self.kv_reports += 1


def _task(rid: str, ingress: str, max_tokens: int) -> DecodeTask:
    spec = make_spec(rid, ingress_id=ingress, max_tokens=max_tokens)
    return DecodeTask(
        spec=spec,
        handle=SimKvHandle(worker_id="p", block_keys=[], num_tokens=0),
        first_token=7,
        usage=PromptUsage(prompt_tokens=len(spec.prompt_tokens), cached_tokens=0),
    )


async def _run(role: DecodeRole, bus: RecordingBus, until) -> None:
    with anyio.fail_after(5):
        async with anyio.create_task_group() as tg:
            tg.start_soon(role.serve, bus)
            while not until():
                await anyio.sleep(0.001)
            tg.cancel_scope.cancel()


def _positions(bus: RecordingBus, rid: str) -> list[int]:
    return [
        c.seq + i for _, chunks in bus.batches for c in chunks if c.request_id == rid for i in range(len(c.token_ids))
    ]


async def test_every_position_once_and_one_finish_per_request() -> None:
    engine = SimEngine(SimEngineConfig(), "d")
    role, bus = DecodeRole(engine, "d", 100_000, min_publish_interval_s=0.01), RecordingBus()
    for rid, ingress in (("a", "i1"), ("b", "i2"), ("c", "i1")):
        assert role.offer(_task(rid, ingress, 50), {}) is None
    await _run(role, bus, lambda: len(bus.events) == 3)
    for rid in "abc":
        assert _positions(bus, rid) == list(range(1, 50))
    finishes = [c for _, chunks in bus.batches for c in chunks if c.finish_reason]
    assert sorted(c.request_id for c in finishes) == ["a", "b", "c"]
    assert all(ingress in ("i1", "i2") for ingress, _ in bus.batches)
    assert all(len({c.request_id for c in chunks}) == len(chunks) for _, chunks in bus.batches)
    assert [e.generated_tokens for e in bus.events] == [50, 50, 50]
    assert role.running() == 0 and role.inflight_tokens() == 0


async def test_fast_steps_share_messages_slow_steps_do_not() -> None:
    fast = SimEngine(SimEngineConfig(), "d")
    role, bus = DecodeRole(fast, "d", 100_000, min_publish_interval_s=0.05), RecordingBus()
    role.offer(_task("a", "i", 200), {})
    await _run(role, bus, lambda: bool(bus.events))
    assert len(bus.batches) < 199 / 2  # 199 steps of a zero-cost engine, far fewer messages
    assert _positions(bus, "a") == list(range(1, 200))

    slow = SimEngine(SimEngineConfig(cost=SimCostModel(decode_step_base_s=0.002)), "d")
    role, bus = DecodeRole(slow, "d", 100_000, min_publish_interval_s=0.001), RecordingBus()
    role.offer(_task("b", "i", 20), {})
    await _run(role, bus, lambda: bool(bus.events))
    assert len(bus.batches) == 19  # each 2 ms step is its own message


async def test_a_finished_decode_reports_the_time_its_steps_took() -> None:
    """``step_s``: from its first token here to its last, over the steps between (19 steps
    of 2 ms after the first); a decode of one step has no step time."""
    slow = SimEngine(SimEngineConfig(cost=SimCostModel(decode_step_base_s=0.002)), "d")
    role, bus = DecodeRole(slow, "d", 100_000, min_publish_interval_s=0.001), RecordingBus()
    role.offer(_task("long", "i", 21), {})
    role.offer(_task("short", "i", 2), {})
    await _run(role, bus, lambda: len(bus.events) == 2)
    finished = {e.request_id: e for e in bus.events}
    assert finished["short"].step_s == 0.0
    assert 0.002 <= finished["long"].step_s < 0.02


async def test_cancel_drops_unsent_tokens_and_frees_the_engine() -> None:
    engine = SimEngine(SimEngineConfig(cost=SimCostModel(decode_step_base_s=0.001)), "d")
    role, bus = DecodeRole(engine, "d", 100_000, min_publish_interval_s=10.0), RecordingBus()
    role.offer(_task("a", "i", 10_000), {})
    role.offer(_task("b", "i", 5), {})
    await _run(role, bus, lambda: bool(bus.events))  # b finishes: everything pending is sent
    role.cancel("a")
    sent = len(_positions(bus, "a"))
    assert role.running() == 0 and engine.held_tokens == 0
    await _run(role, bus, lambda: True)
    assert len(_positions(bus, "a")) == sent


class _Refusing(SimEngine):
    """Refuses request "bad" as vLLM refuses a JSON schema no grammar backend compiles:
    an ``abort`` with the engine's reason, before any token."""

    async def step(self) -> list[StepOutput]:
        outputs = await super().step()
        if self.abort("bad"):
            outputs.append(StepOutput("bad", None, 1, "abort", refused="Grammar error: Invalid type: objekt"))
        return outputs


async def test_a_request_the_engine_refuses_ends_with_the_clients_error_not_a_silent_abort() -> None:
    engine = _Refusing(SimEngineConfig(cost=SimCostModel(decode_step_base_s=0.001)), "d")
    role, bus = DecodeRole(engine, "d", 100_000, min_publish_interval_s=0.01), RecordingBus()
    role.offer(_task("bad", "i", 50), {})
    role.offer(_task("good", "i", 5), {})
    await _run(role, bus, lambda: len(bus.events) == 2)
    chunks = [c for _, batch in bus.batches for c in batch]
    bad = [c for c in chunks if c.request_id == "bad"]
    assert [(c.finish_reason, c.error) for c in bad] == [
        ("abort", StreamError(code="invalid_request", message="Grammar error: Invalid type: objekt"))
    ]
    assert all(c.error is None for c in chunks if c.request_id == "good")
    assert _positions(bus, "good") == [1, 2, 3, 4]
    assert role.running() == 0
