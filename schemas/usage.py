"""One usage record per finished generation, for billing: what a tenant was served.

The ingress publishes each record to JetStream (stream ``STREAM``, subject
``subjects.usage(tenant)``) with the request id as ``Nats-Msg-Id``, so a record retried
within the stream's duplicate window is stored once; a consumer reads the stream at least
once and deduplicates by ``request_id`` (a retry after the window is stored twice).

Records are JSON, not the bus's msgpack: the stream is where a billing system, in any
language, or ``nats stream view``, reads them. They follow the wire rules of
``schemas.messages``: new fields get defaults and are appended, types never change, and
a decoder skips fields it does not know.
"""

from __future__ import annotations

from typing import Literal

import msgspec

from switchyard.schemas.messages import _Wire

STREAM = "SWITCHYARD_USAGE"  # its subjects: subjects.every_usage()

Outcome = Literal["ok", "error", "cancelled"]  # cancelled: the client went away first


class UsageRecord(_Wire, frozen=True):
    """What one finished generation cost: its tokens, as its response's ``usage`` said.

    ``cached_tokens`` of ``prompt_tokens`` came from a KV cache (billed at a discount):
    sending ``x-session-affinity`` keeps a conversation on the worker that holds its prefix.
    Times are Unix seconds, wall clock, on the ingress."""

    request_id: str  # the response's id; unique per request, the deduplication key
    tenant: str
    model: str
    kind: Literal["chat", "completion"]
    outcome: Outcome
    prompt_tokens: int
    cached_tokens: int  # of prompt_tokens
    completion_tokens: int
    arrived_unix: float  # the request reached the ingress
    finished_unix: float  # its response ended
    first_token_unix: float | None = None  # none: it ended before a first token
    region: str | None = None  # the ingress's --region, when one is set
    ingress_id: str = ""
    session_affinity: bool = False  # the client sent x-session-affinity
    migrations: int = 0  # times it continued on another worker after losing one


_ENCODER = msgspec.json.Encoder()
_DECODER = msgspec.json.Decoder(UsageRecord)


def encode(record: UsageRecord) -> bytes:
    return _ENCODER.encode(record)


def decode(data: bytes) -> UsageRecord:
    return _DECODER.decode(data)


__all__ = ["STREAM", "Outcome", "UsageRecord", "decode", "encode"]
