"""Mid-stream migration without a bus: the continuation spec the ingress builds, and the
workers numbering and producing a continued request's output exactly as an undisturbed run."""

from __future__ import annotations

import functools
from pathlib import Path

import anyio.lowlevel
import msgspec
import pytest
from nats.errors import ConnectionClosedError
from opentelemetry.trace import INVALID_SPAN

import switchyard.workers.sim as sim
from switchyard.ingress.app import continuation_spec
from switchyard.ingress.errors import ApiError, Unavailable
from switchyard.ingress.generation import Generation, GenerationContext
from switchyard.ingress.streams import Inbox, StreamFailed, StreamRouter
from switchyard.ingress.text import TextAssembler
from switchyard.ingress.tokenizer import ModelTokenizer
from switchyard.kvbus import KeyScheme
from switchyard.models import build_tokenizer
from switchyard.observability import ServingMetrics
from switchyard.schemas import (
    Cancel,
    DecodeTask,
    PrefillTask,
    PromptUsage,
    RequestSpec,
    SimKvHandle,
    StreamChunk,
    StreamError,
    codec,
    subjects,
)
from switchyard.workers.engine import PrefillResult
from switchyard.workers.handoff import first_token
from switchyard.workers.sim import SimEngine, SimEngineConfig
from tests.support.factories import make_spec

BLAKE = KeyScheme("blake2b", "vllm-none-hash")
SIM_TINY = Path(build_tokenizer.__file__).parent / "sim-tiny"


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture(autouse=True)
def instant(monkeypatch: pytest.MonkeyPatch) -> None:
    async def no_sleep(seconds: float) -> None:
        await anyio.lowlevel.checkpoint()

    monkeypatch.setattr(sim.anyio, "sleep", no_sleep)


async def run_to_end(spec: RequestSpec, worker: str) -> list[int]:
    """Every output token of ``spec``: prefill on one sim engine, decode on another."""
    prefill, decode = SimEngine(SimEngineConfig(), f"{worker}-p"), SimEngine(SimEngineConfig(), f"{worker}-d")
    (result,) = await prefill.prefill([PrefillTask(spec=spec, queued_s=0.0)])
    handle = SimKvHandle(worker_id=f"{worker}-p", block_keys=spec.block_keys, num_tokens=len(spec.prompt_tokens))
    usage = PromptUsage(prompt_tokens=len(spec.prompt_tokens), cached_tokens=0)
    tokens = [result.first_token]
    if spec.sampling.max_tokens == 1:
        return tokens  # token 0 was all it asked for: no decode follows
    decode.add(DecodeTask(spec=spec, handle=handle, first_token=result.first_token, usage=usage))
    while decode.running:
        tokens += [out.token for out in await decode.step() if out.token is not None]
    return tokens


def test_continuation_carries_the_output_and_what_is_left() -> None:
    spec = make_spec(prompt_len=40, max_tokens=10, deadline_s=2.0)
    output = [300 + i for i in range(7)]
    cont = continuation_spec(spec, output, key_scheme=BLAKE)
    assert cont.request_id == spec.request_id and cont.ingress_id == spec.ingress_id
    assert cont.prompt_tokens == spec.prompt_tokens + output
    assert cont.resume_from == 7 and cont.sampling.max_tokens == 3
    assert cont.sampling.temperature == spec.sampling.temperature and cont.deadline_s is None
    assert cont.block_keys == BLAKE.keys(cont.prompt_tokens, spec.block_size, spec.tenant, spec.model)
    assert len(cont.block_keys) == 47 // spec.block_size
    assert cont.block_keys[: len(spec.block_keys)] == spec.block_keys  # the cached prefix is found


@pytest.mark.anyio
@pytest.mark.parametrize("delivered", [1, 5, 11])
async def test_sim_continues_the_undisturbed_output(delivered: int) -> None:
    spec = make_spec("greedy-m", prompt_len=37, max_tokens=12)
    undisturbed = await run_to_end(spec, "a")
    assert len(undisturbed) == 12
    cont = continuation_spec(spec, undisturbed[:delivered], key_scheme=BLAKE)
    assert await run_to_end(cont, "b") == undisturbed[delivered:]


@pytest.mark.anyio
async def test_sim_decode_numbers_a_continuation_from_where_the_client_left_off() -> None:
    spec = make_spec(prompt_len=20, max_tokens=6)
    cont = continuation_spec(spec, [400, 401], key_scheme=BLAKE)
    eng = SimEngine(SimEngineConfig(), "d")
    handle = SimKvHandle(worker_id="p", block_keys=cont.block_keys, num_tokens=len(cont.prompt_tokens))
    eng.add(DecodeTask(spec=cont, handle=handle, first_token=0, usage=PromptUsage(prompt_tokens=22, cached_tokens=0)))
    outputs = [out for _ in range(3) for out in await eng.step()]
    assert [o.position for o in outputs] == [3, 4, 5]
    assert outputs[-1].finished == "length" and not eng.running


def test_first_token_of_a_continuation_has_the_resumed_seq() -> None:
    cont = continuation_spec(make_spec(prompt_len=20, max_tokens=6), [400, 401, 402], key_scheme=BLAKE)
    handle = SimKvHandle(worker_id="p", block_keys=cont.block_keys, num_tokens=len(cont.prompt_tokens))
    result = PrefillResult(request_id=cont.request_id, first_token=403, cached_tokens=16, handle=handle, prefill_s=0.0)
    chunk, done = first_token("p", PrefillTask(spec=cont, queued_s=0.0), result)
    assert chunk.seq == 3 and chunk.token_ids == [403] and chunk.finish_reason is None
    assert not done.finished
    # The usage is of the prompt this run prefilled: the scheduler and the ingress count the
    # recomputed tokens from it.
    assert chunk.usage is not None and chunk.usage.prompt_tokens == 23 and chunk.usage.cached_tokens == 16


def test_last_token_left_ends_at_the_continuations_first_token() -> None:
    cont = continuation_spec(make_spec(prompt_len=20, max_tokens=4), [400, 401, 402], key_scheme=BLAKE)
    handle = SimKvHandle(worker_id="p", block_keys=cont.block_keys, num_tokens=len(cont.prompt_tokens))
    result = PrefillResult(request_id=cont.request_id, first_token=403, cached_tokens=0, handle=handle, prefill_s=0.0)
    chunk, done = first_token("p", PrefillTask(spec=cont, queued_s=0.0), result)
    assert (chunk.seq, chunk.finish_reason, done.finished) == (3, "length", True)


# --- the ingress's side: a Generation fed from its inbox, resubmitting through a fake --------


class _Scheduler:
    """Takes continuations; ``answer`` says what the new run streams, or what it refuses with."""

    def __init__(self, inbox: Inbox, answer: list[StreamChunk] | ApiError, refusals: int = 0) -> None:
        self.inbox, self.answer, self.refusals = inbox, answer, refusals
        self.submitted: list[RequestSpec] = []

    async def resubmit(self, spec: RequestSpec, ctx: object) -> None:
        self.submitted.append(spec)
        if len(self.submitted) <= self.refusals:
            raise Unavailable("no prefill worker is available", retry_after_s=1.0)
        if isinstance(self.answer, ApiError):
            raise self.answer
        for chunk in self.answer:
            self.inbox.put(chunk)


class _Bus:
    def __init__(self) -> None:
        self.published: list[tuple[str, bytes]] = []

    async def publish(self, subject: str, payload: bytes) -> None:
        self.published.append((subject, payload))


def _generation(
    spec: RequestSpec, scheduler_answer, max_migrations: int = 2, refusals: int = 0, wait_s: float = 0.0
) -> tuple[Generation, _Scheduler]:
    tokenizer = ModelTokenizer.load(SIM_TINY)
    inbox = Inbox(spec.request_id, 64)
    scheduler = _Scheduler(inbox, scheduler_answer, refusals)
    ctx = GenerationContext(
        nc=_Bus(),  # type: ignore[arg-type]  # publish is all a Generation does on it
        router=StreamRouter(),
        metrics=ServingMetrics(),
        continuation=functools.partial(continuation_spec, key_scheme=BLAKE),
        resubmit=scheduler.resubmit,
        max_migrations=max_migrations,
        migration_wait_s=wait_s,
    )
    generation = Generation(
        ctx=ctx,
        kind="completion",
        spec=spec,
        model=spec.model,
        stream=True,
        include_usage=True,
        assembler=TextAssembler(tokenizer.decode_stream(), []),
        inbox=inbox,
        span=INVALID_SPAN,
        arrived=0.0,
        more_assemblers=lambda: TextAssembler(tokenizer.decode_stream(), []),  # n > 1
    )
    return generation, scheduler


def _chunk(spec: RequestSpec, seq: int, tokens: list[int], finish=None, **kw) -> StreamChunk:
    return StreamChunk(request_id=spec.request_id, seq=seq, token_ids=tokens, finish_reason=finish, **kw)


LOST = StreamError(code="worker_lost", message="request r failed in decode: worker lost")
OUTPUT = [300 + i for i in range(8)]


async def _run(generation: Generation) -> str:
    parts: list[str] = []

    async def collect(choice, text: str, logprobs: dict | None) -> None:
        parts.append(text)

    await generation._generate(collect)
    return "".join(parts)


@pytest.mark.anyio
async def test_a_lost_stream_is_resubmitted_after_its_delivered_tokens_and_continues() -> None:
    spec = make_spec("r", prompt_len=20, max_tokens=8)
    usage = PromptUsage(prompt_tokens=20, cached_tokens=0)
    # The new run: its token 0 at seq 3, with the usage of the 23 tokens it prefilled (16 cached).
    again = PromptUsage(prompt_tokens=23, cached_tokens=16)
    rest = [_chunk(spec, 3, OUTPUT[3:4], usage=again), _chunk(spec, 4, OUTPUT[4:], "length")]
    generation, scheduler = _generation(spec, rest)
    # Two tokens and the failure in one batch: the tokens before it are delivered first.
    for chunk in (_chunk(spec, 0, OUTPUT[:1], usage=usage), _chunk(spec, 1, OUTPUT[1:3])):
        generation.inbox.put(chunk)
    generation.inbox.put(StreamChunk(request_id="r", seq=0, error=LOST))
    text = await _run(generation)
    (cont,) = scheduler.submitted
    assert cont.prompt_tokens == spec.prompt_tokens + OUTPUT[:3] and cont.resume_from == 3 and cont.attempt == 1
    assert cont.sampling.max_tokens == 5
    assert generation.output == OUTPUT and generation.assembler.tokens == 8
    assert text == ModelTokenizer.load(SIM_TINY).decode(OUTPUT)
    assert generation.finish_reason == "length" and generation.usage()["completion_tokens"] == 8
    assert generation.usage()["prompt_tokens"] == 20  # the client's prompt, not the continuation's
    assert (generation.migrations, generation.recomputed_tokens) == (1, 7)
    assert generation.ctx.metrics.migrations.labels(outcome="resumed")._value.get() == 1
    # The lost run is cancelled first, that run only: the next one (attempt 1) is not covered.
    ((subject, payload),) = generation.ctx.nc.published
    assert subject == subjects.CANCEL and codec.CANCEL.decode(payload) == Cancel(
        request_id="r", reason="worker_lost", attempt=0
    )


@pytest.mark.anyio
@pytest.mark.parametrize(
    ("max_migrations", "answer", "outcome", "message"),
    [
        (0, [], "exhausted", "worker lost"),
        (2, Unavailable("no decode worker is available"), "refused", "could not continue elsewhere"),
    ],
)
async def test_a_stream_that_cannot_migrate_ends_with_the_error(max_migrations, answer, outcome, message) -> None:
    spec = make_spec("r", prompt_len=20, max_tokens=8)
    generation, scheduler = _generation(spec, answer, max_migrations=max_migrations)
    generation.inbox.put(_chunk(spec, 0, OUTPUT[:2], usage=PromptUsage(prompt_tokens=20, cached_tokens=0)))
    generation.inbox.put(StreamChunk(request_id="r", seq=0, error=LOST))
    with pytest.raises(StreamFailed, match=message) as failed:
        await _run(generation)
    assert failed.value.error.code == "worker_lost"
    assert generation.output == OUTPUT[:2]
    assert len(scheduler.submitted) == min(max_migrations, 1)
    assert generation.ctx.metrics.migrations.labels(outcome=outcome)._value.get() == 1


@pytest.mark.anyio
async def test_a_stream_lost_before_its_first_token_is_submitted_again_as_it_was() -> None:
    spec = make_spec("r", prompt_len=20, max_tokens=8)
    usage = PromptUsage(prompt_tokens=20, cached_tokens=0)
    generation, scheduler = _generation(
        spec, [_chunk(spec, 0, OUTPUT[:1], usage=usage), _chunk(spec, 1, OUTPUT[1:], "length")]
    )
    generation.inbox.put(StreamChunk(request_id="r", seq=0, error=LOST))
    assert await _run(generation) == ModelTokenizer.load(SIM_TINY).decode(OUTPUT)
    (retry,) = scheduler.submitted
    assert retry == msgspec.structs.replace(spec, attempt=1)  # same prompt, nothing to resume
    assert (generation.migrations, generation.recomputed_tokens) == (1, 0)


@pytest.mark.anyio
async def test_a_prefill_lost_after_token_0_continues_after_it_without_sampling_it_again() -> None:
    spec = make_spec("r", prompt_len=20, max_tokens=8)
    usage = PromptUsage(prompt_tokens=20, cached_tokens=0)
    generation, scheduler = _generation(spec, [_chunk(spec, 1, OUTPUT[1:], "length", usage=usage)])
    generation.inbox.put(_chunk(spec, 0, OUTPUT[:1], usage=usage))  # token 0, then its worker died
    generation.inbox.put(StreamChunk(request_id="r", seq=0, error=LOST))
    await _run(generation)
    (cont,) = scheduler.submitted
    assert cont.prompt_tokens == spec.prompt_tokens + OUTPUT[:1] and cont.resume_from == 1 and cont.attempt == 1
    assert generation.output == OUTPUT


@pytest.mark.anyio
async def test_a_migration_waits_a_while_for_a_worker_of_the_role_to_be_back() -> None:
    spec = make_spec("r", prompt_len=20, max_tokens=8)
    rest = [_chunk(spec, 2, OUTPUT[2:], "length", usage=PromptUsage(prompt_tokens=22, cached_tokens=0))]
    generation, scheduler = _generation(spec, rest, refusals=3, wait_s=60.0)
    generation.inbox.put(_chunk(spec, 0, OUTPUT[:2]))
    generation.inbox.put(StreamChunk(request_id="r", seq=0, error=LOST))
    await _run(generation)
    assert len(scheduler.submitted) == 4 and generation.output == OUTPUT  # three 503s, then served


@pytest.mark.anyio
async def test_an_error_of_the_request_itself_is_not_migrated() -> None:
    spec = make_spec("r", prompt_len=20, max_tokens=8)
    generation, scheduler = _generation(spec, [])
    generation.inbox.put(_chunk(spec, 0, OUTPUT[:2]))
    generation.inbox.put(StreamChunk(request_id="r", seq=0, error=StreamError(code="prefill_failed", message="m")))
    with pytest.raises(StreamFailed):
        await _run(generation)
    assert scheduler.submitted == []


@pytest.mark.anyio
async def test_an_error_fails_the_request_even_after_the_choice_it_names_finished() -> None:
    """The router fails a stream with an error chunk of choice 0 (an overflow, a dark
    region). With n = 2 and choice 0 done, that chunk was skipped as late news of a finished
    choice, choice 1 never came, and the client waited for ever."""
    spec = make_spec("r", prompt_len=20, max_tokens=2)
    spec = msgspec.structs.replace(spec, sampling=msgspec.structs.replace(spec.sampling, n=2, temperature=1.0))
    generation, _ = _generation(spec, [])
    usage = PromptUsage(prompt_tokens=20, cached_tokens=0)
    generation.inbox.put(_chunk(spec, 0, OUTPUT[:1], usage=usage))
    generation.inbox.put(_chunk(spec, 1, OUTPUT[1:2], "length"))  # choice 0: done
    generation.inbox.put(_chunk(spec, 0, OUTPUT[2:3], index=1))  # choice 1: one token of two
    generation.inbox.fail("overflow", "the token stream overflowed")
    with anyio.fail_after(5), pytest.raises(StreamFailed, match="overflowed"):
        await _run(generation)


class _ClosedBus:
    async def publish(self, subject: str, payload: bytes) -> None:
        raise ConnectionClosedError


@pytest.mark.anyio
async def test_cleanup_goes_on_when_the_bus_closed_under_it() -> None:
    """An ingress stopping (SIGTERM) while a stream waits for its migration: the cancel of the
    unfinished run met a closed connection, and the raise skipped the request's metrics,
    span and usage record, and reached the client as a dropped connection."""
    spec = make_spec("r", prompt_len=20, max_tokens=8)
    generation, _ = _generation(spec, [])
    generation.ctx.nc = _ClosedBus()  # type: ignore[assignment]
    ended: list[str] = []
    generation.ctx.on_finished = lambda g, outcome: ended.append(outcome)
    generation.ctx.metrics.in_flight.inc()
    await generation._cleanup()
    assert ended == ["error"] and generation.ctx.metrics.in_flight._value.get() == 0
