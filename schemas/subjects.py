"""NATS subject names, all in one place, all carrying the wire version.

A breaking change to any message on a subject is a new ``WIRE_VERSION``; old and
new deployments then simply do not hear each other instead of misreading bytes.
"""

from __future__ import annotations

WIRE_VERSION = "v1"
ROOT = f"sy.{WIRE_VERSION}"

# ingress -> scheduler, request/reply: SubmitRequest -> SubmitReply
SUBMIT = f"{ROOT}.sched.submit"
# any -> scheduler and every worker, publish: Cancel (a client went away)
CANCEL = f"{ROOT}.cancel"
# workers -> scheduler, publish: WorkerEvent (LoadReport, PrefillDone, RequestFinished, WorkerLeaving)
WORKER_EVENTS = f"{ROOT}.sched.events"
# scheduler -> workers, publish: a request for every worker to report at once (scheduler start)
ROLL_CALL = f"{ROOT}.sched.rollcall"
# workers -> scheduler(s), publish: KvEventBatch (what each worker's KV cache holds)
KV_EVENTS = f"{ROOT}.kv.events"
# queue group of the scheduler subscribers; one scheduler answers each submit
SCHEDULER_QUEUE = "scheduler"


def worker_tasks(worker_id: str) -> str:
    """scheduler -> one worker, request/reply: WorkerTask -> TaskAck."""
    return f"{ROOT}.worker.{worker_id}.tasks"


def kv_snapshot(worker_id: str) -> str:
    """scheduler -> one worker, request/reply: KvSnapshotRequest -> KvSnapshot."""
    return f"{ROOT}.worker.{worker_id}.kvsnapshot"


# The sender token of the scheduler's stream messages (every replica: one role)
SCHEDULER_SENDER = "scheduler"


def stream(ingress_id: str, sender: str) -> str:
    """workers/scheduler -> one ingress, publish: StreamBatch (tokens of all its streams).

    The last token names the sender (a worker's id, or ``SCHEDULER_SENDER``). The NATS
    permissions let each worker publish only under its own id, so the subject says who
    sent a chunk and the ingress accepts a request's chunks only from the workers the
    scheduler assigned to it."""
    return f"{ROOT}.stream.{ingress_id}.{sender}"


def streams_of(ingress_id: str) -> str:
    """What one ingress subscribes to: the streams every sender publishes to it."""
    return stream(ingress_id, "*")


def stream_sender(subject: str) -> str:
    """The sender token of a ``stream`` subject."""
    return subject.rpartition(".")[2]


def usage(tenant: str) -> str:
    """ingress -> JetStream (``schemas.usage.STREAM``), publish with ``Nats-Msg-Id`` = the
    request id: ``UsageRecord`` (JSON), one per finished generation. One subject per tenant,
    so a consumer may filter by tenant. A tenant may hold dots (``[A-Za-z0-9._-]``), which
    would split the token: they are written ``~``, which no tenant holds."""
    return f"{ROOT}.usage.{tenant.replace('.', '~')}"


def every_usage() -> str:
    """Every tenant's usage subject: what the usage stream holds."""
    return f"{ROOT}.usage.>"


# --- batch jobs (schemas.batch) ---------------------------------------------------------------

# producer -> batch runners, request/reply: JobSubmit (JSON) -> JobReply; one runner answers
# (queue group schemas.batch.RUNNER_QUEUE)
BATCH_SUBMIT = f"{ROOT}.batch.submit"


def batch_work(tenant: str, batch_id: str) -> str:
    """ingress/runner -> JetStream work queue ``schemas.batch.WORK_STREAM``: WorkItem (JSON),
    ``Nats-Msg-Id`` = batch id and line. A tenant's dots are written ``~`` (see ``usage``)."""
    return f"{ROOT}.batch.work.{tenant.replace('.', '~')}.{batch_id}"


def every_batch_work() -> str:
    """What the work-queue stream holds."""
    return f"{ROOT}.batch.work.>"


def batch_max_deliveries(stream: str, consumer: str = "*") -> str:
    """JetStream's advisory: a message of ``stream`` delivered ``max_deliver`` times, never acked."""
    return f"$JS.EVENT.ADVISORY.CONSUMER.MAX_DELIVERIES.{stream}.{consumer}"
