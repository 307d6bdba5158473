"""The pure logic of the agentic surface: a request's SamplingParams and output constraint
(ingress.sampling), what tool_choice does (ingress.tool_calls), logprobs in each endpoint's
shape (ingress.logprobs) and stop tokens in the text (ingress.text)."""

from __future__ import annotations

import json

import msgspec
import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers

from switchyard.ingress.errors import InvalidRequest
from switchyard.ingress.logprobs import chat_logprobs, completion_logprobs
from switchyard.ingress.openai_types import ChatCompletionRequest, CompletionRequest, decode_body
from switchyard.ingress.sampling import sampling_params
from switchyard.ingress.text import TextAssembler
from switchyard.ingress.tokenizer import IncrementalDecoder
from switchyard.ingress.tool_calls import ToolPlan
from switchyard.ingress.tool_parsers import ToolCallDelta, collect
from switchyard.schemas import StructuredOutput, TokenLogprobs

VOCAB = 4096
TOOLS = [
    {"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {"a": {}}}}},
    {"type": "function", "function": {"name": "g"}},
]


def chat(**fields) -> ChatCompletionRequest:
    fields = {"model": "m", "messages": [{"role": "user", "content": "hi"}], **fields}
    return decode_body(msgspec.json.encode(fields), ChatCompletionRequest)  # type: ignore[return-value]


def completion(**fields) -> CompletionRequest:
    fields = {"model": "m", "prompt": "hi", **fields}
    return decode_body(msgspec.json.encode(fields), CompletionRequest)  # type: ignore[return-value]


# --- SamplingParams -------------------------------------------------------------------------


def test_every_control_reaches_the_sampling_params() -> None:
    body = chat(
        temperature=0.5,
        top_p=0.9,
        top_k=40,
        min_p=0.05,
        presence_penalty=0.5,
        frequency_penalty=-0.5,
        repetition_penalty=1.2,
        logit_bias={"17": -100, "3": 2.5},
        min_tokens=4,
        ignore_eos=True,
        stop_token_ids=[9, 2, 9],
        seed=7,
        logprobs=True,
        top_logprobs=5,
    )
    s = sampling_params(body, 32, VOCAB)
    assert (s.temperature, s.top_p, s.top_k, s.min_p, s.seed) == (0.5, 0.9, 40, 0.05, 7)
    assert (s.presence_penalty, s.frequency_penalty, s.repetition_penalty) == (0.5, -0.5, 1.2)
    assert s.logit_bias == {17: -100.0, 3: 2.5} and s.min_tokens == 4 and s.ignore_eos
    assert s.stop_token_ids == [2, 9] and s.logprobs == 5 and s.structured is None


def test_defaults_ask_for_nothing() -> None:
    s = sampling_params(chat(top_k=-1), 8, VOCAB)
    assert (s.top_k, s.min_p, s.repetition_penalty, s.logit_bias, s.logprobs) == (0, 0.0, 1.0, None, None)
    assert sampling_params(completion(logprobs=0), 8, VOCAB).logprobs == 0  # the sampled token's alone
    assert sampling_params(chat(logprobs=True), 8, VOCAB).logprobs == 0


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"top_k": -3}, "top_k"),
        ({"min_tokens": 9}, "min_tokens"),
        ({"logit_bias": {"4096": 1}}, "logit_bias"),
        ({"logit_bias": {"abc": 1}}, "logit_bias"),
        ({"stop_token_ids": [4096]}, "stop_token_ids"),
        ({"top_logprobs": 2}, "top_logprobs"),
        ({"response_format": {"type": "json_object"}, "guided_regex": "a"}, "guided_regex"),
        ({"structured_outputs": {}}, "structured_outputs"),
        ({"guided_json": "not json"}, "structured_outputs"),
        ({"guided_choice": []}, "structured_outputs"),
    ],
)
def test_what_the_types_cannot_check_is_a_400_naming_the_field(fields, param) -> None:
    with pytest.raises(InvalidRequest) as caught:
        sampling_params(chat(**fields), 8, VOCAB)
    assert caught.value.param == param


def test_each_constraint_becomes_one_structured_output() -> None:
    schema = {"type": "object", "properties": {"x": {"type": "integer"}}}
    fmt = {"type": "json_schema", "json_schema": {"name": "x", "schema": schema, "strict": True}}
    cases = [
        ({"response_format": fmt}, StructuredOutput(json_schema=json.dumps(schema, separators=(",", ":")))),
        ({"response_format": {"type": "json_object"}}, StructuredOutput(json_object=True)),
        ({"response_format": {"type": "text"}}, None),
        ({"guided_json": json.dumps(schema)}, StructuredOutput(json_schema=json.dumps(schema, separators=(",", ":")))),
        ({"guided_regex": "a+"}, StructuredOutput(regex="a+")),
        ({"structured_outputs": {"choice": ["y", "n"]}}, StructuredOutput(choice=["y", "n"])),
        ({"structured_outputs": {"grammar": "root ::= 'a'"}}, StructuredOutput(grammar="root ::= 'a'")),
    ]
    for fields, expected in cases:
        structured = sampling_params(chat(**fields), 8, VOCAB).structured
        assert structured == expected, fields
        assert sampling_params(chat(**fields), 8, VOCAB).decode_samples_first == (expected is not None)


# --- tool_choice ----------------------------------------------------------------------------


def test_no_tools_or_tool_choice_none_is_no_plan() -> None:
    assert ToolPlan.of(chat(), "hermes") is None
    assert ToolPlan.of(chat(tools=TOOLS, tool_choice="none"), "hermes") is None


def test_auto_needs_a_parser_and_constrains_nothing() -> None:
    with pytest.raises(InvalidRequest, match="--tool-call-parser") as caught:
        ToolPlan.of(chat(tools=TOOLS), "")
    assert caught.value.param == "tool_choice"
    plan = ToolPlan.of(chat(tools=TOOLS), "hermes")
    assert plan is not None and plan.mode == "auto" and plan.constraint() is None
    stream = plan.stream()
    events = [*stream.push('Sure.<tool_call>\n{"name": "f", "arguments": {"a": 1}}\n</tool_call>'), *stream.finish()]
    parsed = collect(events)
    assert parsed.content == "Sure." and [(c.name, json.loads(c.arguments)) for c in parsed.tool_calls] == [
        ("f", {"a": 1})
    ]


def test_auto_without_parallel_calls_keeps_the_first() -> None:
    plan = ToolPlan.of(chat(tools=TOOLS, parallel_tool_calls=False), "hermes")
    assert plan is not None
    two = '<tool_call>\n{"name": "f", "arguments": {}}\n</tool_call><tool_call>\n{"name": "g", "arguments": {}}\n</tool_call>'
    stream = plan.stream()
    assert [c.name for c in collect([*stream.push(two), *stream.finish()]).tool_calls] == ["f"]


def test_a_named_choice_constrains_to_its_parameters_and_streams_them() -> None:
    plan = ToolPlan.of(chat(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "f"}}), "")
    assert plan is not None and plan.mode == "named"
    assert plan.constraint() == StructuredOutput(json_schema='{"type":"object","properties":{"a":{}}}')
    stream = plan.stream()
    events = [*stream.push('{"a"'), *stream.push(": 1}"), *stream.finish()]
    assert isinstance(events[0], ToolCallDelta) and events[0].name == "f" and events[0].id
    assert all(isinstance(e, ToolCallDelta) and e.index == 0 and e.id is None for e in events[1:])
    assert collect(events).tool_calls[0].arguments == '{"a": 1}'
    g = ToolPlan.of(chat(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "g"}}), "")
    assert g is not None and g.constraint() == StructuredOutput(json_schema='{"type":"object"}')


def test_a_named_choice_must_name_a_tool() -> None:
    with pytest.raises(InvalidRequest) as caught:
        ToolPlan.of(chat(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "h"}}), "hermes")
    assert caught.value.param == "tool_choice"


def chat_tools_of(body):
    from switchyard.ingress.openai_types import chat_tools

    return chat_tools(body)


def test_required_constrains_to_an_array_of_calls_and_sends_them_complete() -> None:
    plan = ToolPlan.of(chat(tools=TOOLS, tool_choice="required", parallel_tool_calls=False), "")
    assert plan is not None
    constraint = plan.constraint()
    assert constraint is not None and constraint.json_schema is not None
    schema = json.loads(constraint.json_schema)
    assert schema["type"] == "array" and schema["minItems"] == 1 and schema["maxItems"] == 1
    names = [branch["properties"]["name"]["enum"] for branch in schema["items"]["anyOf"]]
    assert names == [["f"], ["g"]]
    stream = plan.stream()
    assert stream.push('[{"name": "g", "parameters": {"x": [1, 2]}}') == []  # nothing until complete
    events = [*stream.push("]"), *stream.finish()]
    assert [(c.name, c.arguments) for c in collect(events).tool_calls] == [("g", '{"x":[1,2]}')]
    cut = plan.stream()
    assert collect([*cut.push('[{"name": "g", "para'), *cut.finish()]).content == '[{"name": "g", "para'


def test_duplicate_tool_names_are_refused() -> None:
    with pytest.raises(InvalidRequest) as caught:
        chat_tools_of(chat(tools=[TOOLS[0], TOOLS[0]]))
    assert caught.value.param == "tools"


# --- logprobs -------------------------------------------------------------------------------------


def text_of(token: int) -> str:
    return {1: "Hel", 2: "lo", 3: " wor", 4: "ld"}.get(token, "?")


def test_chat_logprobs_shape() -> None:
    lps = [TokenLogprobs(logprob=-0.1, top_ids=[1, 3], top_logprobs=[-0.1, -2.0]), TokenLogprobs(logprob=float("-inf"))]
    shaped = chat_logprobs([1, 2], lps, text_of)
    first, second = shaped["content"]
    assert first == {
        "token": "Hel",
        "logprob": -0.1,
        "bytes": list(b"Hel"),
        "top_logprobs": [
            {"token": "Hel", "logprob": -0.1, "bytes": list(b"Hel")},
            {"token": " wor", "logprob": -2.0, "bytes": list(b" wor")},
        ],
    }
    assert second["logprob"] == -9999.0 and second["top_logprobs"] == []  # JSON has no -inf


def test_completion_logprobs_shape() -> None:
    lps = [TokenLogprobs(logprob=-0.5, top_ids=[4], top_logprobs=[-0.2]), TokenLogprobs(logprob=-1.0)]
    shaped = completion_logprobs([3, 4], lps, text_of, offset=5)
    assert shaped == {
        "tokens": [" wor", "ld"],
        "token_logprobs": [-0.5, -1.0],
        "top_logprobs": [{"ld": -0.2, " wor": -0.5}, {"ld": -1.0}],  # the sampled token's is always there
        "text_offset": [5, 9],
    }


# --- stop tokens in the text ----------------------------------------------------------------------


def letters() -> Tokenizer:
    vocab = {c: i for i, c in enumerate("abcdefgh")}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="a"))
    tok.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    tok.decoder = decoders.Fuse()
    return tok


def test_a_stop_token_ends_the_text_without_its_own_unless_asked() -> None:
    hidden = TextAssembler(IncrementalDecoder(letters()), [], stop_token_ids=frozenset({7}))
    assert hidden.push([0, 1, 7]) + hidden.finish() == "ab"
    assert hidden.tokens == 3  # it is output, and counted
    shown = TextAssembler(IncrementalDecoder(letters()), [], stop_token_ids=frozenset({7}), include_stop=True)
    assert shown.push([0, 1, 7]) + shown.finish() == "abh"


def test_include_stop_keeps_the_stop_string() -> None:
    kept = TextAssembler(IncrementalDecoder(letters()), ["cd"], include_stop=True)
    assert kept.push([0, 2, 3, 4]) + kept.finish() == "acd" and kept.stopped
    cut = TextAssembler(IncrementalDecoder(letters()), ["cd"])
    assert cut.push([0, 2, 3, 4]) + cut.finish() == "a"
