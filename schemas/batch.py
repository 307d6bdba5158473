"""Batch jobs on JetStream: the batch record, its work items, their results, the bus-native submit.

Two faces, one machinery. The HTTP Batch API (``ingress.batches``) and a producer on the bus
(``JobSubmit`` on ``subjects.BATCH_SUBMIT``) both make a ``Batch`` record (KV bucket
``BATCHES_BUCKET``, key = the batch id) and one ``WorkItem`` per line on the work-queue
stream ``WORK_STREAM`` (subject ``subjects.batch_work(tenant, batch_id)``). Batch runners
(``ingress.batch_runner``) execute the items and write one ``LineResult`` per line into the
KV bucket ``RESULTS_BUCKET`` under ``result_key(batch_id, custom_id)``, with a create that
fails if the key exists: however often an item is delivered, its line has one result.

Everything here is JSON, not the bus's msgpack: ``nats kv get`` and ``nats stream view``
read it, and the record is OpenAI's batch object (plus ``tenant``). The wire rules of
``schemas.messages`` hold: new fields get defaults and are appended, types never change,
decoders skip fields they do not know.
"""

from __future__ import annotations

import hashlib
from typing import Any, Literal

import msgspec

from switchyard.schemas.messages import _Wire

BATCHES_BUCKET = "switchyard_batches"  # batch id -> Batch
RESULTS_BUCKET = "switchyard_batch_results"  # result_key(batch, custom_id) -> LineResult
WORK_STREAM = "SWITCHYARD_BATCH_WORK"  # work queue of WorkItem, subjects.every_batch_work()

Endpoint = Literal["/v1/chat/completions", "/v1/completions"]
ENDPOINTS: tuple[str, ...] = ("/v1/chat/completions", "/v1/completions")
BatchStatus = Literal[
    "validating", "failed", "in_progress", "finalizing", "completed", "expired", "cancelling", "cancelled"
]
TERMINAL: frozenset[str] = frozenset({"failed", "completed", "expired", "cancelled"})
COMPLETION_WINDOWS = {"24h": 24 * 3600}
RUNNER_QUEUE = "batch-runner"  # the runners' queue group on subjects.BATCH_SUBMIT
BATCH_PRIORITY = 1  # the scheduler's queue: interactive 0 first, then batch


class BatchError(_Wire, frozen=True):
    """One reason a batch failed validation (OpenAI's ``errors.data[]``)."""

    code: str
    message: str
    param: str | None = None
    line: int | None = None  # 1-based line of the input file


class BatchErrors(_Wire, frozen=True):
    object: str = "list"
    data: list[BatchError] = msgspec.field(default_factory=list)


class RequestCounts(_Wire, frozen=True):
    total: int = 0
    completed: int = 0
    failed: int = 0

    @property
    def done(self) -> int:
        return self.completed + self.failed


class Batch(_Wire, frozen=True):
    """OpenAI's batch object, as stored; ``tenant`` is ours and never shown to a client."""

    id: str  # batch_<hex>
    endpoint: str
    input_file_id: str | None  # None: submitted on the bus (JobSubmit)
    completion_window: str
    status: BatchStatus
    created_at: int
    expires_at: int
    tenant: str
    object: str = "batch"
    errors: BatchErrors | None = None
    output_file_id: str | None = None
    error_file_id: str | None = None
    in_progress_at: int | None = None
    finalizing_at: int | None = None
    completed_at: int | None = None
    failed_at: int | None = None
    expired_at: int | None = None
    cancelling_at: int | None = None
    cancelled_at: int | None = None
    request_counts: RequestCounts = RequestCounts()
    metadata: dict[str, str] | None = None
    model: str | None = None

    @property
    def terminal(self) -> bool:
        return self.status in TERMINAL

    def public(self) -> dict[str, Any]:
        """The object a client sees: everything but the tenant."""
        body: dict[str, Any] = msgspec.to_builtins(self)
        body.pop("tenant")
        return body


class WorkItem(_Wire, frozen=True):
    """One line of a batch, to execute: what a runner POSTs to the ingress."""

    batch_id: str
    custom_id: str
    line: int  # 1-based line of the input (or index + 1 in a JobSubmit)
    body: str  # the request body, JSON text
    endpoint: str
    tenant: str
    priority: int = BATCH_PRIORITY


class LineError(_Wire, frozen=True):
    """Why a line has no response: ``batch_expired``, ``batch_cancelled``, ``max_deliveries``..."""

    code: str
    message: str


class LineResult(_Wire, frozen=True):
    """The one result of one line: a response (any status), or an error without one.

    ``body`` is the response body as JSON text; a line is *completed* when its status is 200,
    else *failed* (OpenAI's error file holds it)."""

    batch_id: str
    custom_id: str
    line: int
    status_code: int | None = None
    body: str | None = None
    request_id: str | None = None
    error: LineError | None = None

    @property
    def ok(self) -> bool:
        return self.status_code == 200 and self.error is None


# --- the bus-native path: request/reply on subjects.BATCH_SUBMIT -----------------------------


class Job(_Wire, frozen=True):
    custom_id: str  # the job's id: its result is result_key(batch_id, custom_id)
    body: dict[str, Any]  # the request body, as the endpoint takes it


class JobSubmit(_Wire, frozen=True):
    """One job or many, as one batch: validated as an input file's lines are."""

    endpoint: str
    jobs: list[Job]
    tenant: str = "default"
    completion_window: str = "24h"
    metadata: dict[str, str] | None = None


class JobAccepted(_Wire, frozen=True, tag="accepted"):
    batch: Batch  # in_progress; its results appear under result_key(batch.id, custom_id)


class JobRejected(_Wire, frozen=True, tag="rejected"):
    errors: list[BatchError]


JobReply = JobAccepted | JobRejected


def result_key(batch_id: str, custom_id: str) -> str:
    """The KV key of a line's result: a custom id is any text, a KV key is not."""
    return f"{batch_id}.{hashlib.blake2b(custom_id.encode(), digest_size=16).hexdigest()}"


def results_of(batch_id: str) -> str:
    """Every result key of one batch (a KV filter)."""
    return f"{batch_id}.*"


_ENCODER = msgspec.json.Encoder()
BATCH = msgspec.json.Decoder(Batch)
WORK_ITEM = msgspec.json.Decoder(WorkItem)
LINE_RESULT = msgspec.json.Decoder(LineResult)
JOB_SUBMIT = msgspec.json.Decoder(JobSubmit)
JOB_REPLY: msgspec.json.Decoder[JobReply] = msgspec.json.Decoder(JobReply)


def encode(message: msgspec.Struct) -> bytes:
    return _ENCODER.encode(message)


__all__ = [
    "BATCH",
    "BATCHES_BUCKET",
    "BATCH_PRIORITY",
    "COMPLETION_WINDOWS",
    "ENDPOINTS",
    "JOB_REPLY",
    "JOB_SUBMIT",
    "LINE_RESULT",
    "RESULTS_BUCKET",
    "RUNNER_QUEUE",
    "TERMINAL",
    "WORK_ITEM",
    "WORK_STREAM",
    "Batch",
    "BatchError",
    "BatchErrors",
    "BatchStatus",
    "Endpoint",
    "Job",
    "JobAccepted",
    "JobRejected",
    "JobReply",
    "LineError",
    "LineResult",
    "RequestCounts",
    "WorkItem",
    "encode",
    "result_key",
    "results_of",
]
