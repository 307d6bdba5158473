"""The decode role: continuous batching, one bus message per step per ingress.

Each engine step yields a token for every running sequence; the tokens are grouped
by the ingress that owns each request and sent as one ``StreamBatch`` per ingress,
which is what keeps the bus at hundreds of thousands of tokens per second instead of
tens of thousands with one message per token.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import anyio
from opentelemetry.trace import Span

from observability import tracing
from schemas import DecodeTask, RequestFinished, StreamChunk, WorkerTask
from workers.engine import DecodeEngine, StepOutput
from workers.runtime import WorkerBus

log = logging.getLogger(__name__)


@dataclass(slots=True)
class _Stream:
    ingress_id: str
    span: Span
    generated: int = 1  # token 0 came from prefill


class DecodeRole:
    def __init__(self, engine: DecodeEngine, worker_id: str, token_budget: int) -> None:
        self.engine = engine
        self.worker_id = worker_id
        self.token_budget = token_budget
        self._streams: dict[str, _Stream] = {}
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
            outputs = await self.engine.step()
            await self._publish(bus, outputs)

    async def _publish(self, bus: WorkerBus, outputs: list[StepOutput]) -> None:
        by_ingress: dict[str, list[StreamChunk]] = {}
        finished: list[RequestFinished] = []
        for out in outputs:
            stream = self._streams.get(out.request_id)
            if stream is None:
                continue  # cancelled during the step
            stream.generated += 1
            by_ingress.setdefault(stream.ingress_id, []).append(StreamChunk(
                request_id=out.request_id, seq=out.position, token_ids=[out.token],
                finish_reason=out.finished))
            if out.finished is not None:
                del self._streams[out.request_id]
                stream.span.set_attribute("switchyard.generated_tokens", stream.generated)
                stream.span.end()
                finished.append(RequestFinished(worker_id=self.worker_id, request_id=out.request_id,
                                                generated_tokens=stream.generated, reason=out.finished))
        for ingress_id, chunks in by_ingress.items():
            await bus.stream(ingress_id, chunks)
        for event in finished:
            await bus.event(event)
