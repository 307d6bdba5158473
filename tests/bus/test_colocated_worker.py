"""A colocated worker (role ``both``) over a real nats-server: what it does for a handoff
while its own decodes run."""

from __future__ import annotations

import anyio
import pytest

from switchyard.observability.bus import connect
from switchyard.schemas import (
    LocalTask,
    PrefillDone,
    PrefillTask,
    RequestSpec,
    SamplingParams,
    codec,
    subjects,
)
from switchyard.workers.decode import DecodeRole
from switchyard.workers.engine import PrefillResult
from switchyard.workers.runtime import WorkerRuntime
from switchyard.workers.sim import SimCostModel, SimEngine
from tests.support.stack import worker_config

pytestmark = pytest.mark.anyio


class _SlowStore(SimEngine):
    """A sim engine whose handed-over KV reaches its store only when the test says so (as
    vLLM's Mooncake Store writes come after the output: ``HandoffEngine``)."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.stored = anyio.Event()
        self.waiting = 0

    async def wait_handoff(self, tasks: list[PrefillTask], results: list[PrefillResult]) -> None:
        self.waiting += len(tasks)
        await self.stored.wait()


def _spec(rid: str, max_tokens: int) -> RequestSpec:
    return RequestSpec(
        request_id=rid,
        ingress_id="ing-test",
        model="switchyard-sim",
        prompt_tokens=list(range(300, 340)),
        block_size=16,
        block_keys=[],
        sampling=SamplingParams(max_tokens=max_tokens),
    )


async def test_a_colocated_worker_keeps_decoding_while_a_handoff_waits_for_the_store(nats):
    """The KV a colocated worker prefills for a lent one is announced once it is in the store,
    which takes as long as the store's writes. Its own decodes step on meanwhile: before, the
    worker's loop waited for the store, and every sequence it decoded stalled with it."""
    config = worker_config(nats.url, "both", SimCostModel(decode_step_base_s=0.01), worker_id="both-t")
    engine = _SlowStore(config.sim, config.worker_id)
    role = DecodeRole(engine, config.worker_id, config.token_budget, config.min_publish_interval_s, prefills=True)
    worker = WorkerRuntime(config, role)
    async with connect(nats.url, "test") as nc, anyio.create_task_group() as tg:
        streams = await nc.subscribe(subjects.streams_of("ing-test"))
        events = await nc.subscribe(subjects.WORKER_EVENTS)
        await tg.start(worker.run)
        tasks = subjects.worker_tasks(config.worker_id)
        local = LocalTask(spec=_spec("local", 500), queued_s=0.0)  # 5 s of decoding here
        assert codec.TASK_ACK.decode((await nc.request(tasks, codec.WORKER_TASK.encode(local), 5)).data).accepted
        handed = PrefillTask(spec=_spec("handed", 20), queued_s=0.0)
        assert codec.TASK_ACK.decode((await nc.request(tasks, codec.WORKER_TASK.encode(handed), 5)).data).accepted
        with anyio.fail_after(5):
            while not engine.waiting:
                await anyio.sleep(0.01)
        decoded = 0  # the local sequence's tokens while the handoff waits for the store
        with anyio.move_on_after(0.5):
            async for msg in streams.messages:
                batch = codec.STREAM_BATCH.decode(msg.data)
                decoded += sum(len(c.token_ids) for c in batch.chunks if c.request_id == "local")
        assert decoded >= 10, decoded  # 10 ms steps: about 50 in 0.5 s; none if the loop waited
        assert engine.waiting == 1 and role.handed_off == 1
        engine.stored.set()
        with anyio.fail_after(5):
            async for msg in events.messages:
                event = codec.WORKER_EVENT.decode(msg.data)
                if isinstance(event, PrefillDone) and event.request_id == "handed":
                    break
        tg.cancel_scope.cancel()
