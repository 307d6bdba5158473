"""Batch work on a real nats-server with JetStream: lines queued on the work-queue stream,
run by a batch runner against a stand-in ingress (an httpx transport; the scheduler's
status answered by a stand-in on the real bus), results stored once per line.

- a batch runs to ``completed``, its output file one OpenAI line per input line;
- a line whose result is already stored (its runner died after storing, before acking) is
  acked without running again: no second line; two runners on one batch give one line each;
- a line that keeps failing becomes an error line after ``max_deliver``; a line whose runner
  died on its last delivery becomes one from JetStream's max-deliveries advisory;
- no headroom (the scheduler's queue not empty): nothing is pulled;
- cancel drops queued lines and cancels those in flight; past the window, lines expire;
- the bus-native JobSubmit makes the same batch."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import anyio
import httpx
import msgspec
import pytest
from nats.aio.client import Client

from switchyard.ingress.batch_client import BatchClient
from switchyard.ingress.batch_config import BatchRunnerConfig
from switchyard.ingress.batch_runner import BatchRunner
from switchyard.ingress.batch_store import BatchStore
from switchyard.ingress.batches import BatchMaker, cancelled
from switchyard.ingress.files import FileStore
from switchyard.observability import connect, settle, subscribe
from switchyard.schemas import ClusterStatus, codec, subjects
from switchyard.schemas.batch import (
    JOB_REPLY,
    WORK_STREAM,
    Batch,
    Job,
    JobAccepted,
    JobSubmit,
    LineResult,
    encode,
)

pytestmark = pytest.mark.anyio

MODEL = "switchyard-sim"
CHAT = "/v1/chat/completions"


def lines(n: int, prefix: str = "line") -> bytes:
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
    return b"".join(
        json.dumps({"custom_id": f"{prefix}-{i}", "method": "POST", "url": CHAT, "body": body}).encode() + b"\n"
        for i in range(n)
    )


class Ingress:
    """A stand-in for the ingress's HTTP API: answers each POST with ``status`` (after ``delay_s``)."""

    def __init__(self, status: int = 200, delay_s: float = 0.0) -> None:
        self.status = status
        self.delay_s = delay_s
        self.posts: list[httpx.Request] = []

    async def __call__(self, request: httpx.Request) -> httpx.Response:
        if request.method == "GET":
            return httpx.Response(200, json={"object": "list", "data": [{"id": MODEL}]})
        self.posts.append(request)
        await anyio.sleep(self.delay_s)
        if self.status != 200:
            return httpx.Response(self.status, json={"error": {"message": "busy", "type": "server_error"}})
        usage = {
            "prompt_tokens": 5,
            "completion_tokens": 4,
            "total_tokens": 9,
            "prompt_tokens_details": {"cached_tokens": 0},
        }
        return httpx.Response(
            200, json={"id": f"chatcmpl-{len(self.posts)}", "object": "chat.completion", "usage": usage}
        )

    def transport(self) -> httpx.MockTransport:
        return httpx.MockTransport(self)


class Scheduler:
    """Answers StatusRequest on the real bus with a queue of ``queued`` requests."""

    def __init__(self) -> None:
        self.queued = 0

    async def serve(self, nc: Client) -> None:
        sub = await subscribe(nc, subjects.SUBMIT)
        async for msg in sub.messages:
            status = ClusterStatus(workers=[], queued_requests=self.queued, queued_tokens=self.queued * 10)
            await msg.respond(codec.SCHEDULER_REPLY.encode(status))


class Bed:
    def __init__(self, nc: Client, tg, url: str) -> None:
        self.nc, self.tg, self.url = nc, tg, url
        self.store = BatchStore(nc)
        self.files = FileStore(self.store.js, max_bytes=1 << 24)
        self.maker = BatchMaker(self.store, MODEL)
        self.scheduler = Scheduler()

    def config(self, **overrides) -> BatchRunnerConfig:
        settings = {"nats_url": self.url, "scan_interval_s": 0.1, "retry_delay_s": 0.0, "ack_wait_s": 5.0} | overrides
        return BatchRunnerConfig(**settings)

    async def runner(self, ingress: Ingress, **overrides) -> BatchRunner:
        runner = BatchRunner(self.config(**overrides), transport=ingress.transport())
        await self.tg.start(runner.run)
        return runner

    async def create(self, data: bytes, tenant: str = "acme") -> Batch:
        return await self.maker.create(
            tenant=tenant, endpoint=CHAT, window="24h", metadata=None, input_file_id="file-x", data=data
        )

    async def wait_status(self, batch_id: str, *statuses: str, timeout_s: float = 20.0) -> Batch:
        with anyio.fail_after(timeout_s):
            while True:
                batch = await self.store.get(batch_id)
                if batch is not None and batch.status in statuses:
                    return batch
                await anyio.sleep(0.05)

    async def output(self, file_id: str | None, tenant: str = "acme") -> list[dict]:
        if file_id is None:
            return []
        return [json.loads(x) for x in (await self.files.read(file_id, tenant=tenant)).splitlines()]


@asynccontextmanager
async def bed(url: str) -> AsyncIterator[Bed]:
    async with connect(url, "test") as nc, anyio.create_task_group() as tg:
        b = Bed(nc, tg, url)
        await b.store.ensure()
        await b.files.ensure()
        tg.start_soon(b.scheduler.serve, nc)
        await settle(nc)
        yield b
        tg.cancel_scope.cancel()


async def test_a_batch_runs_to_completed_with_one_output_line_per_input_line(nats):
    async with bed(nats.url) as b:
        batch = await b.create(lines(5))
        assert batch.status == "in_progress" and batch.request_counts.total == 5
        assert (await b.store.js.stream_info(WORK_STREAM)).state.messages == 5
        ingress = Ingress()
        await b.runner(ingress)
        done = await b.wait_status(batch.id, "completed")
        assert done.request_counts.completed == 5 and done.request_counts.failed == 0
        assert done.completed_at and done.finalizing_at and done.in_progress_at and done.error_file_id is None
        out = await b.output(done.output_file_id)
        assert sorted(x["custom_id"] for x in out) == [f"line-{i}" for i in range(5)]
        assert all(x["response"]["status_code"] == 200 and x["error"] is None for x in out)
        assert all(x["response"]["body"]["usage"]["prompt_tokens_details"]["cached_tokens"] == 0 for x in out)
        assert len(ingress.posts) == 5
        assert all(p.headers["x-switchyard-priority"] == "batch" for p in ingress.posts)
        assert all(p.headers["x-switchyard-tenant"] == "acme" for p in ingress.posts)
        assert (await b.store.js.stream_info(WORK_STREAM)).state.messages == 0  # every line acked


async def test_a_line_with_a_stored_result_is_acked_without_running_again(nats):
    async with bed(nats.url) as b:
        batch = await b.create(lines(3))
        first = LineResult(batch_id=batch.id, custom_id="line-1", line=2, status_code=200, body='{"id": "earlier"}')
        assert await b.store.put_result(first)
        await b.store.count(first)  # as the runner that died after storing it had
        assert not await b.store.put_result(msgspec.structs.replace(first, body='{"id": "second"}'))
        ingress = Ingress()
        await b.runner(ingress)
        done = await b.wait_status(batch.id, "completed")
        out = await b.output(done.output_file_id)
        assert len(out) == 3 and len(ingress.posts) == 2
        assert [x["response"]["body"]["id"] for x in out if x["custom_id"] == "line-1"] == ["earlier"]
        assert done.request_counts.completed == 3


async def test_two_runners_on_one_batch_give_one_line_each(nats):
    async with bed(nats.url) as b:
        batch = await b.create(lines(40))
        ingress = Ingress(delay_s=0.01)
        await b.runner(ingress, batch_concurrency=4)
        await b.runner(ingress, batch_concurrency=4)
        done = await b.wait_status(batch.id, "completed")
        out = await b.output(done.output_file_id)
        assert sorted(x["custom_id"] for x in out) == sorted(f"line-{i}" for i in range(40))
        assert done.request_counts.completed == 40


async def test_a_line_that_keeps_failing_becomes_an_error_line(nats):
    async with bed(nats.url) as b:
        batch = await b.create(lines(2))
        ingress = Ingress(status=503)
        await b.runner(ingress, max_deliver=3)
        done = await b.wait_status(batch.id, "completed")
        assert done.request_counts.failed == 2 and done.output_file_id is None
        errors = await b.output(done.error_file_id)
        assert [x["response"]["status_code"] for x in errors] == [503, 503]
        assert len(ingress.posts) == 6  # three deliveries each


async def test_a_line_whose_runner_died_on_its_last_delivery_becomes_an_error_line(nats):
    async with bed(nats.url) as b:
        batch = await b.create(lines(2))
        config = b.config(ack_wait_s=0.5, max_deliver=1)
        consumer = BatchStore.consumer_config(batch, ack_wait_s=config.ack_wait_s, max_deliver=config.max_deliver)
        dead = await b.store.js.pull_subscribe(
            subjects.batch_work(batch.tenant, batch.id),
            durable=consumer.durable_name,
            stream=WORK_STREAM,
            config=consumer,
        )
        [taken] = await dead.fetch(1, timeout=2)  # a runner took it, and died: never acked
        ingress = Ingress()
        await b.runner(ingress, ack_wait_s=0.5, max_deliver=1)
        done = await b.wait_status(batch.id, "completed")
        [error] = await b.output(done.error_file_id)
        assert error["response"] is None and error["error"]["code"] == "max_deliveries"
        assert error["custom_id"] == json.loads(taken.data)["custom_id"]
        assert len(await b.output(done.output_file_id)) == 1
        assert (done.request_counts.completed, done.request_counts.failed) == (1, 1)


async def test_without_headroom_nothing_is_pulled(nats):
    async with bed(nats.url) as b:
        b.scheduler.queued = 3  # interactive requests wait in the scheduler's queue
        batch = await b.create(lines(3))
        ingress = Ingress()
        runner = await b.runner(ingress)
        with anyio.fail_after(5):
            while batch.id not in runner._active:  # the runner knows the batch, and waits
                await anyio.sleep(0.05)
        await anyio.sleep(0.5)
        assert ingress.posts == []
        b.scheduler.queued = 0
        done = await b.wait_status(batch.id, "completed")
        assert done.request_counts.completed == 3


async def test_cancel_drops_queued_lines_and_cancels_those_in_flight(nats):
    async with bed(nats.url) as b:
        batch = await b.create(lines(20))
        ingress = Ingress(delay_s=60)  # every line hangs until cancelled; the first runs alone
        await b.runner(ingress, batch_concurrency=2)
        with anyio.fail_after(5):
            while not ingress.posts:
                await anyio.sleep(0.02)
        assert (await b.store.update(batch.id, cancelled)).status == "cancelling"
        done = await b.wait_status(batch.id, "cancelled")
        assert done.cancelled_at and done.output_file_id is None
        errors = await b.output(done.error_file_id)
        assert len(errors) == 20 and {x["error"]["code"] for x in errors} == {"batch_cancelled"}
        assert done.request_counts.failed == 20
        assert len(ingress.posts) == 1


async def test_lines_past_the_window_expire(nats):
    async with bed(nats.url) as b:
        batch = await b.create(lines(3))
        await b.store.update(batch.id, lambda x: msgspec.structs.replace(x, expires_at=x.created_at - 1))
        ingress = Ingress()
        await b.runner(ingress)
        done = await b.wait_status(batch.id, "expired")
        assert done.expired_at
        errors = await b.output(done.error_file_id)
        assert [x["error"]["code"] for x in errors] == ["batch_expired"] * 3
        assert ingress.posts == []


async def test_a_job_submitted_on_the_bus_runs_as_a_batch(nats):
    async with bed(nats.url) as b:
        ingress = Ingress()
        await b.runner(ingress)
        body = {"model": MODEL, "prompt": "hi", "max_tokens": 2}
        submit = JobSubmit(endpoint="/v1/completions", jobs=[Job(custom_id="j1", body=body)], tenant="bus")
        reply = JOB_REPLY.decode(await BatchClient(b.nc)._request(encode(submit)))
        assert isinstance(reply, JobAccepted) and reply.batch.input_file_id is None
        done = await b.wait_status(reply.batch.id, "completed")
        [result] = await b.store.results_of(done.id)
        assert result.custom_id == "j1" and result.ok
        bad = JobSubmit(endpoint="/v1/completions", jobs=[Job(custom_id="j1", body={"model": "nope", "prompt": "x"})])
        rejected = JOB_REPLY.decode(await BatchClient(b.nc)._request(encode(bad)))
        assert not isinstance(rejected, JobAccepted) and rejected.errors[0].code == "model_not_found"


async def test_the_python_client_submits_waits_and_reads_results(nats):
    from switchyard.ingress import BatchClient, BatchRejected

    async with bed(nats.url) as b:
        await b.runner(Ingress())
        jobs = BatchClient(b.nc)
        body = {"model": MODEL, "prompt": "hi", "max_tokens": 2}
        batch = await jobs.submit("/v1/completions", {"a": body, "b": body}, tenant="bus", metadata={"k": "v"})
        done = await jobs.wait(batch.id)
        assert done.status == "completed" and done.metadata == {"k": "v"} and done.tenant == "bus"
        results = await jobs.results(batch.id)
        assert sorted(results) == ["a", "b"] and all(r.ok for r in results.values())
        with pytest.raises(BatchRejected) as refused:
            await jobs.submit("/v1/completions", {"a": body, "b": {"model": MODEL}})
        assert refused.value.errors[0].line == 2 and "job 2" in str(refused.value)


async def test_a_finalizing_that_failed_is_tried_again_by_its_runner(nats):
    async with bed(nats.url) as b:
        runner = await b.runner(Ingress())
        real_put, failures = runner.files.put, []

        async def put_failing_once(*args, **kwargs):
            if not failures:
                failures.append(args)
                raise RuntimeError("the object store went away")
            return await real_put(*args, **kwargs)

        runner.files.put = put_failing_once  # type: ignore[method-assign]
        batch = await b.create(lines(2))
        done = await b.wait_status(batch.id, "completed", timeout_s=10)  # well before another runner's 60 s
        assert failures and len(await b.output(done.output_file_id)) == 2


async def test_a_batch_left_validating_fails_and_its_lines_go(nats):
    from switchyard.ingress.batch_store import new_batch_id, now_s
    from switchyard.schemas.batch import WorkItem

    async with bed(nats.url) as b:
        old = now_s() - 3600  # its ingress died an hour ago while queueing its lines
        batch = Batch(
            id=new_batch_id(),
            endpoint=CHAT,
            input_file_id="file-x",
            completion_window="24h",
            status="validating",
            created_at=old,
            expires_at=old + 86400,
            tenant="acme",
        )
        await b.store.create(batch)
        item = WorkItem(batch_id=batch.id, custom_id="a", line=1, body="{}", endpoint=CHAT, tenant="acme")
        await b.store.enqueue([item, msgspec.structs.replace(item, custom_id="b", line=2)])
        other = await b.create(lines(1))  # a batch of its own, untouched
        ingress = Ingress()
        await b.runner(ingress)
        failed = await b.wait_status(batch.id, "failed")
        assert failed.errors is not None and failed.errors.data[0].code == "validation_interrupted"
        await b.wait_status(other.id, "completed")
        assert (await b.store.js.stream_info(WORK_STREAM)).state.messages == 0
        assert len(ingress.posts) == 1


async def test_a_line_redelivered_after_its_result_was_stored_gives_no_second_line(nats):
    """A real redelivery: the runner stores line-1's result and fails before counting and acking
    it (as one that dies there would); JetStream delivers the line again after ack_wait, the
    runner acks it without running it again, and the idle batch's recount finds the result."""

    deliveries: list[int] = []

    class FailsBeforeTheAck(BatchRunner):
        async def _run_line(self, active, item, msg, region=""):
            if item.custom_id == "line-1":
                deliveries.append(msg.metadata.num_delivered)
            await super()._run_line(active, item, msg, region)

        async def _settle(self, item, msg, result):
            if item.custom_id == "line-1" and msg is not None and len(deliveries) == 1:
                await self.store.put_result(result)
                raise RuntimeError("gone before counting and acking")
            await super()._settle(item, msg, result)

    async with bed(nats.url) as b:
        ingress = Ingress()
        runner = FailsBeforeTheAck(b.config(ack_wait_s=1.0), transport=ingress.transport())
        await b.tg.start(runner.run)
        batch = await b.create(lines(3))
        done = await b.wait_status(batch.id, "completed")
        assert deliveries == [1, 2]
        out = await b.output(done.output_file_id)
        assert sorted(x["custom_id"] for x in out) == ["line-0", "line-1", "line-2"]
        assert len(ingress.posts) == 3 and done.request_counts.completed == 3
        assert (await b.store.js.stream_info(WORK_STREAM)).state.messages == 0


async def test_a_line_counted_but_never_acked_leaves_nothing_on_the_queue(nats):
    """The runner stores and counts line-1's result and fails before acking it: the counts are
    complete, so the batch finalizes, and the unacked line goes with the batch's consumer."""

    class FailsBeforeTheAck(BatchRunner):
        async def _settle(self, item, msg, result):
            if item.custom_id == "line-1" and msg is not None and msg.metadata.num_delivered == 1:
                await self._store_result(result)
                raise RuntimeError("gone before the ack")
            await super()._settle(item, msg, result)

    async with bed(nats.url) as b:
        ingress = Ingress()
        await b.tg.start(FailsBeforeTheAck(b.config(ack_wait_s=30.0), transport=ingress.transport()).run)
        batch = await b.create(lines(3))
        done = await b.wait_status(batch.id, "completed")
        assert len(await b.output(done.output_file_id)) == 3 and len(ingress.posts) == 3
        assert (await b.store.js.stream_info(WORK_STREAM)).state.messages == 0
