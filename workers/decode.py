"""The decode role: continuous batching, one bus message per step per ingress.

Each engine step yields a token for every running sequence; the tokens are grouped
by the ingress that owns each request and sent as one ``StreamBatch`` per ingress,
which is what keeps the bus at hundreds of thousands of tokens per second instead of
tens of thousands with one message per token.

An engine that steps faster than ``min_publish_interval_s`` (1 ms by default; real
decode steps take 10-50 ms) shares one message among several steps, each request's
new tokens in one chunk: the bus and the ingress then see at most about a thousand
messages a second per ingress, however fast the engine. A finished sequence, and the
last step before the engine idles, are always sent at once.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

import anyio
from opentelemetry.trace import Span

from observability import tracing
from schemas import DecodeTask, FinishReason, RequestFinished, StreamChunk, WorkerTask
from workers.engine import DecodeEngine, StepOutput
from workers.runtime import WorkerBus

log = logging.getLogger(__name__)


@dataclass(slots=True)
class _Stream:
    ingress_id: str
    span: Span
    generated: int = 1  # token 0 came from prefill
    pending: list[int] = field(default_factory=list)  # stepped, not yet sent
    pending_seq: int = 0  # output position of pending[0]
    finished: FinishReason | None = None


class DecodeRole:
    def __init__(self, engine: DecodeEngine, worker_id: str, token_budget: int,
                 min_publish_interval_s: float = 0.001) -> None:
        self.engine = engine
        self.worker_id = worker_id
        self.token_budget = token_budget
        self.min_publish_interval_s = min_publish_interval_s
        self._streams: dict[str, _Stream] = {}
        self._unsent: dict[str, _Stream] = {}  # streams with pending tokens, in step order
        self._last_publish = 0.0
        self._wake = anyio.Event()

    def inflight_tokens(self) -> int:
        return self.engine.held_tokens

    def running(self) -> int:
        return self.engine.running

    def offer(self, task: WorkerTask, headers: dict[str, str]) -> str | None:
        if not isinstance(task, DecodeTask):
            return f"a decode worker takes no {type(task).__name__}"
        need = len(task.spec.prompt_tokens) + task.spec.sampling.max_tokens
        if self.engine.running and self.engine.held_tokens + need > self.token_budget:
            return "no KV capacity"
        span = tracing.tracer().start_span("worker.decode", context=tracing.extract(headers))
        span.set_attribute("switchyard.worker_id", self.worker_id)
        self.engine.add(task)
        self._streams[task.spec.request_id] = _Stream(task.spec.ingress_id, span)
        self._wake.set()
        return None

    def cancel(self, request_id: str) -> None:
        if self.engine.abort(request_id):
            stream = self._streams.pop(request_id)
            stream.span.set_attribute("switchyard.cancelled", True)
            stream.span.end()

    async def serve(self, bus: WorkerBus) -> None:
        while True:
            if not self.engine.running:
                self._wake = anyio.Event()
                await self._wake.wait()
            finished = self._absorb(await self.engine.step())
            now = time.monotonic()
            if finished or not self.engine.running or now - self._last_publish >= self.min_publish_interval_s:
                self._last_publish = now
                await self._publish(bus)

    def _absorb(self, outputs: list[StepOutput]) -> bool:
        """Queue each output token on its stream; True when a sequence finished."""
        finished = False
        for out in outputs:
            stream = self._streams.get(out.request_id)
            if stream is None:
                continue  # cancelled during the step
            if not stream.pending:
                stream.pending_seq = out.position
                self._unsent[out.request_id] = stream
            stream.pending.append(out.token)
            stream.generated += 1
            if out.finished is not None:
                stream.finished = out.finished
                finished = True
        return finished

    async def _publish(self, bus: WorkerBus) -> None:
        by_ingress: dict[str, list[StreamChunk]] = {}
        done: list[RequestFinished] = []
        for rid, stream in self._unsent.items():
            if self._streams.get(rid) is not stream:
                continue  # cancelled since it stepped
            by_ingress.setdefault(stream.ingress_id, []).append(StreamChunk(
                request_id=rid, seq=stream.pending_seq, token_ids=stream.pending,
                finish_reason=stream.finished))
            stream.pending = []
            if stream.finished is not None:
                del self._streams[rid]
                stream.span.set_attribute("switchyard.generated_tokens", stream.generated)
                stream.span.end()
                done.append(RequestFinished(worker_id=self.worker_id, request_id=rid,
                                            generated_tokens=stream.generated, reason=stream.finished))
        self._unsent = {}
        for ingress_id, chunks in by_ingress.items():
            await bus.stream(ingress_id, chunks)
        for event in done:
            await bus.event(event)
