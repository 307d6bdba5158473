"""The OpenAI-compatible HTTP API.

Every request is checked before it costs anything downstream: body size (413),
JSON and field types (400, naming the field), the model (404), prompt and
``max_tokens`` against the context (400). Then it is tokenized here, with the
model's own tokenizer and chat template, cut into blocks with chained keys, and
submitted to the scheduler (429 or 503 when refused). The response subscribes to
its token stream before submitting, so no token can arrive unheard.
"""

from __future__ import annotations

import functools
import logging
import re
import time
import uuid
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, TypeVar, cast

import anyio
import msgspec
from nats.errors import NoRespondersError
from nats.errors import TimeoutError as NatsTimeout
from opentelemetry import trace
from opentelemetry.trace import Span, SpanKind, Status, StatusCode
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.middleware.cors import CORSMiddleware
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import BaseRoute, Route

from switchyard.ingress.auth import AuthMiddleware, Gate, caller_of
from switchyard.ingress.config import IngressConfig
from switchyard.ingress.edge import read_body
from switchyard.ingress.errors import (
    ApiError,
    ContextLengthExceeded,
    InvalidRequest,
    ModelNotFound,
    RateLimited,
    Unavailable,
    internal_error,
)
from switchyard.ingress.extras import DetokenizeRequest, RequestIdMiddleware, TokenizeRequest
from switchyard.ingress.federation import REGION_HEADER, Federation
from switchyard.ingress.generation import Generation, GenerationContext, Kind
from switchyard.ingress.openai_types import (
    MAX_CHOICES,
    ChatCompletionRequest,
    CompletionRequest,
    chat_messages,
    chat_tools,
    check_sampling,
    decode_body,
    stop_strings,
    template_kwargs,
)
from switchyard.ingress.openapi import openapi_document
from switchyard.ingress.prompts import Prompts
from switchyard.ingress.reasoning import opens_thought
from switchyard.ingress.sampling import sampling_params
from switchyard.ingress.streams import StreamRouter
from switchyard.ingress.text import TextAssembler
from switchyard.ingress.tokenizer import ModelTokenizer, TokenizerError
from switchyard.ingress.tool_calls import ToolPlan
from switchyard.kvbus import KeyScheme
from switchyard.observability import CONTENT_TYPE, BusStats, ServingMetrics, tracing
from switchyard.schemas import (
    Admitted,
    ClusterStatus,
    Rejected,
    RequestSpec,
    SamplingParams,
    StatusRequest,
    SubmitRequest,
    codec,
    subjects,
)

log = logging.getLogger(__name__)
_T = TypeVar("_T")
_DECODE_ON_LOOP_BYTES = 64 * 1024

SESSION_HEADER = "x-session-affinity"
PRIORITY_HEADER = "x-switchyard-priority"  # interactive (default), batch, or 0-9
DEADLINE_HEADER = "x-switchyard-deadline-s"  # first token due within this many seconds
_PRIORITIES = {"interactive": 0, "batch": 1}
# A session id reaches the scheduler's logs and (hashed) its KV key: bounded, printable.
SESSION_MAX_BYTES = 256
_SESSION_RE = re.compile(r"[\x20-\x7e]+")


class Ingress:
    def __init__(
        self,
        config: IngressConfig,
        tokenizer: ModelTokenizer,
        nc,
        router: StreamRouter,
        metrics: ServingMetrics,
        bus_stats: BusStats,
        gate: Gate,
        on_finished: Callable[[Generation, str], None] | None = None,
        routes: Sequence[BaseRoute] = (),  # more of the API, served by other modules (ingress.files)
        on_scrape: Sequence[Callable[[], Awaitable[None]]] = (),  # set more gauges before /metrics answers
        federation: Federation | None = None,  # the regions, when this ingress is in one (ingress.federation)
    ) -> None:
        self.config = config
        self.tokenizer = tokenizer
        self._on_scrape = list(on_scrape)
        self.model = config.served_model_name or tokenizer.info.name
        self.key_scheme = KeyScheme(config.key_scheme, config.hash_seed)
        self.nc = nc
        self.router = router
        self.metrics = metrics
        self.bus_stats = bus_stats
        self.ingress_id = config.ingress_id
        self.federation = federation
        self._gen_ctx = GenerationContext(
            nc=nc,
            router=router,
            metrics=metrics,
            continuation=functools.partial(continuation_spec, key_scheme=self.key_scheme),
            resubmit=self._submit,
            max_migrations=config.max_migrations,
            migration_wait_s=config.migration_wait_s,
            on_finished=on_finished,
        )
        if federation is not None:  # its cancels go to the region that has it
            self._gen_ctx.cancel_subject = federation.cancel_subject
            self._gen_ctx.on_closed = federation.finished
        self._tokenizing = anyio.CapacityLimiter(config.tokenize_threads)
        self._openapi: bytes | None = None
        self.app = Starlette(
            routes=[
                Route("/v1/chat/completions", self.chat_completions, methods=["POST"]),
                Route("/v1/completions", self.completions, methods=["POST"]),
                Route("/v1/models", self.models, methods=["GET"]),
                Route("/v1/models/{model:path}", self.model_card, methods=["GET"]),
                Route("/tokenize", self.tokenize, methods=["POST"]),
                Route("/detokenize", self.detokenize, methods=["POST"]),
                Route("/health", self.health, methods=["GET"]),
                Route("/metrics", self.metrics_text, methods=["GET"]),
                Route("/openapi.json", self.openapi, methods=["GET"]),
                *routes,
            ],
            # Exception: Starlette's outermost middleware answers with it, then re-raises
            # for the server to log; the client never sees a plain-text 500.
            exception_handlers=_HANDLERS,
            # The caller and its tenant are decided there, before a body is read (ingress.auth).
            # Outermost first: every response carries its x-request-id (ingress.extras), a CORS
            # preflight is answered before it would need a key, and then the key is checked.
            middleware=[
                Middleware(RequestIdMiddleware),
                *_cors(config.cors_allow_origins),
                Middleware(AuthMiddleware, gate=gate),
            ],
        )

    # --- endpoints --------------------------------------------------------------------------

    async def chat_completions(self, request: Request) -> Response | Generation:
        body = await self._decode(await self._read_body(request), ChatCompletionRequest)
        self._check_common(body)
        tools = ToolPlan.of(body, self.config.tool_call_parser)
        prompt, thinking = await self._chat_render(body)
        requested = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
        param = "max_completion_tokens" if body.max_completion_tokens is not None else "max_tokens"
        max_tokens = self._max_tokens(len(prompt), requested, param)
        reasoning = thinking if self.config.reasoning_parser else None
        if not body.include_reasoning and reasoning is None:
            raise InvalidRequest(
                "`include_reasoning: false` needs a reasoning parser (--reasoning-parser); without one the "
                "reasoning is not told apart from the content.",
                param="include_reasoning",
            )
        return await self._generate(request, "chat", body, prompt, max_tokens, tools, reasoning)

    async def completions(self, request: Request) -> Generation | Prompts:
        body = await self._decode(await self._read_body(request), CompletionRequest)
        self._check_common(body)
        prompts = _prompt_list(body.prompt)
        if len(prompts) * body.n > MAX_CHOICES:
            raise InvalidRequest(
                f"{len(prompts)} prompts of {body.n} choices each make {len(prompts) * body.n} choices; "
                f"one response has at most {MAX_CHOICES}.",
                param="prompt",
            )
        tokens = [await self._completion_prompt(prompt) for prompt in prompts]
        limits = [self._max_tokens(len(prompt), body.max_tokens, "max_tokens") for prompt in tokens]
        if len(tokens) == 1:
            return await self._generate(request, "completion", body, tokens[0], limits[0])
        parts: list[Generation] = []  # each prompt a request of its own (ingress.prompts)
        try:
            for prompt, limit in zip(tokens, limits, strict=True):
                parts.append(await self._generate(request, "completion", body, prompt, limit))
        except BaseException:  # one refused (a limit, no scheduler): the ones submitted are cancelled
            with anyio.CancelScope(shield=True):
                for part in parts:
                    await part.abandon()
            raise
        return Prompts(parts)

    async def models(self, request: Request) -> Response:
        return JSONResponse({"object": "list", "data": [self._card()]})

    async def model_card(self, request: Request) -> Response:
        """The served model, by its id"""
        model = request.path_params["model"]
        if model != self.model:
            raise ModelNotFound(model)
        return JSONResponse(self._card())

    def _card(self) -> dict[str, Any]:
        return {
            "id": self.model,
            "object": "model",
            "created": 0,
            "owned_by": "switchyard",
            "max_model_len": self.tokenizer.info.max_context,
        }

    async def tokenize(self, request: Request) -> Response:
        """The token ids a completion (prompt) or chat completion (messages) would prefill"""
        body = await self._decode(await self._read_body(request), TokenizeRequest)
        if body.model is not None and body.model != self.model:
            raise ModelNotFound(body.model)
        if (body.prompt is None) == (body.messages is None):
            raise InvalidRequest("Give either `prompt` or `messages`.", param="prompt")
        if body.prompt is not None:
            tokens = await self._off_loop(self._encode, body.prompt)
        else:
            chat = ChatCompletionRequest(
                model=self.model,
                messages=body.messages or [],
                tools=body.tools,
                chat_template_kwargs=body.chat_template_kwargs,
            )
            tokens = await self._chat_prompt(chat)
        return JSONResponse({"count": len(tokens), "max_model_len": self.tokenizer.info.max_context, "tokens": tokens})

    async def detokenize(self, request: Request) -> Response:
        """The text of token ids"""
        body = await self._decode(await self._read_body(request), DetokenizeRequest)
        if body.model is not None and body.model != self.model:
            raise ModelNotFound(body.model)
        if not self._in_vocab(body.tokens):
            raise InvalidRequest(f"Token ids must be in [0, {self.tokenizer.info.vocab_size}).", param="tokens")
        return JSONResponse({"prompt": await self._off_loop(self.tokenizer.decode, body.tokens)})

    async def _cluster_status(self) -> ClusterStatus | None:
        try:
            reply = await self.nc.request(subjects.SUBMIT, codec.SCHEDULER_REQUEST.encode(StatusRequest()), timeout=1.0)
        except (NoRespondersError, NatsTimeout):
            return None
        status = codec.SCHEDULER_REPLY.decode(reply.data)
        assert isinstance(status, ClusterStatus)
        return status

    async def health(self, request: Request) -> Response:
        status = await self._cluster_status()
        if status is None:
            return JSONResponse({"status": "unavailable", "reason": "no scheduler answers"}, 503)
        roles = [w.role for w in status.workers]
        colocated = roles.count("both")  # a colocated worker prefills and decodes
        body = {
            "status": "ok",
            "model": self.model,
            "prefill_workers": roles.count("prefill") + colocated,
            "decode_workers": roles.count("decode") + colocated,
            "colocated_workers": colocated,
            "queued_requests": status.queued_requests,
            "awaiting_decode": status.awaiting_decode,
            "paused_requests": status.paused_requests,
            "in_flight_requests": len(self.router),
        }
        if not (body["prefill_workers"] and body["decode_workers"]):
            body["status"] = "unavailable"
            return JSONResponse(body, 503)
        return JSONResponse(body)

    async def metrics_text(self, request: Request) -> Response:
        self.metrics.bus_dropped.set(self.bus_stats.dropped)
        self.metrics.stream_refused.set(self.router.refused)
        status = await self._cluster_status()
        if status is not None:
            self.metrics.set_workers(status.workers)
            self.metrics.set_queues(status)
            self.metrics.set_stranded(status)
        for refresh in self._on_scrape:
            await refresh()
        return Response(self.metrics.exposition(), media_type=CONTENT_TYPE)

    async def openapi(self, request: Request) -> Response:
        if self._openapi is None:  # built on first use, when every route is in place
            self._openapi = openapi_document(self.app.routes, self.model)
        return Response(self._openapi, media_type="application/json")

    # --- checks ------------------------------------------------------------------------------

    async def _read_body(self, request: Request) -> bytes:
        return await read_body(request, self.config.max_body_bytes)

    def _check_streams(self) -> None:
        """Exact, since nothing awaits between here and the route's opening."""
        if len(self.router) >= self.config.max_streams:
            raise RateLimited(
                f"This ingress is serving its limit of {self.config.max_streams} requests; retry shortly.",
                code="too_many_streams",
                retry_after_s=1.0,
            )

    async def _decode(self, raw: bytes, type_: type[_T]) -> _T:
        """Microseconds for a usual body, on the loop; a body of megabytes (its depth measured,
        then decoded: a few hundred ms for 8 MB of small messages) in the pool."""
        decode = functools.partial(decode_body, raw, type_, max_depth=self.config.max_json_depth)
        return decode() if len(raw) <= _DECODE_ON_LOOP_BYTES else await self._off_loop(decode)

    async def _off_loop(self, fn: Callable[..., _T], *args: Any) -> _T:
        """Tokenizing runs at about 2 MB/s: on the event loop, an 8 MB prompt would stall every
        client for seconds. In a bounded pool of threads (the tokenizer releases the GIL) it
        stalls no one, and at most ``tokenize_threads`` prompts are held in memory at once."""
        return await anyio.to_thread.run_sync(fn, *args, limiter=self._tokenizing)

    def _check_common(self, body) -> None:
        if body.model != self.model:
            raise ModelNotFound(body.model)
        check_sampling(body)

    async def _completion_prompt(self, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, str):
            return await self._off_loop(self._encode, prompt)
        if not prompt or not self._in_vocab(prompt):
            vocab = self.tokenizer.info.vocab_size
            raise InvalidRequest(f"Token ids must be a non-empty list in [0, {vocab}).", param="prompt")
        return list(prompt)

    async def _chat_prompt(self, body: ChatCompletionRequest) -> list[int]:
        return (await self._chat_render(body))[0]

    async def _chat_render(self, body: ChatCompletionRequest) -> tuple[list[int], bool]:
        """The messages (and tools, and ``chat_template_kwargs``) through the model's chat
        template, tokenized (in the pool); and whether the prompt ends inside a thought
        (``ingress.reasoning``)."""
        messages, tools = chat_messages(body), chat_tools(body)
        kwargs = template_kwargs(body.chat_template_kwargs, self.tokenizer.template_variables, body.reasoning_effort)

        def render() -> tuple[list[int], bool]:
            text = self.tokenizer.render_chat(messages, tools, kwargs)
            return self._encode(text), opens_thought(text)

        try:
            return await self._off_loop(render)
        except TokenizerError as exc:  # the template refused these messages (raise_exception)
            raise InvalidRequest(f"The chat template rejected the messages: {exc}", param="messages") from None

    def _in_vocab(self, tokens: list[int]) -> bool:
        vocab = self.tokenizer.info.vocab_size
        return all(0 <= t < vocab for t in tokens)

    def _encode(self, text: str) -> list[int]:
        """In the pool; a text whose size alone puts it past the context is not tokenized."""
        context, at_least = self.tokenizer.info.max_context, self.tokenizer.min_tokens(text)
        if at_least >= context:
            raise ContextLengthExceeded(
                f"The prompt is too long for this model's context of {context} tokens: it has at least "
                f"{at_least} (found before tokenizing)."
            )
        return self.tokenizer.encode(text)

    def _max_tokens(self, prompt_len: int, requested: int | None, param: str) -> int:
        context = self.tokenizer.info.max_context
        if prompt_len == 0:
            raise InvalidRequest("The prompt is empty.", param="prompt")
        if prompt_len >= context:
            raise ContextLengthExceeded(
                f"This model's maximum context length is {context} tokens; the prompt has {prompt_len}."
            )
        if requested is None:
            return min(self.config.default_max_tokens, context - prompt_len)
        if requested < 1:
            raise InvalidRequest(f"`{param}` must be at least 1, got {requested}.", param=param)
        if prompt_len + requested > context:
            raise ContextLengthExceeded(
                f"This model's maximum context length is {context} tokens; you asked for {prompt_len} "
                f"prompt tokens plus {requested} completion tokens.",
                param=param,
            )
        return requested

    # --- generation ----------------------------------------------------------------------------

    async def _generate(
        self,
        request: Request,
        kind: Kind,
        body: Any,
        prompt: list[int],
        max_tokens: int,
        tools: ToolPlan | None = None,
        thinking: bool | None = None,
    ) -> Generation:
        self._check_streams()
        sampling = sampling_params(
            body, max_tokens, self.tokenizer.info.vocab_size, tools.constraint() if tools is not None else None
        )
        caller = caller_of(request)  # the tenant is its key's, never a client's say (ingress.auth)
        ticket = caller.admit(sampling.kv_tokens(len(prompt)))  # 429 past its key's limits
        spec = self._spec(
            kind,
            sampling,
            prompt,
            caller.tenant,
            _session(request.headers.get(SESSION_HEADER)),
            _priority(request.headers.get(PRIORITY_HEADER)),
            _deadline(request.headers.get(DEADLINE_HEADER)),
        )
        stops = stop_strings(body.stop)
        span = tracing.tracer().start_span(f"POST {request.url.path}", kind=SpanKind.SERVER)
        span.set_attribute("switchyard.request_id", spec.request_id)
        span.set_attribute("http.request_id", request.state.request_id)  # the client's x-request-id, or ours
        log.debug("%s is x-request-id %s", spec.request_id, request.state.request_id)
        inbox = self.router.open(spec.request_id, max_tokens, spec.sampling.n)  # before submitting: hear every token
        try:
            if (region := request.headers.get(REGION_HEADER)) is not None:
                if self.federation is None:
                    raise InvalidRequest(f"Header {REGION_HEADER} needs an ingress in a region (--region).")
                self.federation.pin(spec.request_id, region.strip())
            await self._submit(spec, trace.set_span_in_context(span))
            options = body.stream_options if body.stream else None
            include_usage = bool(options and options.include_usage)
            generation = Generation(
                ctx=self._gen_ctx,
                kind=kind,
                spec=spec,
                model=self.model,
                stream=body.stream,
                include_usage=include_usage,
                continuous_usage=bool(include_usage and options and options.continuous_usage_stats),
                assembler=self._assembler(sampling, stops, tools, body.include_stop_str_in_output),
                more_assemblers=lambda: self._assembler(sampling, stops, tools, body.include_stop_str_in_output),
                tools=tools,
                # A constrained output (a schema, a forced call) is the answer from its first
                # token: the engine applies the grammar from there, so no thought comes first.
                thinking=thinking if sampling.structured is None else None,
                include_reasoning=getattr(body, "include_reasoning", True),
                token_text=self.tokenizer.token_text if sampling.logprobs is not None else None,
                inbox=inbox,
                span=span,
                arrived=time.monotonic(),
            )
            ticket.measure(lambda: len(prompt) + generation.completion_tokens)  # refunds unused max_tokens
        except BaseException as exc:  # the Generation owns the route and the span only once returned
            self._abandon(spec.request_id, span, exc)
            raise
        self.metrics.in_flight.inc()
        return generation

    def _abandon(self, request_id: str, span: Span, exc: BaseException) -> None:
        """A request that never became a Generation: close its route and its span."""
        self.router.close(request_id)
        if self.federation is not None:
            self.federation.finished(request_id)
        if isinstance(exc, ApiError):
            outcome = f"rejected_{exc.status}"
        else:  # a bug, or the request cancelled under us
            outcome = "error"
            span.record_exception(exc)
            span.set_status(Status(StatusCode.ERROR, f"{type(exc).__name__}: {exc}"))
        self.metrics.requests.labels(outcome=outcome).inc()
        span.set_attribute("switchyard.outcome", outcome)
        span.end()

    def _assembler(
        self, sampling: SamplingParams, stops: list[str], tools: ToolPlan | None, include_stop: bool
    ) -> TextAssembler:
        """Text as the client gets it. EOS and the stop tokens end the output without text of
        their own; special tokens are kept when the tool-call parser reads some as markers."""
        keep_special = tools is not None and tools.keeps_special_tokens
        return TextAssembler(
            self.tokenizer.decode_stream(skip_special_tokens=not keep_special),
            stops,
            stop_token_ids=frozenset([*sampling.stop_token_ids, self.tokenizer.info.eos_token_id]),
            include_stop=include_stop,
        )

    def _spec(
        self,
        kind: Kind,
        sampling: SamplingParams,
        prompt: list[int],
        tenant: str,
        session: str | None,
        priority: int,
        deadline_s: float | None,
    ) -> RequestSpec:
        prefix = "chatcmpl" if kind == "chat" else "cmpl"
        keys = self.key_scheme.keys(prompt, self.config.block_size, tenant, self.model)
        return RequestSpec(
            request_id=f"{prefix}-{uuid.uuid4().hex}",
            ingress_id=self.ingress_id,
            model=self.model,
            prompt_tokens=prompt,
            block_size=self.config.block_size,
            block_keys=cast("list[int]", keys),  # a BlockKey is an int
            sampling=sampling,
            tenant=tenant,
            session=session,
            priority=priority,
            deadline_s=deadline_s,
        )

    async def _submit(self, spec: RequestSpec, ctx) -> None:
        """To the scheduler; federated, to the region ``ingress.federation`` routes it to, and
        on to the next best region while one refuses it (overloaded, or no scheduler there)."""
        federation = self.federation
        if federation is None:
            return await self._submit_to(subjects.SUBMIT, spec, ctx)
        refused: dict[str, ApiError] = {}
        while True:
            route = federation.route(spec, frozenset(refused))
            if route.region in refused:  # no region left that did not refuse it
                raise refused[route.region]
            self.metrics.region_routes.labels(region=route.region, reason=route.reason).inc()
            try:
                await self._submit_to(federation.submit_subject(route.region), spec, ctx)
            except (RateLimited, Unavailable) as refusal:
                log.info("%s: region %s refused it (%s)", spec.request_id, route.region, refusal.message)
                refused[route.region] = refusal
                continue
            await federation.placed(spec, route.region)
            return

    async def _submit_to(self, subject: str, spec: RequestSpec, ctx) -> None:
        payload = codec.SCHEDULER_REQUEST.encode(SubmitRequest(spec=spec))
        try:
            msg = await self.nc.request(
                subject, payload, timeout=self.config.submit_timeout_s, headers=tracing.inject(ctx)
            )
        except NoRespondersError:
            raise Unavailable("No scheduler is running.", retry_after_s=1.0) from None
        except NatsTimeout:
            raise Unavailable("The scheduler did not answer in time.", retry_after_s=1.0) from None
        match codec.SCHEDULER_REPLY.decode(msg.data):
            case Admitted():
                return
            case Rejected(reason="overloaded", message=message, retry_after_s=wait):
                raise RateLimited(message, code="overloaded", retry_after_s=wait)
            case Rejected(reason="no_workers", message=message, retry_after_s=wait):
                raise Unavailable(message, code="no_workers", retry_after_s=wait)
            case Rejected(message=message):
                raise InvalidRequest(message)
            case other:
                raise ApiError(f"unexpected scheduler reply {type(other).__name__}")


def continuation_spec(spec: RequestSpec, output: list[int], *, key_scheme: KeyScheme) -> RequestSpec:
    """``spec`` to run again after ``output``, the tokens its client has (a migration): they
    join the prompt, its blocks keyed anew (the original prompt's keys are a prefix, so the
    placement finds its cache), and only the rest of ``max_tokens`` is left to generate. The
    deadline for the first token was met once already."""
    assert spec.resume_from == 0, "a continuation is built from the client's own spec"
    prompt = [*spec.prompt_tokens, *output]
    keys = key_scheme.keys(prompt, spec.block_size, spec.tenant, spec.model)
    return msgspec.structs.replace(
        spec,
        prompt_tokens=prompt,
        block_keys=cast("list[int]", keys),
        sampling=msgspec.structs.replace(
            spec.sampling,
            max_tokens=spec.sampling.max_tokens - len(output),
            min_tokens=max(0, spec.sampling.min_tokens - len(output)),
        ),
        deadline_s=None,
        resume_from=len(output),
    )


def _prompt_list(prompt: str | list[str | int | list[int]]) -> list[str | list[int]]:
    """A completions ``prompt`` as its prompts: a text, token ids, or a list of either."""
    if isinstance(prompt, str):
        return [prompt]
    if prompt and all(isinstance(p, int) for p in prompt):
        return [cast("list[int]", prompt)]
    if prompt and (all(isinstance(p, str) for p in prompt) or all(isinstance(p, list) for p in prompt)):
        return cast("list[str | list[int]]", list(prompt))
    raise InvalidRequest(
        "`prompt` must be a string, a list of token ids, or a non-empty list of prompts: all strings, "
        "or all lists of token ids.",
        param="prompt",
    )


def _session(value: str | None) -> str | None:
    if value is None:
        return None
    if not 0 < len(value) <= SESSION_MAX_BYTES:  # header values arrive as latin-1: a character is a byte
        raise InvalidRequest(f"Header {SESSION_HEADER} is {len(value)} bytes; it must be 1 to {SESSION_MAX_BYTES}.")
    if not _SESSION_RE.fullmatch(value):
        raise InvalidRequest(f"Header {SESSION_HEADER} must be printable ASCII.")
    return value


def _priority(value: str | None) -> int:
    if value is None:
        return 0
    if value in _PRIORITIES:
        return _PRIORITIES[value]
    if value.isdigit() and int(value) <= 9:
        return int(value)
    raise InvalidRequest(f"Header {PRIORITY_HEADER} must be interactive, batch or 0-9, got {value!r}.")


def _deadline(value: str | None) -> float | None:
    if value is None:
        return None
    try:
        deadline = float(value)
    except ValueError:
        deadline = -1.0
    if not 0 < deadline < 86_400:
        raise InvalidRequest(f"Header {DEADLINE_HEADER} must be seconds in (0, 86400), got {value!r}.")
    return deadline


async def _api_error(request: Request, exc: ApiError) -> Response:
    return Response(exc.encoded(), status_code=exc.status, headers=exc.headers(), media_type="application/json")


async def _internal_error(request: Request, exc: Exception) -> Response:
    log.error("%s %s failed unexpectedly", request.method, request.url.path, exc_info=exc)
    error = internal_error()
    return Response(error.encoded(), status_code=error.status, media_type="application/json")


async def _http_error(request: Request, exc: HTTPException) -> Response:
    error = ApiError(exc.detail or "error", code=str(exc.status_code))
    error.status = exc.status_code
    error.type = "invalid_request_error" if exc.status_code < 500 else "server_error"
    return Response(error.encoded(), status_code=exc.status_code, media_type="application/json")


# Starlette types every handler as taking any Exception; each of ours takes the class it is keyed by.
_HANDLERS: dict[Any, Callable[..., Awaitable[Response]]] = {
    ApiError: _api_error,
    HTTPException: _http_error,
    Exception: _internal_error,
}


def _cors(origins: str) -> list[Middleware]:
    """CORS for browsers on these origins (comma-separated; "*": any); none by default."""
    allowed = [o.strip() for o in origins.split(",") if o.strip()]
    if not allowed:
        return []
    return [
        Middleware(
            CORSMiddleware,
            allow_origins=allowed,
            allow_methods=["GET", "POST"],
            allow_headers=["authorization", "content-type", "x-request-id", "x-session-affinity", REGION_HEADER],
            expose_headers=["x-request-id", "retry-after"],
        )
    ]
