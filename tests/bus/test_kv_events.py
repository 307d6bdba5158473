"""The global prefix index on a real nats-server, fed by real sim workers' KV events.

Each test starts its own scheduler and workers; the index is read straight off the
scheduler's core and compared with the prefill worker's real cache.
"""

from __future__ import annotations

import anyio
import pytest

from switchyard.kvbus.keys import block_keys, salt_for
from switchyard.observability.bus import connect
from switchyard.scheduler.service import SchedulerService, SchedulerServiceConfig
from switchyard.schemas import BlocksStored, KvEventBatch, RequestSpec, SamplingParams, SubmitRequest, codec, subjects
from switchyard.workers import build_worker
from switchyard.workers.runtime import WorkerRuntime
from tests.support.stack import MODEL, worker_config

pytestmark = pytest.mark.anyio

BLOCK = 16
PREFIX = [1000 + i for i in range(8 * BLOCK)]  # eight blocks every prompt here starts with


def _spec(rid: str, prompt: list[int]) -> RequestSpec:
    keys = list(block_keys(prompt, BLOCK, salt_for("default", MODEL)))
    return RequestSpec(
        request_id=rid,
        ingress_id="ing-kv",
        model=MODEL,
        prompt_tokens=prompt,
        block_size=BLOCK,
        block_keys=keys,
        sampling=SamplingParams(max_tokens=2),
    )


def _prompt(tail: int, blocks: int = 3) -> list[int]:
    return PREFIX + [2000 + 100 * tail + i for i in range(blocks * BLOCK)]


async def _wait(predicate, timeout_s: float = 5.0) -> None:
    with anyio.fail_after(timeout_s):
        while not predicate():
            await anyio.sleep(0.02)


async def _run_requests(nc, sched: SchedulerService, specs: list[RequestSpec]) -> None:
    for spec in specs:
        await nc.request(subjects.SUBMIT, codec.SCHEDULER_REQUEST.encode(SubmitRequest(spec=spec)), timeout=2)
    await _wait(lambda: not sched.core.requests)


def _cache(worker: WorkerRuntime) -> list[int]:
    return worker.kv.cache.cached_blocks().get("device", [])


def _index_mirrors(sched: SchedulerService, *workers: WorkerRuntime) -> bool:
    """The index holds exactly these workers' caches (the only caches in these fleets;
    a decode worker's holds the blocks handed to it)."""
    index = sched.core.index
    for worker in workers:
        wid = worker.config.worker_id
        if not index.knows(wid) or not all(wid in index.match([k], [wid]) for k in _cache(worker)):
            return False
    return index.entries == sum(len(_cache(w)) for w in workers)


def _device_blocks(sched: SchedulerService, worker: WorkerRuntime, spec: RequestSpec) -> int:
    found = sched.core.index.match(spec.block_keys).get(worker.config.worker_id)
    return found.device_blocks if found is not None else 0


def _fleet(url: str) -> tuple[SchedulerService, WorkerRuntime, WorkerRuntime]:
    return (
        SchedulerService(SchedulerServiceConfig(nats_url=url)),
        build_worker(worker_config(url, "prefill")),
        build_worker(worker_config(url, "decode")),
    )


async def _known(sched: SchedulerService, *workers: WorkerRuntime) -> None:
    """Registered and snapshotted: the index knows every one of them."""
    await _wait(lambda: all(sched.core.index.knows(w.config.worker_id) for w in workers))


async def test_prefilled_blocks_show_in_the_index(nats):
    sched, prefill, decode = _fleet(nats.url)
    async with connect(nats.url, "test") as nc, anyio.create_task_group() as tg:
        for service in (sched, prefill, decode):
            await tg.start(service.run)
        await _known(sched, prefill, decode)
        specs = [_spec(f"r{i}", _prompt(i)) for i in range(3)]
        await _run_requests(nc, sched, specs)
        await _wait(lambda: _device_blocks(sched, prefill, specs[2]) == 11)
        assert all(_device_blocks(sched, prefill, s) == 11 for s in specs)
        matched = sched.core.index.match(_spec("x", PREFIX + [1, 2, 3] * BLOCK).block_keys)
        # both hold the shared prefix: the prefill worker computed it, the decode worker was handed it
        assert sorted(matched) == sorted([prefill.config.worker_id, decode.config.worker_id])
        assert matched[prefill.config.worker_id].device_blocks == 8
        assert prefill.kv.seq >= 1
        await _wait(lambda: _index_mirrors(sched, prefill, decode))
        tg.cancel_scope.cancel()


async def test_a_gap_in_the_events_makes_the_scheduler_resync_from_the_worker(nats):
    sched, prefill, decode = _fleet(nats.url)
    async with connect(nats.url, "test") as nc, anyio.create_task_group() as tg:
        for service in (sched, prefill, decode):
            await tg.start(service.run)
        await _known(sched, prefill, decode)
        await _run_requests(nc, sched, [_spec("r1", _prompt(1))])
        await _wait(lambda: _index_mirrors(sched, prefill, decode))
        wid = prefill.config.worker_id
        asked = await nc.subscribe(subjects.kv_snapshot(wid))  # overhears the scheduler's request
        # A batch from the future: the ones between were "lost". Its block is not really held.
        fake = KvEventBatch(worker_id=wid, seq=prefill.kv.seq + 5, events=[BlocksStored(keys=[12345])])
        await nc.publish(subjects.KV_EVENTS, codec.KV_EVENTS.encode(fake))
        request = codec.KV_SNAPSHOT_REQUEST.decode((await asked.next_msg(timeout=3)).data)
        assert request.scheduler_id == sched.scheduler_id
        await _wait(lambda: _index_mirrors(sched, prefill, decode))
        assert sched.core.index.match([12345]) == {}
        # Back in step: the worker's next batches apply on top of the snapshot.
        spec = _spec("r2", _prompt(2))
        await _run_requests(nc, sched, [spec])
        await _wait(lambda: _device_blocks(sched, prefill, spec) == 11)
        await _wait(lambda: _index_mirrors(sched, prefill, decode))
        tg.cancel_scope.cancel()


async def test_a_restarted_scheduler_rebuilds_the_index_without_restarting_workers(nats):
    first, prefill, decode = _fleet(nats.url)
    specs = [_spec(f"r{i}", _prompt(i)) for i in range(4)]
    async with connect(nats.url, "test") as nc, anyio.create_task_group() as tg:
        await tg.start(prefill.run)
        await tg.start(decode.run)
        async with anyio.create_task_group() as scheduler:
            await scheduler.start(first.run)
            await _known(first, prefill, decode)
            await _run_requests(nc, first, specs)
            await _wait(lambda: _index_mirrors(first, prefill, decode))
            before = [first.core.index.match(s.block_keys) for s in specs]
            entries, seq = first.core.index.entries, prefill.kv.seq
            scheduler.cancel_scope.cancel()
        second = SchedulerService(SchedulerServiceConfig(nats_url=nats.url))
        await tg.start(second.run)
        await _wait(lambda: _index_mirrors(second, prefill, decode))
        assert [second.core.index.match(s.block_keys) for s in specs] == before
        assert second.core.index.entries == entries and prefill.kv.seq == seq  # same worker, same cache
        spec = _spec("r9", _prompt(9))
        await _run_requests(nc, second, [spec])  # and it follows the events from there
        await _wait(lambda: _device_blocks(second, prefill, spec) == 11)
        tg.cancel_scope.cancel()


async def test_a_worker_that_leaves_is_forgotten_by_the_index(nats):
    sched, prefill, decode = _fleet(nats.url)
    spec = _spec("r1", _prompt(1))
    async with connect(nats.url, "test") as nc, anyio.create_task_group() as tg:
        await tg.start(sched.run)
        await tg.start(decode.run)
        async with anyio.create_task_group() as worker:
            await worker.start(prefill.run)
            await _known(sched, prefill, decode)
            await _run_requests(nc, sched, [spec])
            await _wait(lambda: _device_blocks(sched, prefill, spec) == 11)
            worker.cancel_scope.cancel()  # a graceful stop: it says it is leaving
        await _wait(lambda: not sched.core.index.knows(prefill.config.worker_id), timeout_s=3)
        assert list(sched.core.index.match(spec.block_keys)) == [decode.config.worker_id]  # what stays
        assert sched.core.index.entries == len(_cache(decode))
        tg.cancel_scope.cancel()


async def test_a_colocated_worker_that_only_hands_off_reports_its_blocks(nats):
    """While one colocated worker is lent to decoding, the other only prefills for it
    (``PrefillTask``) and decodes nothing: what those prefills cache still reaches the index."""
    sched = SchedulerService(SchedulerServiceConfig(nats_url=nats.url))
    prefiller, lent = (build_worker(worker_config(nats.url, "both")) for _ in range(2))
    async with connect(nats.url, "test") as nc, anyio.create_task_group() as tg:
        for service in (sched, prefiller, lent):
            await tg.start(service.run)
        await _known(sched, prefiller, lent)
        sched.core.fleet.lend(lent.config.worker_id)
        specs = [_spec(f"r{i}", _prompt(i)) for i in range(3)]
        await _run_requests(nc, sched, specs)
        assert prefiller.role.handed_off == 3 and prefiller.role.running() == 0
        await _wait(lambda: all(_device_blocks(sched, prefiller, s) == 11 for s in specs))
        await _wait(lambda: _index_mirrors(sched, prefiller, lent))
        tg.cancel_scope.cancel()
