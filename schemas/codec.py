"""One typed msgpack decoder per subject; one shared encoder."""

from __future__ import annotations

from typing import Any, Generic, TypeVar

import msgspec

from switchyard.schemas import messages as m

T = TypeVar("T")

_ENCODER = msgspec.msgpack.Encoder()


class Codec(Generic[T]):
    """Encodes any wire Struct; decodes exactly the type (or tagged union) of its subject."""

    def __init__(self, type_: Any) -> None:  # Any: a tagged union is a value, not a ``type[T]``
        self._decoder: msgspec.msgpack.Decoder[T] = msgspec.msgpack.Decoder(type_)

    @staticmethod
    def encode(message: msgspec.Struct) -> bytes:
        return _ENCODER.encode(message)

    def decode(self, data: bytes) -> T:
        return self._decoder.decode(data)


SCHEDULER_REQUEST: Codec[m.SchedulerRequest] = Codec(m.SchedulerRequest)
SCHEDULER_REPLY: Codec[m.SchedulerReply] = Codec(m.SchedulerReply)
WORKER_TASK: Codec[m.WorkerTask] = Codec(m.WorkerTask)
TASK_ACK: Codec[m.TaskAck] = Codec(m.TaskAck)
WORKER_EVENT: Codec[m.WorkerEvent] = Codec(m.WorkerEvent)
ROLL_CALL: Codec[m.RollCall] = Codec(m.RollCall)
CANCEL: Codec[m.Cancel] = Codec(m.Cancel)
STREAM_BATCH: Codec[m.StreamBatch] = Codec(m.StreamBatch)
KV_EVENTS: Codec[m.KvEventBatch] = Codec(m.KvEventBatch)
KV_SNAPSHOT_REQUEST: Codec[m.KvSnapshotRequest] = Codec(m.KvSnapshotRequest)
KV_SNAPSHOT: Codec[m.KvSnapshot] = Codec(m.KvSnapshot)
REGION_SUMMARY: Codec[m.RegionSummary] = Codec(m.RegionSummary)
SESSION_PLACEMENT: Codec[m.SessionPlacement] = Codec(m.SessionPlacement)
