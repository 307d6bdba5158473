"""Ingress logic without a bus: token sequencing, stop strings, OpenAI body checks."""

from __future__ import annotations

import random
import time
from pathlib import Path

import msgspec
import pytest

from switchyard.ingress.errors import InvalidRequest
from switchyard.ingress.openai_types import (
    MAX_STOPS,
    ChatCompletionRequest,
    CompletionRequest,
    chat_messages,
    check_sampling,
    decode_body,
    stop_strings,
)
from switchyard.ingress.streams import StreamFailed, TokenSequencer
from switchyard.ingress.text import TextAssembler
from switchyard.ingress.tokenizer import ModelTokenizer
from switchyard.models import build_tokenizer
from switchyard.schemas import PromptUsage, StreamChunk, StreamError

SIM_TINY = Path(build_tokenizer.__file__).parent / "sim-tiny"
USAGE = PromptUsage(prompt_tokens=10, cached_tokens=0)


def chunk(seq: int, tokens: list[int], finish: str | None = None, **kw) -> StreamChunk:
    return StreamChunk(request_id="r", seq=seq, token_ids=tokens, finish_reason=finish, **kw)


# --- TokenSequencer ---------------------------------------------------------------------------


def test_in_order_chunks_pass_through() -> None:
    s = TokenSequencer()
    assert s.feed(chunk(0, [10], usage=USAGE)) == [10]
    assert s.feed(chunk(1, [11, 12])) == [11, 12]
    assert s.feed(chunk(3, [13], "length")) == [13]
    assert s.finished and s.finish_reason == "length" and s.next_seq == 4
    assert s.usage == USAGE


def test_out_of_order_chunks_are_held_until_the_gap_fills() -> None:
    s = TokenSequencer()
    assert s.feed(chunk(2, [12])) == []
    assert s.feed(chunk(3, [13], "stop")) == []
    assert not s.finished
    assert s.feed(chunk(1, [11])) == []
    assert s.feed(chunk(0, [10])) == [10, 11, 12, 13]
    assert s.finish_reason == "stop"


def test_duplicates_are_dropped() -> None:
    s = TokenSequencer()
    assert s.feed(chunk(0, [10], usage=USAGE)) == [10]
    # A retried prefill sends token 0 again, with its own usage: neither shows twice.
    assert s.feed(chunk(0, [10], usage=PromptUsage(prompt_tokens=10, cached_tokens=8))) == []
    assert s.usage == USAGE
    assert s.feed(chunk(1, [11])) == [11]
    assert s.feed(chunk(1, [11])) == []
    assert s.next_seq == 2


def test_overlapping_chunks_yield_only_the_new_tail() -> None:
    s = TokenSequencer()
    assert s.feed(chunk(0, [10, 11, 12])) == [10, 11, 12]
    assert s.feed(chunk(1, [11, 12, 13, 14])) == [13, 14]
    assert s.feed(chunk(2, [12, 13])) == []
    assert s.feed(chunk(4, [14, 15], "length")) == [15]
    assert s.next_seq == 6


def test_held_chunk_overlapped_by_the_gap_filler() -> None:
    s = TokenSequencer()
    assert s.feed(chunk(2, [12, 13])) == []
    assert s.feed(chunk(0, [10, 11, 12])) == [10, 11, 12, 13]


def test_nothing_after_finish() -> None:
    s = TokenSequencer()
    assert s.feed(chunk(0, [10], "length")) == [10]
    assert s.feed(chunk(1, [11])) == []
    assert s.finish_reason == "length" and s.next_seq == 1


def test_finish_on_an_already_seen_position_still_finishes() -> None:
    s = TokenSequencer()
    assert s.feed(chunk(0, [10, 11])) == [10, 11]
    assert s.feed(chunk(1, [11], "stop")) == []
    assert s.finish_reason == "stop"


def test_error_chunk_raises_stream_failed_even_out_of_order() -> None:
    s = TokenSequencer()
    s.feed(chunk(0, [10]))
    error = StreamError(code="worker_lost", message="decode worker d1 is gone")
    with pytest.raises(StreamFailed, match="d1 is gone") as caught:
        s.feed(chunk(7, [], error=error))
    assert caught.value.error == error


def test_shuffled_single_token_chunks_with_duplicates_come_out_in_order() -> None:
    seed = 7
    print(f"seed={seed}")
    rng = random.Random(seed)
    n = 60
    chunks = [chunk(i, [100 + i], "length" if i == n - 1 else None) for i in range(n)]
    chunks += rng.sample(chunks, 20)  # duplicates
    rng.shuffle(chunks)
    s = TokenSequencer()
    out = [t for c in chunks for t in s.feed(c)]
    assert out == [100 + i for i in range(n)]
    assert s.finished


def test_a_longer_chunk_at_a_held_seq_is_not_lost() -> None:
    s = TokenSequencer()
    assert s.feed(chunk(1, [11])) == []
    assert s.feed(chunk(1, [11, 12], "length")) == []  # another publisher, batched differently
    assert s.feed(chunk(0, [10])) == [10, 11, 12]
    assert s.finished


# --- TextAssembler --------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tok() -> ModelTokenizer:
    return ModelTokenizer.load(SIM_TINY)


def stream_text(tok: ModelTokenizer, text: str, stops: list[str]) -> tuple[list[str], str, TextAssembler]:
    """Push ``text`` token by token; return what each push released, the finish, the assembler."""
    assembler = TextAssembler(tok.decode_stream(), stops)
    pushed = [assembler.push([t]) for t in tok.encode(text)]
    return pushed, assembler.finish(), assembler


def test_no_stops_releases_everything(tok: ModelTokenizer) -> None:
    text = "Hello there, general Kenobi. 日本語 😀!"
    pushed, tail, assembler = stream_text(tok, text, [])
    assert "".join(pushed) + tail == text
    assert tail == ""  # nothing is held back without stop strings
    assert not assembler.stopped and assembler.tokens == len(tok.encode(text))


def test_text_up_to_the_stop_is_exact_and_the_stop_never_shows(tok: ModelTokenizer) -> None:
    text = "The answer is 42.\nEND of the answer, more text after"
    pushed, tail, assembler = stream_text(tok, text, ["\nEND"])
    assert "".join(pushed) + tail == "The answer is 42."
    assert assembler.stopped
    released = ""
    for piece in pushed:
        released += piece
        assert "The answer is 42.".startswith(released), f"released past the stop: {released!r}"


def test_a_partial_stop_is_held_back_until_it_is_clearly_not_one(tok: ModelTokenizer) -> None:
    assembler = TextAssembler(tok.decode_stream(), ["STOP"])
    released = "".join(assembler.push([t]) for t in tok.encode("go ST"))
    assert not released.endswith(("S", "ST")), released
    assert released + assembler.push(tok.encode("OCK")) + assembler.finish() == "go STOCK"
    assert not assembler.stopped


def test_a_stop_split_across_tokens_is_caught(tok: ModelTokenizer) -> None:
    text = "abc<<<stop>>>def"
    ids = tok.encode(text)
    assert len(ids) > 3
    assembler = TextAssembler(tok.decode_stream(), ["<<<stop>>>"])
    out = "".join(assembler.push([t]) for t in ids) + assembler.finish()
    assert out == "abc" and assembler.stopped


def test_earliest_of_several_stops_wins(tok: ModelTokenizer) -> None:
    text = "one two three four"
    # Both stops arrive in the same push; "two" starts first.
    assembler = TextAssembler(tok.decode_stream(), ["four", "two", "three"])
    assert assembler.push(tok.encode(text)) + assembler.finish() == "one "
    assert assembler.stopped


def test_tokens_after_the_stop_are_ignored(tok: ModelTokenizer) -> None:
    assembler = TextAssembler(tok.decode_stream(), ["."])
    out = assembler.push(tok.encode("Hi. more"))
    assert out == "Hi" and assembler.stopped
    counted = assembler.tokens
    assert assembler.push(tok.encode(" even more")) == ""
    assert assembler.finish() == "" and assembler.tokens == counted


def test_stop_found_only_at_finish(tok: ModelTokenizer) -> None:
    pushed, tail, assembler = stream_text(tok, "abc xyz", ["xyz!", "yz"])
    assert "".join(pushed) + tail == "abc x" and assembler.stopped


def stop_oracle(tok: ModelTokenizer, ids: list[int], stops: list[str]) -> tuple[str, bool]:
    """Generation stops after the first token whose text completes a stop string; the
    output is the whole text so far, cut before the earliest stop it contains."""
    decoder, text = tok.decode_stream(), ""
    for token in [*ids, None]:
        text += decoder.push(token) if token is not None else decoder.flush()
        hits = [i for i in (text.find(s) for s in stops) if i >= 0]
        if hits:
            return text[: min(hits)], True
    return text, False


def test_random_texts_and_stops_match_the_unbuffered_oracle(tok: ModelTokenizer) -> None:
    seed = 20240611
    print(f"seed={seed}")
    rng = random.Random(seed)
    words = ["the", " cat", " sat", ".", "\n", " 日本", "語", " 😀", "STOP", " ab", "c", "!!", " é"]
    for _ in range(150):
        text = "".join(rng.choice(words) for _ in range(rng.randint(1, 25)))
        stops = []
        for _ in range(rng.randint(0, 3)):
            if rng.random() < 0.7:
                start = rng.randrange(len(text))
                stops.append(text[start : start + rng.randint(1, 6)])
            else:
                stops.append(rng.choice(["zz", "qq!", "\t"]))
        ids = tok.encode(text)
        expected, stopped = stop_oracle(tok, ids, stops)
        assembler = TextAssembler(tok.decode_stream(), stops)
        released, i = "", 0
        while i < len(ids):  # tokens arrive in chunks of random size
            n = rng.randint(1, 4)
            released += assembler.push(ids[i : i + n])
            assert expected.startswith(released), (text, stops, released)
            i += n
        assert released + assembler.finish() == expected, (text, stops)
        assert assembler.stopped == stopped, (text, stops)


# --- OpenAI bodies ------------------------------------------------------------------------


def body(**fields) -> bytes:
    return msgspec.json.encode({"model": "switchyard-sim", **fields})


def chat(**fields) -> ChatCompletionRequest:
    fields.setdefault("messages", [{"role": "user", "content": "hi"}])
    return decode_body(body(**fields), ChatCompletionRequest)  # type: ignore[return-value]


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"messages": [], "max_tokens": "ten"}, "max_tokens"),
        ({"messages": [], "temperature": "hot"}, "temperature"),
        ({"messages": [{"role": 3}]}, "messages[0].role"),
        ({"messages": [{"role": "user", "content": [{"type": "text", "text": 5}]}]}, "messages[0].content[0].text"),
        ({"messages": [], "stream_options": {"include_usage": "yes"}}, "stream_options.include_usage"),
    ],
)
def test_decode_body_names_the_wrong_param(fields: dict, param: str) -> None:
    with pytest.raises(InvalidRequest) as caught:
        decode_body(body(**fields), ChatCompletionRequest)
    assert caught.value.param == param
    assert caught.value.status == 400


def test_decode_body_ignores_unknown_fields() -> None:
    """Unknown and no-effect fields; those that would change the output: tests/unit/test_fields.py."""
    request = chat(frobnicate={"1": 2}, user="u", max_tokens=7)
    assert isinstance(request, ChatCompletionRequest) and request.max_tokens == 7


@pytest.mark.parametrize("raw", [b"", b"   \n", b"{not json", b'{"model": '])
def test_decode_body_empty_or_malformed(raw: bytes) -> None:
    with pytest.raises(InvalidRequest) as caught:
        decode_body(raw, ChatCompletionRequest)
    assert caught.value.param is None
    assert "empty" in caught.value.message or "not valid JSON" in caught.value.message


def test_completion_prompt_forms() -> None:
    for prompt in ("text", ["a", "b"], [1, 2, 3]):
        request = decode_body(body(prompt=prompt), CompletionRequest)
        assert request.prompt == prompt  # type: ignore[attr-defined]


def test_decode_body_names_a_missing_required_param() -> None:
    with pytest.raises(InvalidRequest) as caught:
        decode_body(msgspec.json.encode({"messages": []}), ChatCompletionRequest)
    assert caught.value.param == "model"
    with pytest.raises(InvalidRequest) as caught:
        decode_body(body(messages=[{"content": "hi"}]), ChatCompletionRequest)
    assert caught.value.param == "messages[0].role"


def test_chat_messages_flatten_text_parts() -> None:
    request = chat(
        messages=[
            {"role": "developer", "content": "Be brief."},
            {"role": "user", "content": [{"type": "text", "text": "Hello, "}, {"type": "text", "text": "world"}]},
            {"role": "assistant", "content": None},
            {"role": "tool", "content": "42", "tool_call_id": "call_1"},
        ]
    )
    assert chat_messages(request) == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hello, world"},
        {"role": "assistant", "content": ""},
        {"role": "tool", "content": "42", "tool_call_id": "call_1"},
    ]


def test_chat_messages_carry_tool_calls_with_their_arguments_as_objects() -> None:
    call = {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": '{"city": "Paris"}'}}
    request = chat(
        messages=[
            {"role": "user", "content": "Weather?"},
            {"role": "assistant", "content": None, "tool_calls": [call]},
            {"role": "tool", "content": "sunny", "tool_call_id": "call_1", "name": "f"},
        ]
    )
    rendered = chat_messages(request)
    assert rendered[1]["tool_calls"] == [
        {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": {"city": "Paris"}}}
    ]
    assert rendered[2] == {"role": "tool", "content": "sunny", "tool_call_id": "call_1", "name": "f"}


@pytest.mark.parametrize(
    ("messages", "param"),
    [
        ([{"role": "tool", "content": "42"}], "messages[0].tool_call_id"),
        (
            [
                {
                    "role": "user",
                    "content": "x",
                    "tool_calls": [{"id": "c", "function": {"name": "f", "arguments": "{}"}}],
                }
            ],
            "messages[0].tool_calls",
        ),
        (
            [{"role": "assistant", "tool_calls": [{"id": "c", "function": {"name": "f", "arguments": "{oops"}}]}],
            "messages[0].tool_calls[0].function.arguments",
        ),
    ],
)
def test_malformed_tool_messages_are_a_400_naming_the_field(messages, param) -> None:
    with pytest.raises(InvalidRequest) as caught:
        chat_messages(chat(messages=messages))
    assert caught.value.param == param


@pytest.mark.parametrize(
    ("part", "param", "says"),
    [
        ({"type": "image_url", "image_url": {"url": "http://x/cat.png"}}, "messages[1].content[1]", "not supported"),
        ({"type": "text"}, "messages[1].content[1].text", "`text` field"),  # a text part without text
    ],
)
def test_chat_messages_refuse_non_text_parts(part: dict, param: str, says: str) -> None:
    request = chat(
        messages=[
            {"role": "system", "content": "x"},
            {"role": "user", "content": [{"type": "text", "text": "see"}, part]},
        ]
    )
    with pytest.raises(InvalidRequest) as caught:
        chat_messages(request)
    assert caught.value.param == param
    assert says in caught.value.message


def test_chat_messages_refuse_unknown_roles_and_empty_lists() -> None:
    with pytest.raises(InvalidRequest) as caught:
        chat_messages(chat(messages=[{"role": "user", "content": "a"}, {"role": "wizard", "content": "b"}]))
    assert caught.value.param == "messages[1].role"
    with pytest.raises(InvalidRequest) as caught:
        chat_messages(chat(messages=[]))
    assert caught.value.param == "messages"


def test_stop_strings_forms_and_limits() -> None:
    assert stop_strings(None) == []
    assert stop_strings("END") == ["END"]
    assert stop_strings(["a", "b"]) == ["a", "b"]
    assert stop_strings(["s"] * MAX_STOPS) == ["s"] * MAX_STOPS
    with pytest.raises(InvalidRequest) as caught:
        stop_strings(["s"] * (MAX_STOPS + 1))
    assert caught.value.param == "stop"
    for empty in ("", ["ok", ""]):
        with pytest.raises(InvalidRequest, match="empty") as caught:
            stop_strings(empty)
        assert caught.value.param == "stop"


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"temperature": 2.5}, "temperature"),
        ({"temperature": -0.1}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"stream_options": {"include_usage": True}}, "stream_options"),
    ],
)
def test_check_sampling_refuses(fields: dict, param: str) -> None:
    with pytest.raises(InvalidRequest) as caught:
        check_sampling(chat(**fields))
    assert caught.value.param == param


def test_check_sampling_accepts_the_edges() -> None:
    for fields in (
        {},
        {"n": 1, "temperature": 0.0, "top_p": 1.0},
        {"temperature": 2.0, "top_p": 0.01},
        {"stream": True, "stream_options": {"include_usage": True}},
    ):
        check_sampling(chat(**fields))  # raises on failure


# --- StreamRouter: bounded inboxes, idle expiry -------------------------------------------------

from switchyard.ingress.streams import StreamRouter  # noqa: E402
from switchyard.schemas import StreamBatch  # noqa: E402

SCHEDULER = "scheduler"  # subjects.SCHEDULER_SENDER


def _assign(router: StreamRouter, request_id: str, worker: str = "w") -> None:
    router.route(StreamChunk(request_id=request_id, seq=0, assigned=worker), SCHEDULER)


def _route_all(router: StreamRouter, *chunks, sender: str = "w") -> None:
    for c in chunks:
        router.route(c, sender)


def test_router_delivers_to_the_open_inbox_only() -> None:
    router = StreamRouter()
    inbox = router.open("r", max_tokens=4)
    _assign(router, "r")
    _route_all(
        router, StreamChunk(request_id="r", seq=0, token_ids=[1]), StreamChunk(request_id="other", seq=0, token_ids=[2])
    )
    assert [c.token_ids for c in inbox.chunks] == [[1]]
    assert router.unroutable == 1
    router.close("r")
    _route_all(router, StreamChunk(request_id="r", seq=1, token_ids=[3]))
    assert len(inbox.chunks) == 1 and router.unroutable == 2 and len(router) == 0


def test_router_fails_an_overflowing_stream_instead_of_growing() -> None:
    router = StreamRouter()
    inbox = router.open("r", max_tokens=2)
    _assign(router, "r")
    for i in range(inbox.limit + 5):
        router.route(StreamChunk(request_id="r", seq=i, token_ids=[i]), "w")
    assert router.overflows == 1 and len(router) == 0
    assert len(inbox.chunks) == inbox.limit + 1
    assert inbox.chunks[-1].error is not None and inbox.chunks[-1].error.code == "overflow"


def test_router_makes_room_for_every_choice() -> None:
    """n = 128 two-token answers: each choice sends its own chunks (a 2-token request's
    room alone overflowed at once, and the request was failed)."""
    router = StreamRouter()
    inbox = router.open("r", max_tokens=2, choices=128)
    _assign(router, "r")
    for index in range(128):
        for seq in range(2):  # token 0 with its usage, then token 1: one chunk each
            router.route(StreamChunk(request_id="r", seq=seq, token_ids=[seq], index=index), "w")
    assert router.overflows == 0 and len(inbox.chunks) == 256


def test_router_takes_chunks_only_from_the_workers_assigned() -> None:
    router = StreamRouter()
    inbox = router.open("r", max_tokens=8)
    _assign(router, "r", "prefill-0")
    _route_all(router, StreamChunk(request_id="r", seq=0, token_ids=[1]), sender="prefill-0")
    _route_all(router, StreamChunk(request_id="r", seq=1, token_ids=[66]), sender="intruder")
    assert [c.token_ids for c in inbox.chunks] == [[1]]  # held: it might be assigned yet
    _assign(router, "r", "decode-0")
    _route_all(router, StreamChunk(request_id="r", seq=1, token_ids=[2]), sender="decode-0")
    router.route(StreamChunk(request_id="r", seq=0, error=StreamError(code="x", message="m")), SCHEDULER)
    assert [c.token_ids for c in inbox.chunks] == [[1], [2], []]
    assert router.refused == 0
    router.close("r")  # the intruder was never assigned: its held chunk is refused
    assert router.refused == 1


def test_router_delivers_early_chunks_once_their_sender_is_assigned() -> None:
    """Across a NATS cluster a worker's token may overtake the scheduler's announcement."""
    router = StreamRouter()
    inbox = router.open("r", max_tokens=8)
    _route_all(router, StreamChunk(request_id="r", seq=0, token_ids=[7]), sender="prefill-1")
    assert not inbox.chunks
    _assign(router, "r", "prefill-1")
    assert [c.token_ids for c in inbox.chunks] == [[7]] and router.refused == 0


def test_router_holds_a_bounded_number_of_foreign_chunks() -> None:
    router = StreamRouter()
    router.open("r", max_tokens=1000)
    for i in range(100):
        router.route(StreamChunk(request_id="r", seq=i, token_ids=[i]), "intruder")
    assert router.refused == 100 - 32
    router.close("r")
    assert router.refused == 100


def test_a_migration_refuses_the_lost_runs_late_chunks() -> None:
    router = StreamRouter()
    inbox = router.open("r", max_tokens=8)
    _assign(router, "r", "decode-0")
    router.reassign(inbox)  # decode-0 was lost; the request is submitted again
    _route_all(router, StreamChunk(request_id="r", seq=3, token_ids=[9]), sender="decode-0")
    _assign(router, "r", "decode-1")
    _route_all(router, StreamChunk(request_id="r", seq=3, token_ids=[4]), sender="decode-1")
    assert [c.token_ids for c in inbox.chunks] == [[4]]
    router.close("r")
    assert router.refused == 1


def test_router_expires_silent_streams_only() -> None:
    router = StreamRouter()
    quiet, busy = router.open("quiet", 4), router.open("busy", 4)
    now = quiet.last_put
    busy.put(StreamChunk(request_id="busy", seq=0, token_ids=[1]))
    busy.last_put = now + 9
    assert router.expire_idle(5.0, now=now + 10) == 1
    assert quiet.chunks[-1].error.code == "timeout" and "quiet" not in router._inboxes
    assert "busy" in router._inboxes and busy.chunks[-1].error is None


def test_stream_batches_round_trip_through_the_router_codec() -> None:
    from switchyard.schemas import codec

    batch = StreamBatch(sender="w", chunks=[StreamChunk(request_id="r", seq=0, token_ids=[5, 6])])
    assert codec.STREAM_BATCH.decode(codec.STREAM_BATCH.encode(batch)) == batch


def test_after_a_reconnect_a_stalled_stream_is_failed_as_lost_and_keeps_its_route() -> None:
    router = StreamRouter()
    moving, stuck, waiting = router.open("moving", 8), router.open("stuck", 8), router.open("waiting", 8)
    t0 = 100.0
    moving.progress_at = stuck.progress_at = t0 - 1  # both had begun; "waiting" has no token yet
    assert router.expire_stalled(3.0, now=t0 + 10) == 0  # nothing is suspect before a reconnect
    router.suspect_all(now=t0)
    moving.progress_at = t0 + 2.5
    assert router.expire_stalled(3.0, now=t0 + 4) == 1
    assert stuck.chunks[-1].error.code == "stream_lost" and "stuck" in router._inboxes
    assert not moving.chunks and not waiting.chunks
    assert router.expire_stalled(3.0, now=t0 + 5) == 0  # failed once, not again
    assert router.expire_stalled(3.0, now=t0 + 6) == 1 and moving.chunks[-1].error.code == "stream_lost"


def test_a_stream_stops_being_suspect_after_a_while() -> None:
    router = StreamRouter()
    inbox = router.open("r", 8)
    router.suspect_all(now=0.0)
    inbox.progress_at = 29.0
    assert router.expire_stalled(3.0, now=31.0) == 0 and inbox.suspect_since is None
    assert router.expire_stalled(3.0, now=100.0) == 0


def test_a_new_scheduler_gets_the_queued_streams_again_and_makes_the_rest_suspect() -> None:
    router = StreamRouter()
    queued, running = router.open("queued", 8), router.open("running", 8)
    _assign(router, "running", "prefill-0")
    assert router.scheduler_changed("sched-b") == 1
    assert queued.chunks[-1].error.code == "scheduler_failover"
    assert not running.chunks and running.suspect_since is not None


def test_a_stream_whose_first_tokens_were_lost_counts_as_begun() -> None:
    """Token 0 lost while the bus was down, later ones arriving: none can be taken (a gap at
    seq 0), so it never progresses; it is stalled, while one that has heard nothing may be
    queued and is left alone."""
    router = StreamRouter()
    gap, queued = router.open("gap", 8), router.open("queued", 8)
    _assign(router, "gap")
    router.suspect_all(now=time.monotonic())
    _route_all(router, StreamChunk(request_id="gap", seq=1, token_ids=[5]))
    later = time.monotonic() + 3.5
    assert router.expire_stalled(3.0, now=later) == 1
    assert gap.chunks[-1].error.code == "stream_lost" and not queued.chunks
