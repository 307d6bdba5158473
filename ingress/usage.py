"""Usage records: one per finished generation, published to JetStream for billing.

``UsageRecorder.on_finished`` is the ``Ingress``'s hook (``GenerationContext.on_finished``):
it builds the request's ``UsageRecord`` and puts it into a bounded buffer without waiting,
so a record never slows or fails a response. ``run``, a task of the ingress's task group,
publishes each buffered record to the stream ``schemas.usage.STREAM`` and waits for
JetStream's ack; the header ``Nats-Msg-Id`` (the request id) makes JetStream store a record
retried within its duplicate window once.

Delivery is at least once while the ingress runs: a record whose publish failed (no
JetStream, no stream, a timeout, the connection down) is retried, with backoff, until it is
acked; the records behind it wait in the buffer. A full buffer drops new records, and so
does an ingress stopping with records unpublished (it tries them for ``_DRAIN_S`` first):
both are counted (``switchyard_usage_records_dropped``) and logged.

The stream is created when a publish finds none (and once at start), with the limits of
``UsageConfig``. One that exists keeps its own configuration: the ingress may create it, not
change it (``schemas.permissions``), so an operator's retention is never undone.
"""

from __future__ import annotations

import logging
import math
import time

import anyio
from anyio.abc import TaskStatus
from nats.aio.client import Client
from nats.js import JetStreamContext
from nats.js.api import DiscardPolicy, StorageType, StreamConfig
from nats.js.errors import BadRequestError, NoStreamResponseError

from switchyard.ingress.config import IngressConfig, UsageConfig
from switchyard.ingress.generation import Generation
from switchyard.observability import ServingMetrics
from switchyard.schemas import UsageRecord, subjects, usage

log = logging.getLogger(__name__)

_PUBLISH_TIMEOUT_S = 5.0
_BACKOFF_S = (0.05, 5.0)  # first and longest wait between attempts at one record
_DRAIN_S = 2.0  # at shutdown, how long the buffered records are still tried
_CONFIG_IN_USE = 10058  # JetStream: "stream name already in use with a different configuration"


def usage_record(generation: Generation, outcome: str, *, ingress_id: str, region: str) -> UsageRecord:
    """The record of a generation that has just ended: its ``usage`` as its response said it.

    The generation's clock is monotonic; the record's times are wall clock, read back from now."""
    g = generation
    wall, mono = time.time(), time.monotonic()
    spent = g.usage()
    return UsageRecord(
        request_id=g.spec.request_id,
        tenant=g.spec.tenant,
        model=g.model,
        kind=g.kind,
        outcome=_outcome(outcome),
        prompt_tokens=spent["prompt_tokens"],
        cached_tokens=spent["prompt_tokens_details"]["cached_tokens"],
        completion_tokens=spent["completion_tokens"],
        arrived_unix=wall - (mono - g.arrived),
        finished_unix=wall,
        first_token_unix=None if g.first_token_at is None else wall - (mono - g.first_token_at),
        region=region or None,
        ingress_id=ingress_id,
        session_affinity=g.spec.session is not None,
        migrations=g.migrations,
    )


def _outcome(outcome: str) -> usage.Outcome:
    match outcome:
        case "ok":
            return "ok"
        case "cancelled":
            return "cancelled"
    return "error"  # the hook's only other outcome; anything unsettled counts as one


def stream_config(config: UsageConfig) -> StreamConfig:
    return StreamConfig(
        name=usage.STREAM,
        subjects=[subjects.every_usage()],
        storage=StorageType.FILE,
        discard=DiscardPolicy.OLD,  # at a limit the oldest records go, never a new one
        max_age=config.max_age_s,
        max_bytes=config.max_bytes,
        duplicate_window=config.duplicate_window_s,
    )


class UsageRecorder:
    """The ingress's usage records: buffered by ``on_finished``, published by ``run``."""

    def __init__(self, nc: Client, config: IngressConfig, metrics: ServingMetrics) -> None:
        self._nc = nc
        self._config = config
        self._metrics = metrics
        self._send, self._receive = anyio.create_memory_object_stream[UsageRecord](config.usage.buffer)
        self._in_hand: UsageRecord | None = None  # taken from the buffer, not yet acked
        self._stream_ready = False
        self._failing = False  # the last attempt failed: said once, until one succeeds
        self._stopped = False  # run() has ended: what it had not published is dropped
        self.published = 0  # records JetStream stored (not counting duplicates it recognised)
        self.dropped = 0

    @property
    def enabled(self) -> bool:
        return self._config.usage.records

    @property
    def stalled(self) -> bool:
        """The last attempt to publish failed (JetStream unreachable): records are held."""
        return self._failing

    def on_finished(self, generation: Generation, outcome: str) -> None:
        """``Ingress``'s hook: count the request, buffer its record. Never blocks or raises."""
        m = self._metrics
        m.tenant_requests.labels(m.tenant_label(generation.spec.tenant), _outcome(outcome)).inc()  # both bounded
        if not self.enabled:
            return
        try:
            record = usage_record(generation, outcome, ingress_id=self._config.ingress_id, region=self._config.region)
        except Exception:  # a bug here must not fail the response; the record is lost, counted
            log.exception("usage record of %s", generation.spec.request_id)
            self._drop(1, "it could not be built")
            return
        self.add(record)

    def add(self, record: UsageRecord) -> None:
        """Buffer one record for ``run`` to publish; a full buffer drops it (counted)."""
        try:
            self._send.send_nowait(record)
        except anyio.WouldBlock:
            self._drop(1, "the buffer is full (JetStream unreachable?)")
        except (anyio.ClosedResourceError, anyio.BrokenResourceError):
            self._drop(1, "the recorder has stopped")
        self._update_pending()

    async def run(self, *, task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        """Publish buffered records until cancelled; then try what is left, briefly."""
        task_status.started()
        if not self.enabled:
            return
        js = self._nc.jetstream(timeout=_PUBLISH_TIMEOUT_S)
        try:
            self._stream_ready = await self._ensure_stream(js)
            async for record in self._receive:
                self._in_hand = record
                self._update_pending()
                await self._deliver(js, record)
                self._in_hand = None
        finally:
            with anyio.move_on_after(_DRAIN_S, shield=True):
                await self._drain(js)
            self._send.close()
            left = (self._in_hand is not None) + self._receive.statistics().current_buffer_used
            self._receive.close()
            self._stopped = True
            if left:
                self._drop(left, "the ingress stopped before JetStream took them")
            self._update_pending()

    # --- delivery ---------------------------------------------------------------------------

    async def _deliver(self, js: JetStreamContext, record: UsageRecord) -> None:
        """Publish one record until JetStream acks it (cancellable)."""
        wait = _BACKOFF_S[0]
        while not await self._publish_once(js, record):
            await anyio.sleep(wait)
            wait = min(wait * 2, _BACKOFF_S[1])

    async def _publish_once(self, js: JetStreamContext, record: UsageRecord) -> bool:
        try:
            if not self._stream_ready:
                self._stream_ready = await self._ensure_stream(js)
            ack = await js.publish(
                subjects.usage(record.tenant),
                usage.encode(record),
                stream=usage.STREAM,
                headers={"Nats-Msg-Id": record.request_id},
            )
        except NoStreamResponseError:  # no stream takes the subject: no JetStream, or it was deleted
            self._stream_ready = False
            self._failed("no JetStream stream answers")
            return False
        except Exception as exc:  # a timeout, the connection down, an API error: tried again
            self._failed(repr(exc))
            return False
        self._stream_ready = True  # whoever made it (an operator may have, without our right to)
        if self._failing:
            self._failing = False
            log.info("usage records are published again (%d waiting)", self._receive.statistics().current_buffer_used)
        if not ack.duplicate:
            self.published += 1
            self._metrics.usage_published.inc()
        return True

    async def _drain(self, js: JetStreamContext) -> None:
        """At shutdown, one try each for the record in hand and the buffered ones; the first
        that fails stops it (JetStream is not there)."""
        while True:
            if self._in_hand is None:
                try:
                    self._in_hand = self._receive.receive_nowait()
                except (anyio.WouldBlock, anyio.EndOfStream, anyio.ClosedResourceError):
                    return
            if not await self._publish_once(js, self._in_hand):
                return
            self._in_hand = None

    async def _ensure_stream(self, js: JetStreamContext) -> bool:
        """Create the stream (the same config again is a no-op); False if JetStream is not there."""
        try:
            await js.add_stream(stream_config(self._config.usage))
        except BadRequestError as exc:
            if exc.err_code != _CONFIG_IN_USE:
                self._failed(f"cannot create the stream {usage.STREAM}: {exc}")
                return False
            log.info("usage stream %s exists with its own configuration; it is kept", usage.STREAM)
        except Exception as exc:  # no JetStream on this server (yet), or no right to create it
            self._failed(f"cannot create the stream {usage.STREAM}: {exc!r}")
            return False
        return True

    # --- accounting -------------------------------------------------------------------------

    def _failed(self, why: str) -> None:
        if not self._failing:
            self._failing = True
            log.warning("usage records wait: %s; retrying (up to %d held)", why, self._config.usage.buffer)

    def _drop(self, count: int, why: str) -> None:
        before, self.dropped = self.dropped, self.dropped + count
        self._metrics.usage_dropped.inc(count)
        if _worth_saying(before, self.dropped):
            log.warning("usage records dropped: %s (%d so far)", why, self.dropped)

    def _update_pending(self) -> None:
        pending = 0 if self._stopped else self._receive.statistics().current_buffer_used
        self._metrics.usage_pending.set(pending)


def _worth_saying(before: int, after: int) -> bool:
    """Log the 1st, 10th, 100th, ... drop: a full buffer drops at the request rate."""
    return math.floor(math.log10(after)) > (math.floor(math.log10(before)) if before else -1)
