"""The table of request fields (ingress.fields): it covers every field the installed `openai`
package can send, neutral values pass, any other value of a refused field is a 400 naming it,
and an unknown field is logged once."""

from __future__ import annotations

import logging

import msgspec
import pytest
from openai.types import completion_create_params as completion_params
from openai.types.chat import completion_create_params as chat_params

from switchyard.ingress import fields
from switchyard.ingress.errors import InvalidRequest
from switchyard.ingress.fields import FIELDS, check_fields
from switchyard.ingress.openai_types import ChatCompletionRequest, CompletionRequest, decode_body

MESSAGES = [{"role": "user", "content": "hi"}]
BASE = {"chat": {"model": "m", "messages": MESSAGES}, "completion": {"model": "m", "prompt": "hi"}}
TYPES = {"chat": ChatCompletionRequest, "completion": CompletionRequest}


def openai_fields(module) -> set[str]:
    """Every field of a create call, streaming or not (`stream` lives in the subclasses)."""
    return {
        name
        for cls in (module.CompletionCreateParamsStreaming, module.CompletionCreateParamsNonStreaming)
        for klass in cls.__mro__
        for name in getattr(klass, "__annotations__", {})
    }


def decode(endpoint: str, **extra) -> object:
    return decode_body(msgspec.json.encode({**BASE[endpoint], **extra}), TYPES[endpoint])


@pytest.mark.parametrize(("endpoint", "module"), [("chat", chat_params), ("completion", completion_params)])
def test_the_table_covers_every_field_of_the_openai_package(endpoint, module) -> None:
    names = openai_fields(module)
    assert {"model", "stream", "temperature"} <= names  # the derivation found the fields
    missing = sorted(n for n in names if n not in FIELDS or endpoint not in FIELDS[n].endpoints)
    assert missing == [], f"fields of openai's {endpoint} create params the table does not account for"


def test_every_field_the_structs_decode_is_in_the_table_for_its_endpoint() -> None:
    for endpoint, type_ in TYPES.items():
        for name in type_.__struct_fields__:
            assert name in FIELDS and endpoint in FIELDS[name].endpoints, (endpoint, name)


def test_only_refused_fields_carry_a_neutral_test_and_all_explain_themselves() -> None:
    for name, field in FIELDS.items():
        assert field.endpoints, name
        if field.status != "supported":
            assert field.reason, name
        if field.status != "refused":
            assert field.neutral is fields._null, name


NEUTRAL = [
    ("chat", {"n": 1}),
    ("chat", {"logprobs": False, "top_logprobs": 0}),
    ("chat", {"tools": [], "tool_choice": "none"}),
    ("chat", {"functions": None, "function_call": "none"}),
    ("chat", {"response_format": {"type": "text"}, "modalities": ["text"]}),
    ("chat", {"presence_penalty": 0, "frequency_penalty": 0.0, "logit_bias": {}}),
    ("chat", {"top_k": -1, "min_p": 0, "repetition_penalty": 1.0, "min_tokens": 0}),
    ("chat", {"top_k": 0, "ignore_eos": False, "stop_token_ids": [], "echo": False}),
    ("chat", {"skip_special_tokens": True, "add_generation_prompt": True, "add_special_tokens": False}),
    ("chat", {"chat_template_kwargs": {"enable_thinking": False}, "include_stop_str_in_output": False}),
    ("chat", {"verbosity": "medium"}),
    ("chat", {"reasoning_effort": "low", "guided_decoding_backend": "xgrammar"}),
    ("chat", {"user": "u", "metadata": {"a": "b"}, "store": True, "safety_identifier": "s"}),
    ("chat", {"service_tier": "auto", "prompt_cache_key": "k", "parallel_tool_calls": False, "priority": 3}),
    ("completion", {"echo": False, "best_of": 1, "suffix": None, "logprobs": None, "n": 1}),
    ("completion", {"top_k": -1, "user": "u", "cache_salt": "x"}),
]


@pytest.mark.parametrize(("endpoint", "extra"), NEUTRAL)
def test_neutral_values_and_fields_without_effect_pass(endpoint, extra) -> None:
    decode(endpoint, **extra)  # raises on failure


REFUSED = [
    ("completion", "best_of", 3),
    ("chat", "functions", [{"name": "f"}]),
    ("chat", "function_call", {"name": "f"}),
    ("chat", "modalities", ["text", "audio"]),
    ("chat", "audio", {"voice": "alloy", "format": "wav"}),
    ("chat", "web_search_options", {}),
    ("completion", "echo", True),
    ("chat", "echo", True),
    ("completion", "best_of", 2),
    ("completion", "suffix", "end"),
    ("chat", "skip_special_tokens", False),
    ("chat", "bad_words", ["x"]),
    ("chat", "prompt_logprobs", 1),
    ("chat", "guided_whitespace_pattern", " "),
    ("chat", "chat_template", "{{ messages }}"),
    ("chat", "add_generation_prompt", False),
    ("chat", "continue_final_message", True),
    ("completion", "add_special_tokens", True),
    ("chat", "documents", [{"text": "x"}]),
    ("completion", "return_tokens_as_token_ids", True),
]


@pytest.mark.parametrize(("endpoint", "name", "value"), REFUSED)
def test_a_refused_field_with_a_real_value_is_a_400_naming_it(endpoint, name, value) -> None:
    assert FIELDS[name].status == "refused"
    with pytest.raises(InvalidRequest) as caught:
        decode(endpoint, **{name: value})
    assert caught.value.param == name
    assert caught.value.status == 400 and caught.value.code == "unsupported_parameter"
    assert FIELDS[name].reason in caught.value.message


def test_type_errors_of_decoded_fields_come_first() -> None:
    with pytest.raises(InvalidRequest) as caught:
        decode("chat", n="two")
    assert caught.value.param == "n" and caught.value.code is None


def test_an_unknown_field_is_accepted_and_logged_once_per_name(caplog, monkeypatch) -> None:
    monkeypatch.setattr(fields, "_unknown", set())
    caplog.set_level(logging.WARNING, logger=fields.__name__)
    for _ in range(3):
        decode("chat", frobnicate=1, best_of=2)  # best_of is a completions field: unknown to chat
    warnings = [r.getMessage() for r in caplog.records if r.name == fields.__name__]
    assert len(warnings) == 2
    assert "'frobnicate'" in warnings[0] and "chat" in warnings[0]
    assert "'best_of'" in warnings[1]


def test_the_names_remembered_are_bounded(caplog, monkeypatch) -> None:
    monkeypatch.setattr(fields, "_unknown", set())
    monkeypatch.setattr(fields, "UNKNOWN_REMEMBERED", 3)
    caplog.set_level(logging.WARNING, logger=fields.__name__)
    check_fields(msgspec.json.encode({f"x{i}": i for i in range(10)}), "completion")
    check_fields(msgspec.json.encode({"x" * 10_000: 1}), "completion")
    assert len(fields._unknown) == 3
    assert len([r for r in caplog.records if r.name == fields.__name__]) == 3


def test_other_body_types_are_not_checked() -> None:
    class Other(msgspec.Struct):
        model: str

    decode_body(b'{"model": "m", "tools": [{"type": "function"}]}', Other)  # raises on failure
