"""Where batches live: JetStream only, file storage.

- the KV bucket ``BATCHES_BUCKET``: one ``Batch`` record per batch id, changed only by
  compare-and-set on its revision (``update``), so ingresses and any number of runners may
  move a batch at once and none undoes another;
- the work-queue stream ``WORK_STREAM``: one ``WorkItem`` per line, ``Nats-Msg-Id`` = batch
  and line (a retried enqueue is stored once), removed when a runner acks it;
- the KV bucket ``RESULTS_BUCKET``: one ``LineResult`` per line, written with ``create``, which
  fails when the key exists: a line redelivered, or run by two runners, keeps its first result.

``request_counts`` are counted as results are created; a runner that died between the two is
caught up by ``recount`` (the results are the truth) before a batch is finalized.
"""

from __future__ import annotations

import logging
import secrets
import time
from collections.abc import Callable

import anyio
import anyio.lowlevel
import msgspec
from nats.aio.client import Client
from nats.js import JetStreamContext
from nats.js.api import (
    AckPolicy,
    ConsumerConfig,
    DeliverPolicy,
    KeyValueConfig,
    RetentionPolicy,
    StorageType,
    StreamConfig,
)
from nats.js.errors import BadRequestError, KeyNotFoundError, KeyWrongLastSequenceError, NotFoundError
from nats.js.kv import KeyValue

from switchyard.ingress.errors import ApiError, Unavailable
from switchyard.schemas import batch as schema
from switchyard.schemas import subjects

log = logging.getLogger(__name__)

_CAS_TRIES = 50
_ENQUEUE_AT_ONCE = 256  # publishes awaiting their ack at once while a batch is enqueued
_DUPLICATE_WINDOW_S = 600.0


class BatchNotFound(ApiError):
    status = 404
    type = "invalid_request_error"

    def __init__(self, batch_id: str) -> None:
        super().__init__(f"No batch found with id {batch_id!r}.", code="not_found", param="batch_id")


class BatchConflict(ApiError):
    status = 409
    type = "invalid_request_error"


def new_batch_id() -> str:
    """``batch_`` and 32 hex digits: the creation time in milliseconds first, so that ids sort by
    age (a listing's order within a second), then 80 random bits."""
    millis = int(time.time() * 1000) & ((1 << 48) - 1)
    return f"batch_{millis:012x}{secrets.token_hex(10)}"


def now_s() -> int:
    return int(time.time())


class BatchStore:
    """The batch records, the work queue and the results, on one JetStream context."""

    def __init__(self, nc: Client, *, timeout_s: float = 5.0) -> None:
        self._js: JetStreamContext = nc.jetstream(timeout=timeout_s)
        self._records: KeyValue | None = None
        self._results: KeyValue | None = None

    @property
    def js(self) -> JetStreamContext:
        return self._js

    async def ensure(self) -> None:
        """The buckets and the stream, created if missing (the same config again is a no-op);
        once opened, nothing more. Without JetStream: ``Unavailable`` (503), tried again next call."""
        if self._records is not None and self._results is not None:
            return
        try:
            await self._open()
        except ApiError:
            raise
        except Exception as exc:  # no JetStream here, no right to it, or it does not answer
            self._records = self._results = None
            raise Unavailable(f"Batch storage (JetStream) is unavailable: {exc!r}", retry_after_s=1.0) from None

    async def _open(self) -> None:
        self._records = await self._bucket(schema.BATCHES_BUCKET)
        self._results = await self._bucket(schema.RESULTS_BUCKET)
        config = StreamConfig(
            name=schema.WORK_STREAM,
            subjects=[subjects.every_batch_work()],
            retention=RetentionPolicy.WORK_QUEUE,
            storage=StorageType.FILE,
            duplicate_window=_DUPLICATE_WINDOW_S,
        )
        try:
            await self._js.add_stream(config)
        except BadRequestError:  # it exists with another configuration (an operator's): kept
            await self._js.stream_info(schema.WORK_STREAM)

    async def _bucket(self, name: str) -> KeyValue:
        try:
            return await self._js.create_key_value(KeyValueConfig(bucket=name, history=1, storage=StorageType.FILE))
        except BadRequestError:
            return await self._js.key_value(name)

    @property
    def records(self) -> KeyValue:
        assert self._records is not None, "BatchStore.ensure() first"
        return self._records

    @property
    def results(self) -> KeyValue:
        assert self._results is not None, "BatchStore.ensure() first"
        return self._results

    # --- records ------------------------------------------------------------------------------

    async def create(self, batch: schema.Batch) -> None:
        await self.records.create(batch.id, schema.encode(batch))

    async def get(self, batch_id: str) -> schema.Batch | None:
        try:
            entry = await self.records.get(batch_id)
        except (KeyNotFoundError, NotFoundError):
            return None
        return schema.BATCH.decode(entry.value) if entry.value else None

    async def visible(self, batch_id: str, tenant: str) -> schema.Batch:
        """The tenant's batch, or 404: another tenant's batches do not exist for it."""
        batch = await self.get(batch_id) if _valid_key(batch_id) else None
        if batch is None or batch.tenant != tenant:
            raise BatchNotFound(batch_id)
        return batch

    async def update(self, batch_id: str, change: Callable[[schema.Batch], schema.Batch | None]) -> schema.Batch | None:
        """Apply ``change`` by compare-and-set, again on a conflict; ``change`` returning None
        (or the record unchanged) writes nothing. Returns the record as written, or None."""
        for _ in range(_CAS_TRIES):
            entry = await self.records.get(batch_id)
            assert entry.value is not None
            current = schema.BATCH.decode(entry.value)
            changed = change(current)
            if changed is None or changed == current:
                return None
            try:
                await self.records.update(batch_id, schema.encode(changed), last=entry.revision)
            except KeyWrongLastSequenceError:
                await anyio.lowlevel.checkpoint()
                continue
            return changed
        raise ApiError(f"batch {batch_id}: its record kept changing under {_CAS_TRIES} updates")

    async def all(self, skip: frozenset[str] | set[str] = frozenset()) -> list[schema.Batch]:
        """Every record but those in ``skip`` (ended batches a reader already knows: they never change)."""
        # The keys as the stream holds them now, in one answer: a KV key listing (a watch) misses
        # a key updated while it runs, its old revision gone and the new one after the listing.
        prefix = f"$KV.{schema.BATCHES_BUCKET}."
        info = await self._js.stream_info(f"KV_{schema.BATCHES_BUCKET}", subjects_filter=prefix + ">")
        keys = [subject.removeprefix(prefix) for subject in (info.state.subjects or {})]
        found = [await self.get(k) for k in keys if k not in skip]
        return [b for b in found if b is not None]

    async def of_tenant(self, tenant: str) -> list[schema.Batch]:
        """Newest first."""
        mine = [b for b in await self.all() if b.tenant == tenant]
        return sorted(mine, key=lambda b: b.id, reverse=True)

    # --- the work queue -----------------------------------------------------------------------

    async def enqueue(self, items: list[schema.WorkItem]) -> None:
        """Every item on the work queue, acked by JetStream, ``_ENQUEUE_AT_ONCE`` in flight."""
        for start in range(0, len(items), _ENQUEUE_AT_ONCE):
            async with anyio.create_task_group() as tg:
                for item in items[start : start + _ENQUEUE_AT_ONCE]:
                    tg.start_soon(self._publish, item)

    async def _publish(self, item: schema.WorkItem) -> None:
        await self._js.publish(
            subjects.batch_work(item.tenant, item.batch_id),
            schema.encode(item),
            stream=schema.WORK_STREAM,
            headers={"Nats-Msg-Id": f"{item.batch_id}/{item.line}"},
        )

    @staticmethod
    def consumer_name(batch_id: str) -> str:
        return batch_id  # batch_<hex>: a valid durable name, one per batch

    @staticmethod
    def consumer_config(batch: schema.Batch, *, ack_wait_s: float, max_deliver: int) -> ConsumerConfig:
        return ConsumerConfig(
            durable_name=BatchStore.consumer_name(batch.id),
            filter_subject=subjects.batch_work(batch.tenant, batch.id),
            ack_policy=AckPolicy.EXPLICIT,
            deliver_policy=DeliverPolicy.ALL,
            ack_wait=ack_wait_s,
            max_deliver=max_deliver,
            max_ack_pending=-1,
        )

    async def drop_consumer(self, batch_id: str) -> None:
        try:
            await self._js.delete_consumer(schema.WORK_STREAM, self.consumer_name(batch_id))
        except NotFoundError:
            pass

    # --- results ------------------------------------------------------------------------------

    async def put_result(self, result: schema.LineResult) -> bool:
        """The line's result, unless it has one: True when this one is stored."""
        try:
            await self.results.create(schema.result_key(result.batch_id, result.custom_id), schema.encode(result))
        except KeyWrongLastSequenceError:
            return False
        return True

    async def has_result(self, batch_id: str, custom_id: str) -> bool:
        try:
            await self.results.get(schema.result_key(batch_id, custom_id))
        except (KeyNotFoundError, NotFoundError):
            return False
        return True

    async def results_of(self, batch_id: str) -> list[schema.LineResult]:
        """Every result of one batch, read from the bucket's stream (one message each)."""
        subject = f"$KV.{schema.RESULTS_BUCKET}.{schema.results_of(batch_id)}"
        stream = f"KV_{schema.RESULTS_BUCKET}"
        info = await self._js.stream_info(stream, subjects_filter=subject)
        expected = (info.state.subjects or {}) if info.state else {}
        if not expected:
            return []
        found: dict[str, schema.LineResult] = {}
        sub = await self._js.subscribe(subject, stream=stream, ordered_consumer=True, deliver_policy=DeliverPolicy.ALL)
        try:
            while len(found) < len(expected):
                msg = await sub.next_msg(timeout=5.0)
                result = schema.LINE_RESULT.decode(msg.data)
                found[result.custom_id] = result
        finally:
            await sub.unsubscribe()
        return list(found.values())

    async def recount(self, batch_id: str) -> schema.RequestCounts:
        results = await self.results_of(batch_id)
        ok = sum(r.ok for r in results)
        batch = await self.get(batch_id)
        total = batch.request_counts.total if batch else len(results)
        return schema.RequestCounts(total=total, completed=ok, failed=len(results) - ok)

    async def count(self, result: schema.LineResult) -> schema.Batch | None:
        """Add one stored result to its batch's ``request_counts``."""

        def add(batch: schema.Batch) -> schema.Batch:
            c = batch.request_counts
            counts = msgspec.structs.replace(c, completed=c.completed + result.ok, failed=c.failed + (not result.ok))
            return msgspec.structs.replace(batch, request_counts=counts)

        return await self.update(result.batch_id, add)


def _valid_key(batch_id: str) -> bool:
    return batch_id.startswith("batch_") and batch_id[6:].isalnum() and len(batch_id) <= 64
