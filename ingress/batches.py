"""The OpenAI Batch API: ``POST /v1/batches``, ``GET /v1/batches/{id}``, ``GET /v1/batches``,
``POST /v1/batches/{id}/cancel``, as the official client calls them.

Creating a batch checks the request (endpoint, ``completion_window`` "24h", metadata) and the
input file (``ingress.batch_lines``) before any work: the record is written ``validating``,
then either ``failed`` with ``errors`` naming each bad line, or, once every line is on the
work queue, ``in_progress``. From there the batch runners (``ingress.batch_runner``) own it.
Every record belongs to the tenant that created it: another tenant gets 404 for it and does
not see it listed.

``BatchMaker`` is shared with the bus-native path (``JobSubmit``, answered by the runners):
both make the same record and the same work items.
"""

from __future__ import annotations

import logging
from collections import Counter
from typing import Any, Protocol, get_args

import anyio
import msgspec
from prometheus_client import CollectorRegistry, Gauge
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from switchyard.ingress.auth import caller_of
from switchyard.ingress.batch_lines import Line, check_input
from switchyard.ingress.batch_store import BatchConflict, BatchStore, new_batch_id, now_s
from switchyard.ingress.edge import read_body
from switchyard.ingress.errors import InvalidRequest
from switchyard.ingress.openai_types import decode_body
from switchyard.ingress.openapi import described
from switchyard.schemas import batch as schema

log = logging.getLogger(__name__)

INPUT_PURPOSE = "batch"
OUTPUT_PURPOSE = "batch_output"
MAX_METADATA_PAIRS, MAX_METADATA_KEY, MAX_METADATA_VALUE = 16, 64, 512
DEFAULT_MAX_LINES = 50_000  # OpenAI's limit per batch
_CHECK_ON_LOOP_BYTES = 64 * 1024


class FileInfo(Protocol):
    @property
    def purpose(self) -> str: ...

    @property
    def id(self) -> str: ...


class Files(Protocol):
    """What batches need of ``ingress.files.FileStore``."""

    async def info(self, file_id: str, *, tenant: str) -> Any: ...

    async def read(self, file_id: str, *, tenant: str) -> bytes: ...

    async def put(self, filename: str, purpose: str, data: bytes, *, tenant: str) -> Any: ...


class CreateBatch(msgspec.Struct, frozen=True, kw_only=True):
    input_file_id: str
    endpoint: str
    completion_window: str
    metadata: dict[str, str] | None = None


class BatchMaker:
    """A batch from its lines: the record, the work items, the record's first moves."""

    def __init__(self, store: BatchStore, model: str, *, max_lines: int = DEFAULT_MAX_LINES) -> None:
        self.store = store
        self.model = model
        self.max_lines = max_lines

    def check_request(self, endpoint: str, window: str, metadata: dict[str, str] | None) -> None:
        if endpoint not in schema.ENDPOINTS:
            raise InvalidRequest(
                f"endpoint must be one of {', '.join(schema.ENDPOINTS)}, got {endpoint!r}.", param="endpoint"
            )
        if window not in schema.COMPLETION_WINDOWS:
            windows = ", ".join(repr(w) for w in schema.COMPLETION_WINDOWS)
            raise InvalidRequest(f"completion_window must be {windows}, got {window!r}.", param="completion_window")
        if metadata is not None and (
            len(metadata) > MAX_METADATA_PAIRS
            or any(len(k) > MAX_METADATA_KEY or len(v) > MAX_METADATA_VALUE for k, v in metadata.items())
        ):
            raise InvalidRequest(
                f"metadata holds at most {MAX_METADATA_PAIRS} pairs, keys up to {MAX_METADATA_KEY} and values up to "
                f"{MAX_METADATA_VALUE} characters.",
                param="metadata",
            )

    async def create(
        self,
        *,
        tenant: str,
        endpoint: str,
        window: str,
        metadata: dict[str, str] | None,
        input_file_id: str | None,
        data: bytes,
    ) -> schema.Batch:
        """Check every line, then record the batch: ``failed`` with its errors, or ``in_progress``
        with every line on the work queue."""
        created = now_s()
        batch = schema.Batch(
            id=new_batch_id(),
            endpoint=endpoint,
            input_file_id=input_file_id,
            completion_window=window,
            status="validating",
            created_at=created,
            expires_at=created + schema.COMPLETION_WINDOWS[window],
            tenant=tenant,
            metadata=metadata,
            model=self.model,
        )
        await self.store.create(batch)
        checked = await _off_loop_if_large(
            data, lambda: check_input(data, endpoint, self.model, max_lines=self.max_lines)
        )
        if checked.errors:
            return await self._fail(batch, checked.errors)
        await self.store.enqueue([self._item(batch, line) for line in checked.lines])
        counts = schema.RequestCounts(total=len(checked.lines))
        started = await self.store.update(
            batch.id,
            lambda b: (
                msgspec.structs.replace(b, status="in_progress", in_progress_at=now_s(), request_counts=counts)
                if b.status == "validating"
                else None
            ),
        )
        log.info("batch %s of tenant %s: %d lines queued", batch.id, tenant, counts.total)
        return started or await self.store.visible(batch.id, tenant)  # cancelled meanwhile

    async def _fail(self, batch: schema.Batch, errors: list[schema.BatchError]) -> schema.Batch:
        failed = msgspec.structs.replace(
            batch, status="failed", failed_at=now_s(), errors=schema.BatchErrors(data=errors)
        )
        written = await self.store.update(batch.id, lambda _: failed)
        log.info("batch %s failed validation: %d errors, the first: %s", batch.id, len(errors), errors[0].message)
        return written or failed

    def _item(self, batch: schema.Batch, line: Line) -> schema.WorkItem:
        return schema.WorkItem(
            batch_id=batch.id,
            custom_id=line.custom_id,
            line=line.line,
            body=line.body,
            endpoint=batch.endpoint,
            tenant=batch.tenant,
            priority=schema.BATCH_PRIORITY,
        )


async def _off_loop_if_large(data: bytes, check):
    return check() if len(data) <= _CHECK_ON_LOOP_BYTES else await anyio.to_thread.run_sync(check)


def cancelled(batch: schema.Batch) -> schema.Batch | None:
    """The record moved to ``cancelling`` (None when it already is); 409 once it has ended."""
    if batch.status == "cancelling":
        return None
    if batch.status in ("validating", "in_progress"):
        return msgspec.structs.replace(batch, status="cancelling", cancelling_at=now_s())
    raise BatchConflict(f"Cannot cancel a batch with status {batch.status!r}.", code="batch_not_cancellable")


def page(batches: list[schema.Batch], after: str | None, limit: int) -> dict[str, Any]:
    """OpenAI's list shape over ``batches`` (newest first), after the id ``after``."""
    if after is not None:
        ids = [b.id for b in batches]
        batches = batches[ids.index(after) + 1 :] if after in ids else []
    shown = batches[:limit]
    return {
        "object": "list",
        "data": [b.public() for b in shown],
        "first_id": shown[0].id if shown else None,
        "last_id": shown[-1].id if shown else None,
        "has_more": len(batches) > limit,
    }


_BATCH_ID = {"name": "batch_id", "in": "path", "required": True, "schema": {"type": "string"}}
_UNAVAILABLE = {"503": "JetStream (batch storage) is unavailable"}
_NOT_FOUND = {"404": "no such batch for this tenant"}
_CREATE_BODY = {
    "required": True,
    "content": {
        "application/json": {
            "schema": {
                "type": "object",
                "required": ["input_file_id", "endpoint", "completion_window"],
                "properties": {
                    "input_file_id": {"type": "string"},
                    "endpoint": {"type": "string", "enum": list(schema.ENDPOINTS)},
                    "completion_window": {"type": "string", "enum": list(schema.COMPLETION_WINDOWS)},
                    "metadata": {"type": ["object", "null"], "additionalProperties": {"type": "string"}},
                },
            }
        }
    },
}


class BatchMetrics:
    """What ``/metrics`` shows of batches, read from JetStream at each scrape: batches by status,
    their lines by outcome (``pending``: not finished yet), and the lines on the work queue."""

    def __init__(self, store: BatchStore, registry: CollectorRegistry) -> None:
        self.store = store
        self.batches = Gauge("switchyard_batches", "Batch records, by status.", ["status"], registry=registry)
        self.lines = Gauge(
            "switchyard_batch_lines", "Lines of the batch records, by outcome.", ["outcome"], registry=registry
        )
        self.queued = Gauge(
            "switchyard_batch_queue_depth", "Batch lines on the work queue, not yet acked.", registry=registry
        )
        for status in get_args(schema.BatchStatus):
            self.batches.labels(status)
        for outcome in ("completed", "failed", "pending"):
            self.lines.labels(outcome)

    async def refresh(self) -> None:
        """Set every gauge; without JetStream, leave them as they were."""
        try:
            await self.store.ensure()
            batches = await self.store.all()
            depth = (await self.store.js.stream_info(schema.WORK_STREAM)).state.messages
        except Exception as exc:  # a scrape must answer, JetStream or not
            log.debug("batch metrics: %r", exc)
            return
        by_status = Counter(b.status for b in batches)
        for status in get_args(schema.BatchStatus):
            self.batches.labels(status).set(by_status[status])
        counts = [b.request_counts for b in batches]
        self.lines.labels("completed").set(sum(c.completed for c in counts))
        self.lines.labels("failed").set(sum(c.failed for c in counts))
        self.lines.labels("pending").set(sum(c.total - c.done for c in counts))
        self.queued.set(depth)


class BatchApi:
    """The routes, over a ``BatchMaker`` and the Files store."""

    def __init__(
        self, maker: BatchMaker, files: Files, *, metrics: BatchMetrics | None = None, max_body_bytes: int = 1 << 20
    ) -> None:
        self.maker = maker
        self.metrics = metrics or BatchMetrics(maker.store, CollectorRegistry())
        self.store = maker.store
        self.files = files
        self.max_body_bytes = max_body_bytes

    def routes(self) -> list[Route]:
        return [
            Route("/v1/batches", self.create, methods=["POST"]),
            Route("/v1/batches", self.list_batches, methods=["GET"]),
            Route("/v1/batches/{batch_id}", self.retrieve, methods=["GET"]),
            Route("/v1/batches/{batch_id}/cancel", self.cancel, methods=["POST"]),
        ]

    @described(
        summary="Create a batch from an uploaded file of requests (purpose batch)",
        requestBody=_CREATE_BODY,
        errors={
            "400": "a field, the endpoint, the window, or the file's purpose",
            "404": "no such file",
            "413": "the body is larger than --max-body-bytes",
        }
        | _UNAVAILABLE,
    )
    async def create(self, request: Request) -> Response:
        """Create a batch from an uploaded file of requests"""
        await self.store.ensure()
        body = decode_body(await read_body(request, self.max_body_bytes), CreateBatch)
        self.maker.check_request(body.endpoint, body.completion_window, body.metadata)
        tenant = caller_of(request).tenant
        info = await self.files.info(body.input_file_id, tenant=tenant)  # 404 for an unknown id
        if info.purpose != INPUT_PURPOSE:
            raise InvalidRequest(
                f"The file {body.input_file_id!r} has purpose {info.purpose!r}; a batch needs {INPUT_PURPOSE!r}.",
                param="input_file_id",
            )
        data = await self.files.read(body.input_file_id, tenant=tenant)
        batch = await self.maker.create(
            tenant=tenant,
            endpoint=body.endpoint,
            window=body.completion_window,
            metadata=body.metadata,
            input_file_id=body.input_file_id,
            data=data,
        )
        return JSONResponse(batch.public())

    @described(summary="A batch, by its id", parameters=[_BATCH_ID], errors=_NOT_FOUND | _UNAVAILABLE)
    async def retrieve(self, request: Request) -> Response:
        """A batch, by its id"""
        await self.store.ensure()
        batch = await self.store.visible(request.path_params["batch_id"], caller_of(request).tenant)
        return JSONResponse(batch.public())

    @described(
        summary="The caller's batches, newest first, in pages",
        parameters=[
            {"name": "after", "in": "query", "schema": {"type": "string"}},
            {"name": "limit", "in": "query", "schema": {"type": "integer", "minimum": 1, "maximum": 100}},
        ],
        errors={"400": "limit out of range"} | _UNAVAILABLE,
    )
    async def list_batches(self, request: Request) -> Response:
        """The caller's batches, newest first"""
        await self.store.ensure()
        after = request.query_params.get("after")
        limit_text = request.query_params.get("limit", "20")
        if not limit_text.isdigit() or not 1 <= int(limit_text) <= 100:
            raise InvalidRequest(f"limit must be 1 to 100, got {limit_text!r}.", param="limit")
        batches = await self.store.of_tenant(caller_of(request).tenant)
        return JSONResponse(page(batches, after, int(limit_text)))

    @described(
        summary="Cancel a batch",
        parameters=[_BATCH_ID],
        errors=_NOT_FOUND | {"409": "the batch has ended"} | _UNAVAILABLE,
    )
    async def cancel(self, request: Request) -> Response:
        """Cancel a batch: queued lines are dropped, lines in flight are cancelled"""
        await self.store.ensure()
        batch = await self.store.visible(request.path_params["batch_id"], caller_of(request).tenant)
        changed = await self.store.update(batch.id, cancelled)
        return JSONResponse((changed or await self.store.visible(batch.id, batch.tenant)).public())
