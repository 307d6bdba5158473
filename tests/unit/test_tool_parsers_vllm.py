"""Differential test: our tool-call parsers against vLLM's, on the same outputs, non-streaming.

vLLM's parsers want a tokenizer only to look up their markers' token ids, so a word-level
tokenizer built here, whose whole vocabulary is those markers, stands in for a model's: no
model files, no engine. Compared: whether tools were called, names, arguments as JSON values
(vLLM spaces them differently, or keeps the model's text) and content, whitespace-only content
counting as none. Where we differ on purpose, ``DIFFERENT`` says why, and checks we still do.
"""

from __future__ import annotations

import json
from typing import Any

import pytest

pytest.importorskip("vllm")

from tokenizers import Tokenizer, models
from transformers import PreTrainedTokenizerFast
from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
from vllm.tool_parsers.hermes_tool_parser import Hermes2ProToolParser
from vllm.tool_parsers.kimi_k2_tool_parser import KimiK2ToolParser
from vllm.tool_parsers.llama_tool_parser import Llama3JsonToolParser

from switchyard.ingress.tool_parsers import parser_for

SECTION, SECTION_END = "<|tool_calls_section_begin|>", "<|tool_calls_section_end|>"
KIMI_CALL, KIMI_ARGS, KIMI_END = "<|tool_call_begin|>", "<|tool_call_argument_begin|>", "<|tool_call_end|>"
MARKERS = ["<tool_call>", "</tool_call>", "<|python_tag|>", SECTION, SECTION_END, KIMI_CALL, KIMI_ARGS, KIMI_END]
MARKERS += ["<think>", "</think>"]  # Kimi K2's parser looks these up too
THEIRS = {"hermes": Hermes2ProToolParser, "llama3_json": Llama3JsonToolParser, "kimi_k2": KimiK2ToolParser}


def hermes(name: str, arguments: object) -> str:
    return f"<tool_call>\n{json.dumps({'name': name, 'arguments': arguments}, ensure_ascii=False)}\n</tool_call>"


def llama(name: str, arguments: object, key: str = "parameters") -> str:
    return json.dumps({"name": name, key: arguments}, ensure_ascii=False)


def kimi(name: str, index: int, arguments: object) -> str:
    return f"{KIMI_CALL}functions.{name}:{index}{KIMI_ARGS}{json.dumps(arguments, ensure_ascii=False)}{KIMI_END}"


WEATHER = {"city": "Paris", "unit": "celsius"}
NESTED = {"filter": {"tags": ["a", "b"], "range": {"from": 1, "to": 2.5}}, "flags": [True, None], "q": 'say "hi"}'}
UNICODE = {"city": "Zürich", "note": "東京 ☂ — ok", "emoji": "🙂"}

SAME = {
    "hermes": {
        "one call": hermes("get_weather", WEATHER),
        "text before": "Let me check.\n\n" + hermes("get_weather", WEATHER),
        "several calls": hermes("a", {"x": 1}) + "\n" + hermes("b", {}) + "\n" + hermes("c", NESTED),
        "no call": "Paris is sunny, 21 < 25 degrees.",
        "malformed json": '<tool_call>\n{"name": "f", "arguments": {</tool_call>',
        "no name": '<tool_call>{"arguments": {}}</tool_call>',
        "unicode": "Voilà : " + hermes("météo", UNICODE),
        "nested": hermes("search", NESTED),
        "arguments first": '<tool_call>{"arguments": {"x": 1}, "name": "f"}</tool_call>',
        "no end marker": '<tool_call>\n{"name": "f", "arguments": {"x": 1}}\n',
        "cut off": 'Sure <tool_call>\n{"name": "f", "argu',
    },
    "llama3_json": {
        "one call": llama("get_weather", WEATHER),
        "python tag": "<|python_tag|>" + llama("f", {"x": 1}),
        "semicolons": llama("a", {}) + "; " + llama("b", NESTED, key="arguments"),
        "no call": "The answer is 42.",
        "json that is no call": '{"answer": 42}',
        "malformed json": '{"name": "f", "parameters": {"x": 1,}}',
        "braces in strings": llama("f", {"s": '}{\\"}'}),
        "unicode": llama("traduire", UNICODE),
        "nested": llama("search", NESTED),
    },
    "kimi_k2": {
        "one call": SECTION + kimi("get_weather", 0, WEATHER) + SECTION_END,
        "several calls": SECTION + kimi("a", 0, {"x": 1}) + "\n" + kimi("b", 1, NESTED) + SECTION_END,
        "text before": "I'll look it up." + SECTION + kimi("f", 0, {}) + SECTION_END,
        "whitespace before": "\n\n" + SECTION + kimi("f", 0, {"a": 1}) + SECTION_END,
        "no call": "No tools needed.",
        "unicode": SECTION + kimi("f", 0, UNICODE) + SECTION_END,
        "nested": SECTION + kimi("search", 0, NESTED) + SECTION_END,
        "never closed": SECTION + kimi("f", 0, {"x": 1}).removesuffix(KIMI_END),
    },
}

# (format, output, why we differ)
DIFFERENT = [
    (
        "hermes",
        hermes("a", {}) + "\n<tool_call>oops</tool_call>",
        "one malformed call: vLLM returns the whole output as content; we keep the valid calls",
    ),
    ("hermes", hermes("f", {}) + "\nDone.", "text after the calls: vLLM drops it; we keep it as content"),
    (
        "llama3_json",
        "Here: " + llama("f", {}),
        "text before the JSON: vLLM's whole-text parse finds the call anyway (its stream does not)",
    ),
    ("llama3_json", llama("f", {}) + "\nI called f.", "text after the calls: vLLM drops it; we keep it"),
    ("kimi_k2", SECTION + kimi("f", 0, {}) + SECTION_END + " Done.", "text after the section: vLLM drops it"),
    (
        "kimi_k2",
        SECTION + kimi("f", 0, {}).replace("{}", '{"x": ') + SECTION_END,
        "arguments that are no JSON: vLLM passes them on as the call's; we return the call as content",
    ),
]


@pytest.fixture(scope="module")
def tokenizer() -> PreTrainedTokenizerFast:
    core = Tokenizer(models.WordLevel({"[UNK]": 0}, unk_token="[UNK]"))
    return PreTrainedTokenizerFast(tokenizer_object=core, unk_token="[UNK]", additional_special_tokens=MARKERS)


@pytest.fixture(scope="module")
def request_with_tools() -> ChatCompletionRequest:
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
    return ChatCompletionRequest(model="m", messages=[{"role": "user", "content": "hi"}], tools=[tool])


def value(arguments: str) -> object:
    try:
        return json.loads(arguments)
    except ValueError:  # vLLM may pass a model's broken arguments through
        return ("not JSON", arguments)


def outcome(called: bool, calls: list[tuple[str, str]], content: str | None) -> dict[str, Any]:
    return {
        "tools_called": called,
        "calls": [(name, value(arguments)) for name, arguments in calls],
        "content": content if content and content.strip() else None,
    }


def ours(format: str, text: str) -> dict[str, Any]:
    parsed = parser_for(format).parse(text)
    return outcome(bool(parsed.tool_calls), [(c.name, c.arguments) for c in parsed.tool_calls], parsed.content)


def theirs(
    format: str, text: str, tokenizer: PreTrainedTokenizerFast, request: ChatCompletionRequest
) -> dict[str, Any]:
    result = THEIRS[format](tokenizer).extract_tool_calls(text, request)
    calls = [(c.function.name, c.function.arguments) for c in result.tool_calls]
    return outcome(result.tools_called, calls, result.content)


@pytest.mark.parametrize(
    ("format", "text"),
    [(f, t) for f, texts in SAME.items() for t in texts.values()],
    ids=[f"{f}: {n}" for f, texts in SAME.items() for n in texts],
)
def test_we_parse_as_vllm_does(format: str, text: str, tokenizer, request_with_tools) -> None:
    assert ours(format, text) == theirs(format, text, tokenizer, request_with_tools)


@pytest.mark.parametrize(
    ("format", "text", "why"), DIFFERENT, ids=[why.split(":")[0] + f" ({f})" for f, _, why in DIFFERENT]
)
def test_where_we_differ_on_purpose(format: str, text: str, why: str, tokenizer, request_with_tools) -> None:
    assert ours(format, text) != theirs(format, text, tokenizer, request_with_tools), (
        f"vLLM now agrees ({why}): move it to SAME"
    )
