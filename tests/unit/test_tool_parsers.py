"""The tool-call parsers (ingress.tool_parsers): real-format outputs parsed whole, and the same
outputs streamed cut at every position, which must assemble to exactly the whole-text parse."""

from __future__ import annotations

import itertools
import json
import random
import re
import zlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from openai.lib.streaming.chat import ChatCompletionStreamState
from openai.types.chat import ChatCompletionChunk

from switchyard.ingress.errors import IngressError
from switchyard.ingress.tool_parsers import (
    PARSERS,
    Event,
    ParsedOutput,
    ToolCallDelta,
    UnknownToolParser,
    collect,
    new_call_id,
    parser_for,
)
from switchyard.ingress.tool_parsers import __all__ as public_names

SECTION, SECTION_END = "<|tool_calls_section_begin|>", "<|tool_calls_section_end|>"
KIMI_CALL, KIMI_ARGS, KIMI_END = "<|tool_call_begin|>", "<|tool_call_argument_begin|>", "<|tool_call_end|>"
MARKERS = {
    "hermes": ("<tool_call>", "</tool_call>"),
    "llama3_json": ("<|python_tag|>",),
    "kimi_k2": (SECTION, SECTION_END, KIMI_CALL, KIMI_ARGS, KIMI_END),
}


def ids() -> Callable[[], str]:
    """Deterministic call ids, so two parses of one text can be compared whole."""
    numbers: Iterator[int] = iter(range(1000))
    return lambda: f"call_{next(numbers)}"


def hermes(name: str, arguments: object, pad: str = "\n") -> str:
    return f"<tool_call>{pad}{json.dumps({'name': name, 'arguments': arguments}, ensure_ascii=False)}{pad}</tool_call>"


def kimi(name: str, index: int, arguments: str) -> str:
    return f"{KIMI_CALL}functions.{name}:{index}{KIMI_ARGS}{arguments}{KIMI_END}"


def llama(name: str, arguments: object, key: str = "parameters") -> str:
    return json.dumps({"name": name, key: arguments}, ensure_ascii=False)


@dataclass(frozen=True)
class Case:
    id: str
    format: str
    text: str
    content: str | None
    calls: tuple[tuple[str, object], ...] = ()  # (name, arguments value)


WEATHER = {"city": "Paris", "unit": "celsius"}
NESTED = {"filter": {"tags": ["a", "b"], "range": {"from": 1, "to": 2.5}}, "flags": [True, None], "q": 'say "hi"}'}
UNICODE = {"city": "Zürich", "note": "東京 ☂ — ok", "emoji": "🙂"}

CASES = [
    # hermes
    Case("one call", "hermes", hermes("get_weather", WEATHER), None, (("get_weather", WEATHER),)),
    Case(
        "text before",
        "hermes",
        "Let me check.\n" + hermes("get_weather", WEATHER),
        "Let me check.\n",
        (("get_weather", WEATHER),),
    ),
    Case(
        "several calls",
        "hermes",
        hermes("a", {"x": 1}) + "\n" + hermes("b", {}) + "\n" + hermes("c", NESTED),
        None,
        (("a", {"x": 1}), ("b", {}), ("c", NESTED)),
    ),
    Case(
        "no call",
        "hermes",
        "Paris is sunny, 21 < 25 degrees <b>today</b>.",
        "Paris is sunny, 21 < 25 degrees <b>today</b>.",
    ),
    Case(
        "malformed json",
        "hermes",
        '<tool_call>\n{"name": "f", "arguments": {</tool_call>',
        '<tool_call>\n{"name": "f", "arguments": {</tool_call>',
    ),
    Case(
        "malformed among valid",
        "hermes",
        hermes("a", {}) + "\n<tool_call>oops</tool_call>\n" + hermes("b", {"y": 2}),
        "\n<tool_call>oops</tool_call>\n",  # whitespace is dropped only between calls
        (("a", {}), ("b", {"y": 2})),
    ),
    Case("no name", "hermes", '<tool_call>{"arguments": {}}</tool_call>', '<tool_call>{"arguments": {}}</tool_call>'),
    Case("no arguments", "hermes", '<tool_call>{"name": "f"}</tool_call>', '<tool_call>{"name": "f"}</tool_call>'),
    Case(
        "arguments no object",
        "hermes",
        '<tool_call>{"name": "f", "arguments": [1]}</tool_call>',
        '<tool_call>{"name": "f", "arguments": [1]}</tool_call>',
    ),
    Case(
        "nan arguments",
        "hermes",
        '<tool_call>{"name": "f", "arguments": {"x": NaN}}</tool_call>',
        '<tool_call>{"name": "f", "arguments": {"x": NaN}}</tool_call>',
    ),
    Case("arguments as a string", "hermes", hermes("f", json.dumps(WEATHER)), None, (("f", WEATHER),)),
    Case(
        "arguments first",
        "hermes",
        '<tool_call>{"arguments": {"x": 1}, "name": "f"}</tool_call>',
        None,
        (("f", {"x": 1}),),
    ),
    Case("unicode", "hermes", "Voilà : " + hermes("météo", UNICODE), "Voilà : ", (("météo", UNICODE),)),
    Case("nested", "hermes", hermes("search", NESTED, pad=""), None, (("search", NESTED),)),
    Case("no end marker", "hermes", '<tool_call>\n{"name": "f", "arguments": {"x": 1}}\n', None, (("f", {"x": 1}),)),
    Case("cut off", "hermes", 'Sure <tool_call>\n{"name": "f", "argu', 'Sure <tool_call>\n{"name": "f", "argu'),
    Case("text after", "hermes", hermes("f", {}) + "\n\nDone.", "\n\nDone.", (("f", {}),)),
    Case(
        "whitespace before, text after", "hermes", "\n" + hermes("f", {}) + "\nthen text", "\nthen text", (("f", {}),)
    ),
    Case("marker prefix at end", "hermes", "Almost <tool_", "Almost <tool_"),
    Case("whitespace only", "hermes", " \n ", " \n "),
    Case("whitespace around calls", "hermes", "\n\n" + hermes("f", {}) + "\n \n", None, (("f", {}),)),
    # llama3_json
    Case("one call", "llama3_json", llama("get_weather", WEATHER), None, (("get_weather", WEATHER),)),
    Case("python tag", "llama3_json", "<|python_tag|>" + llama("f", {"x": 1}), None, (("f", {"x": 1}),)),
    Case(
        "semicolons",
        "llama3_json",
        "<|python_tag|>" + llama("a", {}) + "; " + llama("b", NESTED, key="arguments") + ";",
        None,
        (("a", {}), ("b", NESTED)),
    ),
    Case(
        "whitespace between",
        "llama3_json",
        " \n" + llama("a", {}) + "\n" + llama("b", {"y": [1]}),
        None,
        (("a", {}), ("b", {"y": [1]})),
    ),
    Case("no call", "llama3_json", "The answer is 42.", "The answer is 42."),
    Case("text before is no call", "llama3_json", "Here: " + llama("f", {}), "Here: " + llama("f", {})),
    Case("json that is no call", "llama3_json", '{"answer": 42}', '{"answer": 42}'),
    Case(
        "malformed json",
        "llama3_json",
        '{"name": "f", "parameters": {"x": 1,}}',
        '{"name": "f", "parameters": {"x": 1,}}',
    ),
    Case(
        "cut off",
        "llama3_json",
        '<|python_tag|>{"name": "f", "parameters": {"x": "{',
        '<|python_tag|>{"name": "f", "parameters": {"x": "{',
    ),
    Case("second malformed", "llama3_json", llama("a", {}) + '; {"name": 7}', '{"name": 7}', (("a", {}),)),
    Case("text after", "llama3_json", llama("f", {}) + "\nI called f.", "I called f.", (("f", {}),)),
    Case("braces in strings", "llama3_json", llama("f", {"s": '}{\\"}'}), None, (("f", {"s": '}{\\"}'}),)),
    Case("unicode", "llama3_json", llama("traduire", UNICODE), None, (("traduire", UNICODE),)),
    Case("tag then code", "llama3_json", "<|python_tag|>print(1)", "<|python_tag|>print(1)"),
    Case("whitespace only", "llama3_json", "\n", "\n"),
    # kimi_k2
    Case(
        "one call",
        "kimi_k2",
        SECTION + kimi("get_weather", 0, '{"city": "Paris", "unit": "celsius"}') + SECTION_END,
        None,
        (("get_weather", WEATHER),),
    ),
    Case(
        "several calls",
        "kimi_k2",
        SECTION + kimi("a", 0, '{"x": 1}') + "\n" + kimi("b", 1, json.dumps(NESTED)) + SECTION_END,
        None,
        (("a", {"x": 1}), ("b", NESTED)),
    ),
    Case(
        "text before",
        "kimi_k2",
        "I'll look it up." + SECTION + kimi("f", 0, "{}") + SECTION_END,
        "I'll look it up.",
        (("f", {}),),
    ),
    Case("no call", "kimi_k2", "No tools needed: <b>bold</b> <|", "No tools needed: <b>bold</b> <|"),
    Case(
        "malformed json",
        "kimi_k2",
        SECTION + kimi("f", 0, '{"x": ') + SECTION_END,
        kimi("f", 0, '{"x": '),
    ),
    Case(
        "bad header",
        "kimi_k2",
        SECTION + kimi("f", 0, "{}").replace(":0", "") + SECTION_END,
        kimi("f", 0, "{}").replace(":0", ""),
    ),
    Case("empty arguments", "kimi_k2", SECTION + kimi("now", 0, " ") + SECTION_END, None, (("now", {}),)),
    Case("unicode", "kimi_k2", SECTION + kimi("f", 0, json.dumps(UNICODE)) + SECTION_END, None, (("f", UNICODE),)),
    Case(
        "ended by the section end",
        "kimi_k2",
        SECTION + kimi("f", 0, "{}")[: -len(KIMI_END)] + SECTION_END,
        None,
        (("f", {}),),
    ),
    Case("section never closed", "kimi_k2", "\n" + SECTION + kimi("f", 0, '{"a": 1}') + "\n", None, (("f", {"a": 1}),)),
    Case(
        "cut off",
        "kimi_k2",
        SECTION + KIMI_CALL + "functions.f:0" + KIMI_ARGS + '{"a',
        KIMI_CALL + "functions.f:0" + KIMI_ARGS + '{"a',
    ),
]


def case_id(case: Case) -> str:
    return f"{case.format}: {case.id}"


def compact(value: object) -> str:
    return json.dumps(value, ensure_ascii=False, separators=(",", ":"))


@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_whole_text(case: Case) -> None:
    parsed = parser_for(case.format, new_id=ids()).parse(case.text)
    assert parsed.content == case.content
    assert [(c.name, json.loads(c.arguments)) for c in parsed.tool_calls] == list(case.calls)
    assert [c.arguments for c in parsed.tool_calls] == [compact(a) for _, a in case.calls]


@pytest.mark.parametrize("case", [c for c in CASES if c.calls], ids=case_id)
def test_ids(case: Case) -> None:
    parsed = parser_for(case.format).parse(case.text)
    if case.format == "kimi_k2":  # the model's own ids: it refers to them in later turns
        assert [c.id for c in parsed.tool_calls] == re.findall(r"functions\.\w+:\d+", case.text)
    else:
        assert all(re.fullmatch(r"call_[0-9a-f]{24}", c.id) for c in parsed.tool_calls)
        assert len({c.id for c in parsed.tool_calls}) == len(parsed.tool_calls)


def streamed(format: str, pieces: list[str]) -> tuple[ParsedOutput, list[list[Event]]]:
    stream = parser_for(format, new_id=ids()).stream()
    batches = [stream.push(piece) for piece in pieces] + [stream.finish()]
    return collect(e for batch in batches for e in batch), batches


def cut(text: str, at: list[int]) -> list[str]:
    bounds = [0, *sorted(at), len(text)]
    return [text[a:b] for a, b in itertools.pairwise(bounds)]


@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_streamed_char_by_char(case: Case) -> None:
    whole = parser_for(case.format, new_id=ids()).parse(case.text)
    assert streamed(case.format, list(case.text))[0] == whole


@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_streamed_cut_once_anywhere(case: Case) -> None:
    whole = parser_for(case.format, new_id=ids()).parse(case.text)
    for at in range(len(case.text) + 1):
        assert streamed(case.format, cut(case.text, [at]))[0] == whole, at


@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_streamed_cut_at_random(case: Case) -> None:
    seed = zlib.crc32(case_id(case).encode())  # fixed per case, so a failure replays
    print(f"seed={seed}")
    rng = random.Random(seed)
    whole = parser_for(case.format, new_id=ids()).parse(case.text)
    for _ in range(20):
        at = rng.sample(range(len(case.text) + 1), k=min(len(case.text), rng.randint(1, 8)))
        assert streamed(case.format, cut(case.text, at))[0] == whole, at


def chunk(event: Event | None) -> ChatCompletionChunk:
    """The chunk the ingress sends for an event (None: the last one, with its finish reason)."""
    if event is None:
        delta: dict[str, object] = {}
    elif isinstance(event, str):
        delta = {"content": event}
    else:
        head = {"id": event.id, "type": "function"} if event.id else {}
        name = {"name": event.name} if event.name else {}
        delta = {"tool_calls": [{"index": event.index, **head, "function": {**name, "arguments": event.arguments}}]}
    choice = {"index": 0, "delta": delta, "finish_reason": "tool_calls" if event is None else None}
    return ChatCompletionChunk.model_validate(
        {"id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 0, "model": "m", "choices": [choice]}
    )


@pytest.mark.parametrize("case", [c for c in CASES if c.calls], ids=case_id)
def test_the_openai_client_assembles_the_stream_into_the_whole_text_parse(case: Case) -> None:
    whole = parser_for(case.format, new_id=ids()).parse(case.text)
    _, batches = streamed(case.format, list(case.text))
    state: ChatCompletionStreamState[None] = ChatCompletionStreamState()
    for event in [*(e for batch in batches for e in batch), None]:
        state.handle_chunk(chunk(event))
    message = state.get_final_completion().choices[0].message
    assert message.content == whole.content
    assert [(c.id, c.function.name, c.function.arguments) for c in message.tool_calls or []] == [
        (c.id, c.name, c.arguments) for c in whole.tool_calls
    ]


def leaked(content: str, markers: tuple[str, ...]) -> bool:
    """Whether content so far ends with a part of a marker (that it might yet complete)."""
    return any(content.endswith(m[:size]) for m in markers for size in range(1, len(m)))


@pytest.mark.parametrize("case", [c for c in CASES if c.calls and "<" not in (c.content or "")], ids=case_id)
def test_no_part_of_a_marker_is_ever_sent_as_content(case: Case) -> None:
    _, batches = streamed(case.format, list(case.text))
    sent = ""
    for batch in batches:
        sent += "".join(e for e in batch if isinstance(e, str))
        assert not leaked(sent, MARKERS[case.format]), sent


def test_a_held_back_prefix_is_released_once_it_is_no_marker() -> None:
    stream = parser_for("hermes").stream()
    assert stream.push("Hi <tool") == ["Hi "]
    assert stream.push("box> and") == ["<toolbox> and"]
    assert stream.push(" <") == [" "]
    assert stream.finish() == ["<"]


def test_a_call_is_sent_as_a_head_then_its_arguments() -> None:
    stream = parser_for("hermes", new_id=ids()).stream()
    assert stream.push('ok<tool_call>{"name": "f", "arguments": {"x":  1}}') == ["ok"]
    assert stream.push("</tool_call>") == [
        ToolCallDelta(index=0, id="call_0", name="f"),
        ToolCallDelta(index=0, arguments='{"x":1}'),
    ]
    assert stream.push(hermes("g", {})) == [
        ToolCallDelta(index=1, id="call_1", name="g"),
        ToolCallDelta(index=1, arguments="{}"),
    ]
    assert stream.finish() == []


def test_llama3_waits_for_the_first_object_to_decide() -> None:
    stream = parser_for("llama3_json").stream()
    assert stream.push("  <|python") == []
    assert stream.push("_tag|>") == []
    assert stream.push('{"answer": 4') == []
    assert stream.push("2} more") == ['  <|python_tag|>{"answer": 42} more']


FRAGMENTS = {
    "hermes": [
        "<tool_call>",
        "</tool_call>",
        "<tool_",
        "\n",
        " ",
        "text",
        '{"name": "f", "arguments": {"a": 1}}',
        "{",
        "}",
        '"',
        "<",
    ],
    "llama3_json": [
        "<|python_tag|>",
        '{"name": "f", "parameters": {"a": "}"}}',
        "{",
        "}",
        ";",
        " ",
        "\n",
        "x",
        '"',
        "\\",
    ],
    "kimi_k2": [
        SECTION,
        SECTION_END,
        KIMI_CALL,
        KIMI_ARGS,
        KIMI_END,
        "functions.f:0",
        '{"a": [1]}',
        "<|",
        " ",
        "t",
        "{",
    ],
}


@pytest.mark.parametrize("format", sorted(FRAGMENTS))
@settings(max_examples=150, deadline=None)
@given(data=st.data())
def test_any_text_cut_anywhere_parses_as_a_whole(format: str, data: st.DataObject) -> None:
    text = "".join(data.draw(st.lists(st.sampled_from(FRAGMENTS[format]), max_size=14), label="fragments"))
    at = data.draw(st.lists(st.integers(0, len(text)), max_size=6), label="cuts")
    assert streamed(format, cut(text, at))[0] == parser_for(format, new_id=ids()).parse(text)


def test_the_registry() -> None:
    assert sorted(PARSERS) == ["hermes", "kimi_k2", "llama3_json"]
    assert all(PARSERS[name].name == name for name in PARSERS)
    assert {n: p.keeps_special_tokens for n, p in PARSERS.items()} == {
        "hermes": True,  # as vLLM: some models make <tool_call> special
        "llama3_json": False,
        "kimi_k2": True,
    }


def test_an_unknown_parser_is_refused_naming_the_known_ones() -> None:
    with pytest.raises(UnknownToolParser, match="'mistral'; known: hermes, kimi_k2, llama3_json") as raised:
        parser_for("mistral")
    assert isinstance(raised.value, IngressError)


def test_call_ids_look_like_openai_ones() -> None:
    assert re.fullmatch(r"call_[0-9a-f]{24}", new_call_id())
    assert new_call_id() != new_call_id()


def test_public_names() -> None:
    import switchyard.ingress.tool_parsers as module

    assert [n for n in public_names if not hasattr(module, n)] == []
