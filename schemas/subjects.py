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


# --- federation: regions joined as a NATS supercluster (docs/architecture.md, "Regions") ----
#
# Each region is its own NATS account: every subject above stays inside its region (KV
# events, tasks, worker events, JetStream). Only what follows crosses a gateway, by the
# accounts' exports and imports (``switchyard.nats_config`` writes them from this table):
# a region *exports* ``fed_root(region)`` (its summaries, its session bindings), its
# stream subjects, and the services ``SUBMIT``, ``CANCEL`` and ``FED_PING``; every other
# region *imports* them, the services under ``to_region(region, ...)``. A region's own
# subjects carry its name, so nothing imported is ever exported again (NATS refuses cycles).

# region -> every region, answered by its scheduler(s) (queue group FED_PING_QUEUE): an empty
# request whose reply measures the round trip to the region
FED_PING = f"{ROOT}.fed.ping"
FED_PING_QUEUE = "fed-ping"
# Each region's JetStream stream of every region's session placements (ingress.federation)
SESSION_DIRECTORY_STREAM = "SWITCHYARD_SESSION_DIRECTORY"


def fed_root(region: str) -> str:
    """Everything a region publishes for the others: ``sy.v1.fed.<region>.>``."""
    return f"{ROOT}.fed.{region}.>"


def fed_summary(region: str) -> str:
    """region's active scheduler -> every region, publish: RegionSummary, every
    ``summary_interval_s``."""
    return f"{ROOT}.fed.{region}.summary"


def every_fed_summary() -> str:
    return f"{ROOT}.fed.*.summary"


def fed_session(region: str, key: str) -> str:
    """an ingress of ``region`` -> every region's session directory, publish: SessionPlacement
    (``key``: BLAKE2b-128 hex of the tenant and session)."""
    return f"{ROOT}.fed.{region}.session.{key}"


def every_fed_session() -> str:
    """What each region's session directory stream holds: every region's bindings."""
    return f"{ROOT}.fed.*.session.*"


def to_region(region: str, service: str) -> str:
    """Another region's service as this region sees it (an account import): ``service`` is
    ``submit`` (``SUBMIT``), ``cancel`` (``CANCEL``) or ``ping`` (``FED_PING``)."""
    return f"{ROOT}.to.{region}.{service}"


# The services each region exports, by the name ``to_region`` gives them.
FED_SERVICES = {"submit": SUBMIT, "cancel": CANCEL, "ping": FED_PING}


def region_streams(region: str) -> str:
    """The streams of ``region``'s ingresses, whose ids are ``<region>.<id>``: what a region
    imports from every other (a worker there streams to an ingress here)."""
    return f"{ROOT}.stream.{region}.>"


def every_stream() -> str:
    """What a region exports of its stream subjects (the importer takes its own part)."""
    return f"{ROOT}.stream.>"
