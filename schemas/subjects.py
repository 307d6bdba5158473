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


def stream(ingress_id: str) -> str:
    """workers/scheduler -> one ingress, publish: StreamBatch (tokens of all its streams)."""
    return f"{ROOT}.stream.{ingress_id}"
