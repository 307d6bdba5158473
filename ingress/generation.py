"""One generation request after admission: tokens from the bus, text to the client.

``Generation`` is an ASGI response. It listens for the client going away while it
streams; on any ending that the workers did not cause (a disconnect, a stop string,
an error) it broadcasts a ``Cancel`` so that every worker drops the request. Cleanup
is shielded, so a cancelled request still cancels, counts and closes its span.

A stream whose worker is lost (``worker_lost``, in prefill or in decode), whose
scheduler was replaced before it knew the prompt (``scheduler_failover``), or whose
chunks were lost while the NATS connection was down (``stream_lost``) migrates. Its
run may still be alive (a worker taken for dead), so it is cancelled first, up to its
attempt only (``Cancel.attempt``); then the
ingress holds the prompt and every token it delivered, so it submits the request again
(same id, same route, no ``Cancel``, ``attempt`` counting up) with those tokens appended
to the prompt and ``resume_from`` set to their count; with none delivered yet, as it
was. The new run's first token is output position ``resume_from``, so the sequencer
takes it as the next token: a token 0 the client has is never sampled again, and greedy
output continues exactly where the client left off. The stream accepts chunks only from
the new run's workers (``StreamRouter.reassign``), so a late chunk of the lost run cannot
interleave. At most ``max_migrations`` times; after that, or when the scheduler refuses,
the request ends with the error it would have had.

A stream's response starts with its first delta, not at admission: until a token's text
is ready to go out, nothing has been promised, so a stream that fails before then (a shed
under overload, a migration refused, an unexpected error) is answered as a non-streaming
request is, with a JSON error and its own status (a shed's 429, which clients retry). Then
the role chunks go out ahead of that delta, as they always did. A stream that ends with no
text at all (an output of only EOS or a stop string) starts at its end: 200, role chunks,
finish chunks, ``[DONE]``. Once the response started, a failure is the stream's last
event, as the status is sent already. A migration before the first delta is invisible
to the client: its response has not started.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, Literal

import anyio
import msgspec
import nats.errors
from nats.aio.client import Client
from opentelemetry import trace
from opentelemetry.trace import Span, Status, StatusCode

from switchyard.ingress.errors import ApiError, Unavailable, generation_error, internal_error
from switchyard.ingress.logprobs import TokenText, chat_logprobs, completion_logprobs
from switchyard.ingress.reasoning import Piece, ThinkSplitter
from switchyard.ingress.streams import Inbox, StreamFailed, StreamRouter, TokenSequencer
from switchyard.ingress.text import TextAssembler
from switchyard.ingress.tool_calls import ToolPlan
from switchyard.ingress.tool_parsers import Event, StreamingParser, ToolCallDelta, collect
from switchyard.observability import ServingMetrics
from switchyard.schemas import Cancel, RequestSpec, StreamError, TokenLogprobs, codec, subjects

log = logging.getLogger(__name__)

Kind = Literal["chat", "completion"]
SSE_HEADERS = [
    (b"content-type", b"text/event-stream; charset=utf-8"),
    (b"cache-control", b"no-cache"),
    (b"x-accel-buffering", b"no"),
]
JSON_HEADERS = [(b"content-type", b"application/json")]
# Errors that end a run, not the request: it continues elsewhere (see the module's note).
_MIGRATABLE = frozenset({"worker_lost", "scheduler_failover", "stream_lost", "region_lost"})


@dataclass
class GenerationContext:
    """What a generation needs from its ingress."""

    nc: Client
    router: StreamRouter
    metrics: ServingMetrics
    # Migration: the spec that continues a request after its output so far, and its submit
    # (raises ``ApiError`` when the scheduler refuses it).
    continuation: Callable[[RequestSpec, list[int]], RequestSpec]
    resubmit: Callable[[RequestSpec, Any], Awaitable[None]]
    max_migrations: int = 2
    # While no worker of a role is left (its only one was lost), a migration is retried for
    # this long, so a supervisor's restart of it is waited for.
    migration_wait_s: float = 5.0
    # Told of every generation once it has ended, with its outcome (the usage records: see
    # ``ingress.usage``); it must not block or raise.
    on_finished: Callable[[Generation, str], None] | None = None
    # Where a request's cancels go: its region's scheduler and workers (ingress.federation).
    cancel_subject: Callable[[str], str] = lambda request_id: subjects.CANCEL
    # Told of every request id once its generation has ended (the federation forgets its region).
    on_closed: Callable[[str], None] | None = None


@dataclass
class Choice:
    """One of a request's ``n`` choices, as the ingress assembles it: its tokens in order, its
    text, its tool calls and logprobs. Choice 0 is the request's own (``Generation.sequencer``,
    ``assembler``, ``output``)."""

    index: int
    sequencer: TokenSequencer
    assembler: TextAssembler
    output: list[int] = field(default_factory=list)  # every token delivered, for a migration
    reader: StreamingParser | None = None  # its tool calls, when the request has tools
    splitter: ThinkSplitter | None = None  # its reasoning apart, with a reasoning parser
    logprobs_sent: int = 0  # entries of ``sequencer.logprobs`` delivered
    text_offset: int = 0  # completions' text_offset: the characters of tokens delivered
    called: bool = False  # a tool call was sent

    @property
    def done(self) -> bool:
        return self.sequencer.finished or self.assembler.stopped

    @property
    def finish_reason(self) -> str:
        reason = "stop" if self.assembler.stopped else (self.sequencer.finish_reason or "length")
        return "tool_calls" if self.called and reason == "stop" else reason


@dataclass
class Generation:
    ctx: GenerationContext
    kind: Kind
    spec: RequestSpec
    model: str
    stream: bool
    include_usage: bool
    assembler: TextAssembler
    inbox: Inbox
    span: Span
    arrived: float  # monotonic
    created: int = field(default_factory=lambda: int(time.time()))
    sequencer: TokenSequencer = field(default_factory=TokenSequencer)
    first_token_at: float | None = None
    # None until the ending is known: "ok", "error", or "cancelled" (the client left first).
    outcome: str | None = None
    response_started: bool = False  # http.response.start went out (a stream: with its first delta)
    output: list[int] = field(default_factory=list)  # every token delivered, for a migration
    migrations: int = 0
    recomputed_tokens: int = 0  # prefilled again by migrations, their cached prefix excluded
    _resumed_at: int | None = None  # the output position a migration's first token will have
    continuous_usage: bool = False  # stream_options.continuous_usage_stats: usage on every chunk
    tools: ToolPlan | None = None  # a chat request's tools: its text may hold calls
    token_text: TokenText | None = None  # set when the request asked for logprobs
    # The assembler of each further choice (``SamplingParams.n`` > 1).
    more_assemblers: Callable[[], TextAssembler] | None = None
    # With a reasoning parser (chat): whether the output starts inside a thought (its prompt
    # ends in one); None: no parser, thinking stays in the content (ingress.reasoning).
    thinking: bool | None = None
    include_reasoning: bool = True  # false: the reasoning split off is dropped
    choices: list[Choice] = field(init=False)

    def __post_init__(self) -> None:
        first = Choice(0, self.sequencer, self.assembler, self.output)
        more = [
            Choice(i, TokenSequencer(), self.more_assemblers())
            for i in range(1, self.spec.sampling.n)
            if self.more_assemblers is not None
        ]
        self.choices = [first, *more]
        for choice in self.choices:
            choice.reader = self.tools.stream() if self.tools is not None else None
            choice.splitter = ThinkSplitter(self.thinking) if self.thinking is not None else None

    @property
    def completion_tokens(self) -> int:
        return sum(choice.assembler.tokens for choice in self.choices)

    # --- ASGI -------------------------------------------------------------------------

    async def __call__(self, scope, receive, send) -> None:
        try:
            async with anyio.create_task_group() as tg:
                tg.start_soon(self._watch_disconnect, receive, tg.cancel_scope)
                try:
                    await (self._send_stream(send) if self.stream else self._send_body(send))
                except Exception as exc:  # the catch-all: answered, logged, never plain text
                    await self._fail_unexpectedly(send, exc)
                tg.cancel_scope.cancel()
        finally:
            with anyio.CancelScope(shield=True):
                await self._cleanup()

    async def _watch_disconnect(self, receive, scope: anyio.CancelScope) -> None:
        while (await receive())["type"] != "http.disconnect":
            pass
        # The server also reports a disconnect once the response is complete: by then the
        # ending is settled and the client leaving changes nothing.
        if self.outcome is None:
            self.outcome = "cancelled"
        scope.cancel()

    async def _fail_unexpectedly(self, send, exc: Exception) -> None:
        """A bug, not a stream that failed: log it, mark the span, and tell the client in
        the response's own form (a JSON 500, or an SSE error event once streaming)."""
        log.exception("%s failed unexpectedly", self.spec.request_id)
        self.outcome = "error"
        self.span.record_exception(exc)
        self.span.set_status(Status(StatusCode.ERROR, f"{type(exc).__name__}: {exc}"))
        error = internal_error()
        with contextlib.suppress(Exception):  # the connection itself may be what broke
            if self.response_started:
                await self._event(send, error.body())
                await send({"type": "http.response.body", "body": b"", "more_body": False})
            else:
                await _send_json(send, error)

    # --- the token loop ------------------------------------------------------------------

    async def _generate(self, on_delta: Callable[[Choice, str, dict | None], Awaitable[None]]) -> None:
        """Until every choice ends: each choice's deltas of text, with their tokens' logprobs
        when asked for (in the endpoint's shape), to ``on_delta``; raises StreamFailed."""
        while not all(choice.done for choice in self.choices):
            try:
                arrived = await self._next_tokens()
            except StreamFailed as failed:
                await self._migrate(failed)  # or raises
                continue
            for choice, tokens in arrived:
                choice.output += tokens
                before = choice.assembler.tokens
                text = choice.assembler.push(tokens)
                logprobs = self._logprobs(choice, tokens[: choice.assembler.tokens - before])
                if text or logprobs:
                    await on_delta(choice, text, logprobs)
        for choice in self.choices:
            tail = choice.assembler.finish()
            if tail:
                await on_delta(choice, tail, None)

    def _logprobs(self, choice: Choice, tokens: list[int]) -> dict | None:
        """The logprobs of ``tokens``, the next ones ``choice`` delivered, if the request asked."""
        if self.token_text is None or not tokens:
            return None
        start = choice.logprobs_sent
        entries: list[TokenLogprobs] = choice.sequencer.logprobs[start : start + len(tokens)]
        tokens = tokens[: len(entries)]
        choice.logprobs_sent += len(entries)
        if self.kind == "chat":
            return chat_logprobs(tokens, entries, self.token_text)
        rendered = completion_logprobs(tokens, entries, self.token_text, choice.text_offset)
        choice.text_offset += sum(len(piece) for piece in rendered["tokens"])
        return rendered

    async def _next_tokens(self) -> list[tuple[Choice, list[int]]]:
        """Tokens that have arrived, coalesced into one delta per choice: under load the client
        gets fewer, larger events instead of falling behind. Waits only when nothing is there
        (the router's watchdog fails a stream that stays silent)."""
        if not self.inbox.chunks:
            await self.inbox.wait()
        arrived: dict[int, list[int]] = {}
        chunks = self.inbox.chunks
        while chunks:
            chunk = chunks.popleft()
            if not 0 <= chunk.index < len(self.choices):
                log.warning("%s: a chunk for choice %d, of %d", self.spec.request_id, chunk.index, len(self.choices))
                continue
            choice = self.choices[chunk.index]
            if choice.sequencer.finished and chunk.error is None:
                continue  # an error fails the request, whichever choice it names (the router's: 0)
            try:
                tokens = choice.sequencer.feed(chunk)
            except StreamFailed:
                if not arrived:
                    raise
                chunks.appendleft(chunk)  # what arrived before the failure is delivered first
                break
            if tokens:
                arrived.setdefault(chunk.index, []).extend(tokens)
            if chunk.usage is not None and chunk.seq == self._resumed_at:
                self._resumed_at = None
                self.recomputed_tokens += chunk.usage.prompt_tokens - chunk.usage.cached_tokens
        if arrived:
            now = time.monotonic()
            self.first_token_at = self.first_token_at or now
            self.inbox.progress_at = now  # the last token's time, for TPOT and the stall watch
        return [(self.choices[index], tokens) for index, tokens in arrived.items()]

    async def _migrate(self, failed: StreamFailed) -> None:
        """Continue on another worker after the tokens delivered, or raise ``failed``."""
        error, delivered = failed.error, len(self.output)
        if error.code not in _MIGRATABLE:
            raise failed  # the request itself failed: final
        if self.spec.sampling.decode_samples_first and any(choice.output for choice in self.choices):
            # A grammar cannot be resumed mid-output by another engine (its state is the engine's),
            # nor n choices continued from one prompt.
            self.ctx.metrics.migrations.labels(outcome="exhausted").inc()
            raise failed
        assert delivered == self.sequencer.next_seq  # every token taken was delivered
        migrations = self.ctx.metrics.migrations
        if self.migrations >= self.ctx.max_migrations or delivered >= self.spec.sampling.max_tokens:
            migrations.labels(outcome="exhausted").inc()
            raise failed
        # Its run may be alive (a worker taken for dead, a stream cut by the bus): end it
        # before the next one starts, which the cancel does not cover.
        cancel = Cancel(request_id=self.spec.request_id, reason=error.code, attempt=self.migrations)
        await self.ctx.nc.publish(self.ctx.cancel_subject(self.spec.request_id), codec.CANCEL.encode(cancel))
        self.migrations += 1
        spec = self.ctx.continuation(self.spec, self.output) if delivered else self.spec
        spec = msgspec.structs.replace(spec, attempt=self.migrations)
        self.ctx.router.reassign(self.inbox)
        for choice in self.choices:
            choice.sequencer.drop_ahead()
        try:
            await self._resubmit(spec)
        except ApiError as refused:
            migrations.labels(outcome="refused").inc()
            message = f"{error.message}; it could not continue elsewhere: {refused.message}"
            raise StreamFailed(StreamError(code=error.code, message=message)) from None
        migrations.labels(outcome="resumed").inc()
        self._resumed_at = delivered or None  # with nothing delivered, maybe nothing was computed
        log.info("%s: worker lost after %d tokens; continuing elsewhere", self.spec.request_id, delivered)

    async def _resubmit(self, spec: RequestSpec) -> None:
        """Submit ``spec`` again; while no worker of a role is there, retry for a while."""
        give_up = time.monotonic() + self.ctx.migration_wait_s
        while True:
            try:
                return await self.ctx.resubmit(spec, trace.set_span_in_context(self.span))
            except Unavailable as unavailable:
                wait = min(unavailable.retry_after_s or 1.0, 0.5)
                if time.monotonic() + wait > give_up:
                    raise
                await anyio.sleep(wait)

    @property
    def finish_reason(self) -> str:
        """Choice 0's."""
        return self.choices[0].finish_reason

    # --- non-streaming ------------------------------------------------------------------

    async def _send_body(self, send) -> None:
        parts: dict[int, list[str]] = {choice.index: [] for choice in self.choices}
        logprobs: dict[int, list[dict]] = {choice.index: [] for choice in self.choices}

        async def gather(choice: Choice, text: str, lps: dict | None) -> None:
            parts[choice.index].append(text)
            if lps is not None:
                logprobs[choice.index].append(lps)

        try:
            await self._generate(gather)
        except StreamFailed as exc:
            self.outcome = "error"
            self.span.set_status(Status(StatusCode.ERROR, exc.error.message))
            await _send_json(send, generation_error(exc.error.code, exc.error.message, exc.error.retry_after_s))
            return
        self.outcome = "ok"
        asked = self.token_text is not None  # joined only when the request asked for them
        choices = [
            self._choice_body(c, "".join(parts[c.index]), _joined(logprobs[c.index], self.kind) if asked else None)
            for c in self.choices
        ]
        body = {
            "id": self.spec.request_id,
            "object": _OBJECT[self.kind],
            "created": self.created,
            "model": self.model,
            "choices": choices,
            "usage": self.usage(),
        }
        await _send_json(send, None, body)

    def _choice_body(self, choice: Choice, text: str, logprobs: dict | None) -> dict:
        if self.kind != "chat":
            return {"index": choice.index, "text": text, "logprobs": logprobs, "finish_reason": choice.finish_reason}
        message: dict[str, Any] = {"role": "assistant", "content": text}
        if choice.splitter is not None:
            pieces = [*choice.splitter.push(text), *choice.splitter.finish()]
            text = "".join(piece for kind, piece in pieces if kind == "content")
            reasoning = "".join(piece for kind, piece in pieces if kind == "reasoning")
            message["reasoning"] = (reasoning or None) if self.include_reasoning else None
            message["content"] = text or None  # as vLLM: a thought cut off has no content
        if choice.reader is not None:
            parsed = collect([*choice.reader.push(text), *choice.reader.finish()])
            message["content"] = parsed.content
            if parsed.tool_calls:
                choice.called = True
                message["tool_calls"] = [
                    {"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
                    for c in parsed.tool_calls
                ]
        return {"index": choice.index, "message": message, "logprobs": logprobs, "finish_reason": choice.finish_reason}

    # --- streaming ----------------------------------------------------------------------

    async def _send_stream(self, send) -> None:
        frames = _DeltaFrames(self._chunk({"content": ""} if self.kind == "chat" else "", None))
        plain = len(self.choices) == 1 and self.tools is None and self.token_text is None
        plain = plain and not self.continuous_usage and self.thinking is None

        async def emit(choice: Choice, text: str, logprobs: dict | None) -> None:
            if plain:  # the hot path: a pre-encoded frame around the text
                body = frames.delta(text)
                if not self.response_started:  # the first delta: the response is a stream
                    body = await self._start_stream(send) + body
                await send({"type": "http.response.body", "body": body, "more_body": True})
                return
            await self._send_events(send, choice, _events(choice, text, self.include_reasoning), logprobs)

        try:
            await self._generate(emit)
            for choice in self.choices:
                if choice.splitter is not None:
                    await self._send_events(
                        send, choice, _events(choice, "", self.include_reasoning, finish=True), None
                    )
                if choice.reader is not None:
                    await self._send_events(send, choice, choice.reader.finish(), None)
        except StreamFailed as exc:
            self.outcome = "error"
            self.span.set_status(Status(StatusCode.ERROR, exc.error.message))
            error = generation_error(exc.error.code, exc.error.message, exc.error.retry_after_s)
            if not self.response_started:  # nothing sent: answered as a non-streaming request is
                await _send_json(send, error)
                return
            await self._event(send, error.body())
            await send({"type": "http.response.body", "body": b"", "more_body": False})
            return
        self.outcome = "ok"
        # No text at all (EOS or a stop string first): still a stream, started at its end.
        head = b"" if self.response_started else await self._start_stream(send)
        ending = [self._chunk({} if self.kind == "chat" else "", c.finish_reason, c.index) for c in self.choices]
        if self.continuous_usage:
            ending[-1]["usage"] = self.usage()
        if self.include_usage:
            ending.append(self._usage_chunk())
        body = head + b"".join(sse(event) for event in ending) + b"data: [DONE]\n\n"
        await send({"type": "http.response.body", "body": body, "more_body": False})

    async def _send_events(
        self, send, choice: Choice, events: list[Event] | list[Event | Reasoning], logprobs: dict | None
    ) -> None:
        """One choice's content and tool-call deltas, one chunk each (consecutive text
        joined); the logprobs ride on the first, or on an empty delta of their own."""
        deltas: list[dict | str] = []
        for event in events:
            if isinstance(event, Reasoning):
                if deltas and isinstance(deltas[-1], dict) and "reasoning" in deltas[-1]:
                    deltas[-1]["reasoning"] += event.text
                else:
                    deltas.append({"reasoning": event.text})
            elif isinstance(event, ToolCallDelta):
                choice.called = True
                deltas.append({"tool_calls": [_call_delta(event)]})
            elif self.kind != "chat":
                deltas.append(event)
            elif deltas and isinstance(deltas[-1], dict) and "content" in deltas[-1]:
                deltas[-1]["content"] += event
            else:
                deltas.append({"content": event})
        if not deltas and logprobs is not None:
            deltas.append({"content": ""} if self.kind == "chat" else "")
        head = b"" if self.response_started or not deltas else await self._start_stream(send)
        for i, delta in enumerate(deltas):
            chunk = self._chunk(delta, None, choice.index)
            if i == 0 and logprobs is not None:
                chunk["choices"][0]["logprobs"] = logprobs
            if self.continuous_usage:
                chunk["usage"] = self.usage()
            await send({"type": "http.response.body", "body": head + sse(chunk), "more_body": True})
            head = b""

    async def _start_stream(self, send) -> bytes:
        """Start the SSE response, once its first delta or its ending is known (see the
        module's note); returns its role chunks (chat), one per choice, for the caller to
        send in one write with what follows them."""
        await send({"type": "http.response.start", "status": 200, "headers": SSE_HEADERS})
        self.response_started = True
        if self.kind != "chat":
            return b""
        return b"".join(sse(self._chunk({"role": "assistant", "content": ""}, None, c.index)) for c in self.choices)

    async def _event(self, send, payload: dict) -> None:
        await send({"type": "http.response.body", "body": sse(payload), "more_body": True})

    def _chunk(self, delta: dict | str, finish_reason: str | None, index: int = 0) -> dict:
        if self.kind == "chat":
            choice = {"index": index, "delta": delta, "logprobs": None, "finish_reason": finish_reason}
        else:
            choice = {"index": index, "text": delta, "logprobs": None, "finish_reason": finish_reason}
        chunk = {
            "id": self.spec.request_id,
            "object": _CHUNK_OBJECT[self.kind],
            "created": self.created,
            "model": self.model,
            "choices": [choice],
        }
        if self.include_usage:
            chunk["usage"] = None
        return chunk

    def _usage_chunk(self) -> dict:
        return {
            "id": self.spec.request_id,
            "object": _CHUNK_OBJECT[self.kind],
            "created": self.created,
            "model": self.model,
            "choices": [],
            "usage": self.usage(),
        }

    def usage(self) -> dict:
        prompt = len(self.spec.prompt_tokens)
        cached = self.sequencer.usage.cached_tokens if self.sequencer.usage else 0
        completion = self.completion_tokens
        return {
            "prompt_tokens": prompt,
            "completion_tokens": completion,
            "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": cached},
        }

    # --- the end ----------------------------------------------------------------------------

    async def abandon(self) -> None:
        """End a generation that is never run (a request of several prompts, ``ingress.prompts``,
        whose later prompt was refused): its request is cancelled and its route closed, as for a
        client that left."""
        self.outcome = "cancelled"
        await self._cleanup()

    async def _cleanup(self) -> None:
        rid = self.spec.request_id
        self.ctx.router.close(rid)
        outcome = self.outcome or "error"  # unsettled: something raised past the catch-all
        if not all(c.sequencer.finished for c in self.choices):  # a stop string, an error, a disconnect
            cancel = Cancel(request_id=rid, reason=outcome if outcome != "ok" else "stop")
            try:
                await self.ctx.nc.publish(self.ctx.cancel_subject(rid), codec.CANCEL.encode(cancel))
            except nats.errors.Error as exc:  # the bus closed under it (the ingress stopping)
                log.warning("%s: its cancel was not sent (%r); the rest of its cleanup goes on", rid, exc)
        if self.ctx.on_closed is not None:
            self.ctx.on_closed(rid)
        self._record(outcome)
        if self.ctx.on_finished is not None:
            self.ctx.on_finished(self, outcome)
        self.span.set_attribute("switchyard.outcome", outcome)
        if self.migrations:
            self.span.set_attribute("switchyard.migrations", self.migrations)
            self.span.set_attribute("switchyard.recomputed_tokens", self.recomputed_tokens)
        self.span.end()

    def _record(self, outcome: str) -> None:
        m = self.ctx.metrics
        m.in_flight.dec()
        m.requests.labels(outcome=outcome).inc()
        usage = self.sequencer.usage
        tenant = m.tenant_label(self.spec.tenant)
        if usage is not None:
            m.queue_time.observe(usage.queued_s)
            m.prompt_tokens.labels(tenant).inc(usage.prompt_tokens)
            m.cached_tokens.labels(tenant).inc(usage.cached_tokens)
        m.generation_tokens.labels(tenant).inc(self.completion_tokens)
        if self.spec.priority > 0:  # batch work (the batch runner's lines)
            m.batch_tokens.labels(kind="prompt").inc(len(self.spec.prompt_tokens))
            m.batch_tokens.labels(kind="completion").inc(self.completion_tokens)
        m.recomputed_tokens.inc(self.recomputed_tokens)
        if self.first_token_at is not None:
            m.ttft.observe(self.first_token_at - self.arrived)
            last = self.inbox.progress_at
            if self.assembler.tokens > 1 and last is not None:
                m.tpot.observe((last - self.first_token_at) / (self.assembler.tokens - 1))


@dataclass(frozen=True, slots=True)
class Reasoning:
    """A piece of a choice's reasoning (``delta.reasoning``), apart from its content."""

    text: str


def _events(choice: Choice, text: str, include_reasoning: bool = True, finish: bool = False) -> list[Event | Reasoning]:
    """A choice's next text as stream events: its reasoning apart (``choice.splitter``; dropped
    unless ``include_reasoning``), the rest through its tool-call reader (``choice.reader``), or
    as content."""
    pieces: list[tuple[Piece, str]] = [("content", text)] if text else []
    if choice.splitter is not None:
        pieces = choice.splitter.finish() if finish else choice.splitter.push(text)
    events: list[Event | Reasoning] = []
    for kind, piece in pieces:
        if kind == "reasoning":
            if include_reasoning:
                events.append(Reasoning(piece))
        elif choice.reader is not None:
            events += choice.reader.push(piece)
        else:
            events.append(piece)
    return events


def _call_delta(delta: ToolCallDelta) -> dict:
    """OpenAI's ``delta.tool_calls[i]``: id, type and name on a call's first delta only."""
    function: dict[str, str] = {"arguments": delta.arguments}
    out: dict[str, Any] = {"index": delta.index, "function": function}
    if delta.id is not None:
        out["id"] = delta.id
        out["type"] = "function"
    if delta.name is not None:
        function["name"] = delta.name
    return out


def _joined(parts: list[dict], kind: Kind) -> dict:
    """The logprobs of a whole output from those of its deltas."""
    if not parts:
        return chat_logprobs([], [], str) if kind == "chat" else completion_logprobs([], [], str)
    joined: dict[str, list] = {key: [] for key in parts[0]}
    for part in parts:
        for key, values in part.items():
            joined[key] += values
    return joined


def sse(payload: dict) -> bytes:
    """One server-sent event of ``payload`` (``ingress.prompts`` relays them too)."""
    return b"data: " + msgspec.json.encode(payload) + b"\n\n"


class _DeltaFrames:
    """A text delta's SSE event, pre-encoded around the text: one event per delta is the
    hot path of streaming, so it is a concatenation, not a dict encoded anew."""

    _MARK = "\x00switchyard-delta\x00"

    def __init__(self, template: dict) -> None:
        choice = template["choices"][0]
        if "delta" in choice:
            choice["delta"]["content"] = self._MARK
        else:
            choice["text"] = self._MARK
        encoded = sse(template)
        mark = msgspec.json.encode(self._MARK)
        self._head, self._tail = encoded.split(mark)

    def delta(self, text: str) -> bytes:
        return self._head + msgspec.json.encode(text) + self._tail


_OBJECT = {"chat": "chat.completion", "completion": "text_completion"}
_CHUNK_OBJECT = {"chat": "chat.completion.chunk", "completion": "text_completion"}


async def _send_json(send, error: ApiError | None, body: dict | None = None) -> None:
    """``body`` with 200, or ``error`` with its status and its headers (a Retry-After)."""
    if error is None:
        status, payload, headers = 200, msgspec.json.encode(body), JSON_HEADERS
    else:
        status, payload = error.status, error.encoded()
        headers = [*JSON_HEADERS, *((name.encode(), value.encode()) for name, value in error.headers().items())]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": payload, "more_body": False})
