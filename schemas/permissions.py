"""Who may say what on the bus: each role's NATS rights, as subjects.

The subject table of docs/architecture.md, turned around: per role, what it may publish
and subscribe to. A NATS server enforces it once it is written into the server's
authorization block (``switchyard.nats_auth``), so that a process holding one role's
credentials cannot act as another:

- an ingress submits and cancels, and hears only token streams and its own replies: it
  cannot publish a task, nor inject tokens into a stream;
- a worker reports (events, KV events, tokens) and hears only its own tasks and
  snapshot requests: it cannot publish a task, read another worker's, or forge a Cancel;
  it publishes tokens only under its own id, so it cannot pass as another worker;
- the scheduler dispatches and keeps its JetStream buckets (sessions, its lease);
- an ingress also writes usage records to JetStream: it may create the usage stream and
  publish records, never change, purge or delete the stream nor read it (billing's data);
- an ingress keeps the Files API's two buckets (``file_store``): it may create them, write,
  read, list and purge objects in them, never update or delete the buckets themselves, and
  no other stream or bucket;
- batches (``batch_ingress``, ``batch_runner``): an ingress creates, reads and moves batch
  records and puts lines on the work queue; a batch runner pulls and acks lines through
  per-batch consumers, writes and reads results and output files, asks the scheduler's
  status and answers bus-native submits; neither may delete or purge those streams, nor
  touch another role's subjects.

Replies travel by NATS's ``allow_responses``: a role that answers requests may publish
once to the reply subject of each request it received, and nowhere else in ``_INBOX``.
A role that makes requests hears its replies under its own inbox prefix, so an ingress
cannot read the scheduler's replies (session bindings) or a worker's. The scheduler
hears all of ``_INBOX``: its ack inbox is named by its id (``_INBOX.<scheduler id>``).

Worker rights name the worker's id, so every worker is its own NATS user.
"""

from __future__ import annotations

from typing import Literal

import msgspec

from switchyard.schemas import batch, files, subjects, usage

Role = Literal["scheduler", "worker", "ingress", "batch-runner", "admin"]

DEFAULT_INBOX = "_INBOX"
INGRESS_INBOX = f"{DEFAULT_INBOX}.ingress"  # where an ingress hears the scheduler's answers
BATCH_RUNNER_INBOX = f"{DEFAULT_INBOX}.batch-runner"  # where a batch runner hears its answers


class Permissions(msgspec.Struct, frozen=True, kw_only=True):
    publish: tuple[str, ...]
    subscribe: tuple[str, ...]
    responses: bool = False  # may answer each request it received, once (NATS allow_responses)
    inbox_prefix: str = DEFAULT_INBOX  # where its own requests' replies arrive


def scheduler() -> Permissions:
    return Permissions(
        publish=(
            subjects.worker_tasks("*"),
            subjects.kv_snapshot("*"),
            subjects.ROLL_CALL,
            subjects.CANCEL,  # a run a worker still holds after it ended here (scheduler.audit)
            subjects.stream("*", subjects.SCHEDULER_SENDER),  # assignments, a request's error chunk
            subjects.stream("*.*", subjects.SCHEDULER_SENDER),  # the same to an ingress in a region
            subjects.fed_summary("*"),  # federation: the region's summary
            # Answers to submits, also late ones: a standby answers what it held once it takes
            # over, maybe on a new connection, where allow_responses no longer covers them.
            f"{INGRESS_INBOX}.>",
            # JetStream is the scheduler's alone: its KV buckets (sessions, the active
            # scheduler's lease) created, written, read and watched.
            "$JS.API.>",
            "$KV.>",
        ),
        subscribe=(
            subjects.SUBMIT,
            subjects.WORKER_EVENTS,
            subjects.CANCEL,
            subjects.KV_EVENTS,
            subjects.FED_PING,
            f"{DEFAULT_INBOX}.>",
        ),
        responses=True,  # Admitted / Rejected / ClusterStatus, pings
    )


def worker(worker_id: str) -> Permissions:
    return Permissions(
        # Tokens only under its own id: the ingress knows who sent them (subjects.stream).
        publish=(
            subjects.WORKER_EVENTS,
            subjects.KV_EVENTS,
            subjects.stream("*", worker_id),
            subjects.stream("*.*", worker_id),  # to an ingress in a region (its id is <region>.<id>)
        ),
        subscribe=(
            subjects.worker_tasks(worker_id),
            subjects.kv_snapshot(worker_id),
            subjects.CANCEL,
            subjects.ROLL_CALL,
        ),
        responses=True,  # TaskAck, KvSnapshot
    )


def ingress() -> Permissions:
    return Permissions(
        # Usage records: the stream is created if missing (the same config again is a no-op;
        # another is refused, not applied), and each record's JetStream ack comes back on the
        # ingress's inbox.
        publish=(
            subjects.SUBMIT,
            subjects.CANCEL,
            subjects.every_usage(),
            f"$JS.API.STREAM.CREATE.{usage.STREAM}",
            *file_store(),
            *batch_ingress(),
            *federated_ingress(),
        ),
        # Roll calls: a new scheduler may not know what the last one had queued (streams).
        subscribe=(
            subjects.stream("*", "*"),
            subjects.stream("*.*", "*"),
            subjects.ROLL_CALL,
            subjects.every_fed_summary(),
            subjects.every_fed_session(),  # without JetStream, placements as they are made
            f"{INGRESS_INBOX}.>",
        ),
        inbox_prefix=INGRESS_INBOX,
    )


def federated_ingress() -> tuple[str, ...]:
    """An ingress in a region (``ingress.federation``): the other regions' services, its
    session placements, and the session directory stream read through an ordered consumer."""
    directory = subjects.SESSION_DIRECTORY_STREAM
    return (
        *(subjects.to_region("*", service) for service in subjects.FED_SERVICES),
        subjects.fed_session("*", "*"),
        *_stream_api(directory, "STREAM.CREATE", "STREAM.INFO", "CONSUMER.CREATE", "CONSUMER.INFO", "CONSUMER.DELETE"),
        f"$JS.FC.{directory}.>",
    )


# --- the Files API's buckets (schemas.files) ------------------------------------------------------


def file_store() -> tuple[str, ...]:
    """What ``ingress.files.FileStore`` publishes: the JetStream API of its two buckets' streams
    (create, look up, read a message, purge an object's chunks, ordered consumers to read and
    list, their flow control) and the buckets' own subjects. Not STREAM.UPDATE, nor DELETE:
    a bucket that exists keeps its configuration and its files. Replies come back to the
    user's inbox, which it subscribes to already."""
    rights: list[str] = []
    for stream in (files.OBJECT_STREAM, files.METADATA_STREAM):
        api = f"$JS.API.{{}}.{stream}"
        rights += [
            api.format("STREAM.CREATE"),
            api.format("STREAM.INFO"),
            api.format("STREAM.MSG.GET"),
            api.format("DIRECT.GET"),
            api.format("DIRECT.GET") + ".>",
            api.format("CONSUMER.CREATE"),
            api.format("CONSUMER.CREATE") + ".>",
            api.format("CONSUMER.INFO") + ".*",
            api.format("CONSUMER.DELETE") + ".*",
            f"$JS.FC.{stream}.>",
        ]
    rights.append(f"$JS.API.STREAM.PURGE.{files.OBJECT_STREAM}")  # an object's chunks, by subject
    return (*rights, f"$O.{files.OBJECT_BUCKET}.>", f"$KV.{files.METADATA_BUCKET}.>")


# --- batches (schemas.batch) ---------------------------------------------------------------------


def _stream_api(stream: str, *operations: str) -> list[str]:
    """The JetStream API subjects of ``operations`` on one stream (and what follows its name:
    a consumer's name and filter, a direct get's subject)."""
    return [f"$JS.API.{op}.{stream}{tail}" for op in operations for tail in ("", ".>")]


_KV_READ = ("STREAM.INFO", "STREAM.MSG.GET", "DIRECT.GET", "CONSUMER.CREATE", "CONSUMER.INFO", "CONSUMER.DELETE")


def _bucket(name: str) -> list[str]:
    """A KV bucket created, opened, read, listed (an ordered consumer) and written."""
    stream = f"KV_{name}"
    return [*_stream_api(stream, "STREAM.CREATE", *_KV_READ), f"$JS.FC.{stream}.>", f"$KV.{name}.>"]


def batch_ingress() -> tuple[str, ...]:
    """The Batch API's rights at the ingress: batch records created, read, listed and moved
    (compare-and-set), lines put on the work queue, the results bucket only created (it is
    the runners' to write and read). Not STREAM.UPDATE, PURGE nor DELETE anywhere."""
    results = f"KV_{batch.RESULTS_BUCKET}"
    return (
        *_bucket(batch.BATCHES_BUCKET),
        f"$JS.API.STREAM.CREATE.{results}",
        f"$JS.API.STREAM.INFO.{results}",
        f"$JS.API.STREAM.CREATE.{batch.WORK_STREAM}",
        f"$JS.API.STREAM.INFO.{batch.WORK_STREAM}",
        subjects.every_batch_work(),
    )


def batch_runner() -> Permissions:
    """A batch runner: the scheduler's status (headroom), the batch records and results, the
    work queue through its per-batch durable consumers (created, pulled, acked, deleted once
    a batch ends; a line out of deliveries read and removed), the output files, and the
    bus-native submits it answers."""
    work = batch.WORK_STREAM
    return Permissions(
        publish=(
            subjects.SUBMIT,  # StatusRequest only: a runner submits nothing itself
            *_bucket(batch.BATCHES_BUCKET),
            *_bucket(batch.RESULTS_BUCKET),
            *_stream_api(work, "STREAM.CREATE", "STREAM.INFO", "STREAM.MSG.GET", "STREAM.MSG.DELETE"),
            *_stream_api(work, "CONSUMER.CREATE", "CONSUMER.DURABLE.CREATE", "CONSUMER.INFO", "CONSUMER.DELETE"),
            *_stream_api(work, "CONSUMER.MSG.NEXT"),
            f"$JS.ACK.{work}.>",
            subjects.every_batch_work(),  # a JobSubmit's lines
            *file_store(),
        ),
        subscribe=(subjects.BATCH_SUBMIT, subjects.batch_max_deliveries(work), f"{BATCH_RUNNER_INBOX}.>"),
        responses=True,  # JobReply
        inbox_prefix=BATCH_RUNNER_INBOX,
    )


def admin() -> Permissions:
    """An operator's (and the tests'): everything."""
    return Permissions(publish=(">",), subscribe=(">",))
