"""The agentic surface on the sim engine, through the real HTTP API and the official client:
tool calls (forced, named and required, and a whole round trip), structured outputs, logprobs,
and the sampling controls that change an output's length.

The sim engine writes a structured request's output as a grammar-constrained engine would: an
instance of its schema (``workers.sim_structured``), so every output here must parse and
validate. Its tokens come from a narrow range (44 ids) with a chance of EOS per token, so stop
tokens, ``min_tokens`` and ``ignore_eos`` visibly change lengths.
"""

from __future__ import annotations

import json
import re

import httpx
import jsonschema
import openai
import pytest

from switchyard.workers.sim import SimEngineConfig
from tests.support.stack import MODEL, SIM, running_stack

LOW, HIGH = 256, 300
WEATHER = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "minLength": 1},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
    },
    "required": ["city", "unit"],
    "additionalProperties": False,
}
TRAINS = {
    "type": "object",
    "properties": {"track": {"type": "integer", "minimum": 1, "maximum": 12}, "wagons": {"type": "integer"}},
    "required": ["track"],
}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "The weather", "parameters": WEATHER}},
    {"type": "function", "function": {"name": "count_wagons", "parameters": TRAINS}},
]
SCHEMAS = {"get_weather": WEATHER, "count_wagons": TRAINS}
ASK = [{"role": "user", "content": "What is the weather in Paris, and how many wagons are on track nine?"}]


@pytest.fixture(scope="module")
def stack(module_nats):
    sim = SimEngineConfig(
        token_low=LOW,
        token_high=HIGH,
        eos_token_id=SIM.eos_token_id,
        eos_per_token=0.1,
        tokenizer_path=SIM.tokenizer_path,
    )
    with running_stack(
        module_nats.url,
        worker_overrides={"sim": sim},
        ingress_overrides={"tool_call_parser": "hermes", "reasoning_parser": "think"},
    ) as s:
        yield s


@pytest.fixture(scope="module")
def client(stack):
    return openai.OpenAI(base_url=stack.base_url, api_key="unused", max_retries=0, timeout=30)


def chat(client, stream: bool, **kwargs):
    """A chat completion, streamed or not; streamed, the client's own helper assembles it."""
    kwargs = {"model": MODEL, "max_tokens": 200, "temperature": 0, **kwargs}
    if not stream:
        return client.chat.completions.create(**kwargs)
    with client.chat.completions.stream(**kwargs, stream_options={"include_usage": True}) as events:
        return events.get_final_completion()


def assert_valid_calls(message) -> None:
    assert message.tool_calls
    for call in message.tool_calls:
        assert call.id and call.type == "function"
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])


def reasoning_of(client, stream: bool, **kwargs) -> tuple[str | None, str | None, str]:
    """(reasoning, content, finish_reason) of a chat completion, streamed or not."""
    kwargs = {"model": MODEL, "max_tokens": 30, "temperature": 0, "messages": ASK, **kwargs}
    if not stream:
        choice = client.chat.completions.create(**kwargs).choices[0]
        return getattr(choice.message, "reasoning", None), choice.message.content, choice.finish_reason
    reasoning, content, finish = [], [], ""
    for chunk in client.chat.completions.create(**kwargs, stream=True):
        for choice in chunk.choices:
            reasoning.append(getattr(choice.delta, "reasoning", None) or "")
            content.append(choice.delta.content or "")
            finish = choice.finish_reason or finish
    return "".join(reasoning) or None, "".join(content) or None, finish


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_with_a_reasoning_parser_a_thought_comes_apart_from_the_content(client, stream):
    """``--reasoning-parser think``: a prompt the template ends inside a thought (DeepSeek-V3.1's
    ``thinking``, which the bundled template has) makes the output reasoning until ``</think>``;
    the sim never writes one, so all of it is, as a thought cut off by ``max_tokens`` is."""
    thought = reasoning_of(client, stream, extra_body={"chat_template_kwargs": {"thinking": True}})
    reasoning, content, finish = thought
    assert reasoning and content is None and finish in ("stop", "length")
    assert thought == reasoning_of(client, not stream, extra_body={"chat_template_kwargs": {"thinking": True}})
    hidden = {"chat_template_kwargs": {"thinking": True}, "include_reasoning": False}
    assert reasoning_of(client, stream, extra_body=hidden) == (None, None, finish)  # vLLM's include_reasoning
    # A constrained output is the answer from its first token (the grammar applies from there),
    # whatever the prompt opened: here the forced call's arguments, not reasoning.
    named = {"type": "function", "function": {"name": "get_weather"}}
    forced = chat(
        client,
        stream,
        messages=ASK,
        tools=TOOLS,
        tool_choice=named,
        extra_body={"chat_template_kwargs": {"thinking": True}},
    )
    assert_valid_calls(forced.choices[0].message)
    assert getattr(forced.choices[0].message, "reasoning", None) is None
    # No thought opened (Qwen3's enable_thinking false closes an empty one): all of it is content.
    for kwargs in ({}, {"chat_template_kwargs": {"enable_thinking": False}}):
        reasoning, content, _ = reasoning_of(client, stream, extra_body=kwargs)
        assert reasoning is None and content


# --- tool calls -----------------------------------------------------------------------------


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_a_named_tool_call_round_trip(client, stack, stream):
    named = {"type": "function", "function": {"name": "get_weather"}}
    first = chat(client, stream, messages=ASK, tools=TOOLS, tool_choice=named)
    choice = first.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert [c.function.name for c in choice.message.tool_calls] == ["get_weather"]
    assert_valid_calls(choice.message)
    call = choice.message.tool_calls[0]

    conversation = [
        *ASK,
        {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
        {"role": "tool", "tool_call_id": call.id, "content": "Sunny, 21 degrees."},
    ]
    final = chat(client, stream, messages=conversation, tools=TOOLS, max_tokens=12)
    answer = final.choices[0]
    assert answer.message.tool_calls is None and answer.message.content
    assert answer.finish_reason in ("stop", "length")
    # The template was shown the whole conversation: the call as the model writes one, the result.
    prompt = httpx.post(
        f"{stack.ingress.url}/tokenize", json={"messages": conversation, "tools": TOOLS, "model": MODEL}
    ).json()
    assert prompt["count"] == final.usage.prompt_tokens
    text = httpx.post(f"{stack.ingress.url}/detokenize", json={"tokens": prompt["tokens"]}).json()["prompt"]
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": ' in text
    assert "<tool_response>\nSunny, 21 degrees.\n</tool_response>" in text


@pytest.mark.parametrize("field", ["reasoning", "reasoning_content"])
def test_an_assistants_earlier_thinking_reaches_the_template(stack, field):
    """Interleaved thinking: a tool-calling turn sent back with its reasoning (vLLM's field, or
    its older name) gives it to the template, which renders it as Qwen3's does."""
    args = '{"city": "Paris", "unit": "celsius"}'
    call = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": args}}
    conversation = [
        *ASK,
        {"role": "assistant", "content": None, "tool_calls": [call], field: "Paris first."},
        {"role": "tool", "tool_call_id": "call_1", "content": "Sunny."},
    ]
    body = {"messages": conversation, "tools": TOOLS, "model": MODEL}
    tokens = httpx.post(f"{stack.ingress.url}/tokenize", json=body).json()["tokens"]
    text = httpx.post(f"{stack.ingress.url}/detokenize", json={"tokens": tokens}).json()["prompt"]
    assert "assistant\n<think>\nParis first.\n</think>\n\n<tool_call>" in text  # (special tokens not shown)


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_tool_choice_required_always_calls_a_tool(client, stream):
    names = set()
    for seed in range(4):
        reply = chat(client, stream, messages=ASK, tools=TOOLS, tool_choice="required", temperature=1, seed=seed)
        choice = reply.choices[0]
        assert choice.finish_reason == "tool_calls"
        assert_valid_calls(choice.message)
        names |= {c.function.name for c in choice.message.tool_calls}
    assert names <= set(SCHEMAS)


def test_parallel_tool_calls_false_makes_one_call(client):
    for seed in range(4):
        reply = chat(
            client, False, messages=ASK, tools=TOOLS, tool_choice="required", parallel_tool_calls=False, seed=seed
        )
        assert len(reply.choices[0].message.tool_calls) == 1


def test_tool_choice_none_answers_in_text_and_hides_the_tools(client, stack):
    with_tools = httpx.post(
        f"{stack.ingress.url}/v1/chat/completions",
        json={"model": MODEL, "messages": ASK, "tools": TOOLS, "tool_choice": "none", "max_tokens": 3},
    ).json()
    plain = client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=3)
    assert with_tools["usage"]["prompt_tokens"] == plain.usage.prompt_tokens
    assert with_tools["choices"][0]["message"].get("tool_calls") is None


@pytest.mark.parametrize(
    ("tool_choice", "param"),
    [
        ({"type": "function", "function": {"name": "no_such_tool"}}, "tool_choice"),
        ("sometimes", "tool_choice"),
    ],
)
def test_a_tool_choice_that_cannot_be_honoured_is_a_400(client, tool_choice, param):
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, tool_choice=tool_choice)
    assert caught.value.body["param"] == param


# --- structured outputs ---------------------------------------------------------------------


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_a_json_schema_response_validates(client, stream):
    fmt = {"type": "json_schema", "json_schema": {"name": "weather", "schema": WEATHER, "strict": True}}
    for seed in range(3):
        reply = chat(client, stream, messages=ASK, response_format=fmt, temperature=1, seed=seed)
        jsonschema.validate(json.loads(reply.choices[0].message.content), WEATHER)
        assert reply.choices[0].finish_reason == "stop"


def test_json_object_and_vllms_extensions_constrain_the_output(client):
    obj = chat(client, False, messages=ASK, response_format={"type": "json_object"})
    assert isinstance(json.loads(obj.choices[0].message.content), dict)
    guided = client.completions.create(
        model=MODEL, prompt="Track:", max_tokens=50, extra_body={"guided_json": TRAINS}, temperature=0
    )
    jsonschema.validate(json.loads(guided.choices[0].text), TRAINS)
    choice = client.completions.create(
        model=MODEL, prompt="Yes or no?", max_tokens=5, extra_body={"structured_outputs": {"choice": ["yes", "no"]}}
    )
    assert choice.choices[0].text in ("yes", "no")


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"response_format": {"type": "json_object"}, "guided_json": {"type": "object"}}, "guided_json"),
        ({"structured_outputs": {"regex": "a+", "choice": ["a"]}}, "structured_outputs"),
        ({"response_format": {"type": "json_schema"}}, "response_format"),
        ({"guided_json": "[1, 2]"}, "structured_outputs"),
    ],
)
def test_conflicting_or_malformed_constraints_are_a_400(client, extra, param):
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(model=MODEL, messages=ASK, extra_body=extra)
    assert caught.value.body["param"] == param


# --- logprobs ---------------------------------------------------------------------------------


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_chat_logprobs_cover_every_token(client, stream):
    kwargs = {"model": MODEL, "messages": ASK, "logprobs": True, "top_logprobs": 3, "max_tokens": 20}
    kwargs["extra_body"] = {"ignore_eos": True}
    if stream:  # by hand: the client's stream helper refuses to assemble an output cut by length
        chunks = list(client.chat.completions.create(**kwargs, stream=True))
        text = "".join(c.choices[0].delta.content or "" for c in chunks)
        content = [e for c in chunks if c.choices[0].logprobs for e in c.choices[0].logprobs.content]
    else:
        reply = client.chat.completions.create(**kwargs)
        text, content = reply.choices[0].message.content, reply.choices[0].logprobs.content
        assert reply.usage.completion_tokens == 20
    assert len(content) == 20
    assert "".join(entry.token for entry in content) == text
    for entry in content:
        assert entry.logprob <= 0 and len(entry.top_logprobs) == 3
        assert entry.top_logprobs[0].logprob >= entry.top_logprobs[-1].logprob
        assert bytes(entry.bytes) == entry.token.encode()


def test_completion_logprobs_have_the_legacy_shape(client):
    reply = client.completions.create(
        model=MODEL,
        prompt="Count the wagons:",
        max_tokens=15,
        logprobs=2,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    lp = reply.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 15
    assert "".join(lp.tokens) == reply.choices[0].text
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(15)]
    assert all(len(top) >= 2 for top in lp.top_logprobs)
    streamed = client.completions.create(
        model=MODEL,
        prompt="Count the wagons:",
        max_tokens=15,
        logprobs=2,
        temperature=0,
        stream=True,
        extra_body={"ignore_eos": True},
    )
    tokens = [t for chunk in streamed for t in (chunk.choices[0].logprobs.tokens if chunk.choices[0].logprobs else [])]
    assert tokens == lp.tokens


def test_logprobs_out_of_range_are_a_400(client):
    for kwargs, param in (
        ({"logprobs": False, "top_logprobs": 2}, "top_logprobs"),
        ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ):
        with pytest.raises(openai.BadRequestError) as caught:
            client.chat.completions.create(model=MODEL, messages=ASK, **kwargs)
        assert caught.value.body["param"] == param


# --- sampling and limits ------------------------------------------------------------------------


def lengths(client, n: int = 12, **extra) -> list[tuple[int, str]]:
    out = []
    for seed in range(n):
        reply = client.completions.create(
            model=MODEL, prompt="Wagons:", max_tokens=40, seed=seed, extra_body=extra or None
        )
        out.append((reply.usage.completion_tokens, reply.choices[0].finish_reason))
    return out


def test_eos_ignore_eos_and_min_tokens_change_the_length(client):
    natural = lengths(client)
    assert any(n < 40 and reason == "stop" for n, reason in natural)  # EOS ends some early
    assert all(n == 40 and reason == "length" for n, reason in lengths(client, ignore_eos=True))
    assert all(n >= 30 for n, _ in lengths(client, min_tokens=30))


def test_stop_token_ids_end_the_output_without_their_text(client, stack):
    stops = list(range(LOW, HIGH, 2))  # half the tokens the sim draws from
    ended = lengths(client, n=6, stop_token_ids=stops, ignore_eos=True, min_tokens=3)
    assert all(3 <= n < 40 and reason == "stop" for n, reason in ended)
    reply = client.completions.create(
        model=MODEL,
        prompt="Wagons:",
        max_tokens=40,
        seed=1,
        logprobs=0,
        extra_body={"stop_token_ids": stops, "ignore_eos": True},
    )
    tokens = reply.choices[0].logprobs.tokens
    assert reply.choices[0].text == "".join(tokens[:-1])  # the stop token's text is not output
    shown = client.completions.create(
        model=MODEL,
        prompt="Wagons:",
        max_tokens=40,
        seed=1,
        extra_body={"stop_token_ids": stops, "ignore_eos": True, "include_stop_str_in_output": True},
    )
    assert shown.choices[0].text == "".join(tokens)


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"frequency_penalty": 2.5}, "frequency_penalty"),
        ({"top_k": -2}, "top_k"),
        ({"logit_bias": {"999999": 1}}, "logit_bias"),
        ({"logit_bias": {"5": 101}}, "logit_bias"),
        ({"stop_token_ids": [-1]}, "stop_token_ids"),
        ({"min_tokens": 50, "max_tokens": 10}, "min_tokens"),
        ({"repetition_penalty": 0}, "repetition_penalty"),
        ({"min_p": 1.5}, "min_p"),
    ],
)
def test_sampling_controls_out_of_range_are_a_400_naming_them(stack, extra, param):
    body = {"model": MODEL, "messages": ASK, "max_tokens": 10, **extra}
    reply = httpx.post(f"{stack.ingress.url}/v1/chat/completions", json=body)
    assert reply.status_code == 400, reply.text
    assert re.split(r"[.\[]", reply.json()["error"]["param"])[0] == param


# --- n choices ----------------------------------------------------------------------------------


def prefilled(stack) -> int:
    return sum(w.role.engine.counters.prompt_tokens for w in stack.workers_of("prefill"))


def test_n_choices_are_prefilled_once_and_come_back_indexed(client, stack):
    prompt = "Three ways to couple wagons, please. " * 4
    before = prefilled(stack)
    reply = client.completions.create(
        model=MODEL, prompt=prompt, max_tokens=12, n=3, temperature=1, seed=11, extra_body={"ignore_eos": True}
    )
    assert [c.index for c in reply.choices] == [0, 1, 2]
    assert len({c.text for c in reply.choices}) == 3  # sampled: three different texts
    assert all(c.finish_reason == "length" for c in reply.choices)
    assert reply.usage.completion_tokens == 36  # all three counted
    assert prefilled(stack) - before == reply.usage.prompt_tokens  # the prompt once, not three times

    streamed = client.completions.create(
        model=MODEL,
        prompt=prompt,
        max_tokens=12,
        n=3,
        temperature=1,
        seed=11,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"ignore_eos": True},
    )
    texts, reasons, usage = {}, {}, None
    for chunk in streamed:
        usage = chunk.usage or usage
        for choice in chunk.choices:
            texts[choice.index] = texts.get(choice.index, "") + choice.text
            if choice.finish_reason:
                reasons[choice.index] = choice.finish_reason
    assert texts == {c.index: c.text for c in reply.choices}  # seeded: the same three texts
    assert reasons == {0: "length", 1: "length", 2: "length"} and usage.completion_tokens == 36


def test_many_short_choices_all_come_back(client):
    """n = 128 two-token answers: 256 chunks for one request. The ingress's room for a
    stream counted max_tokens only; it overflowed, and the client waited until its timeout."""
    reply = client.chat.completions.create(
        model=MODEL, messages=ASK, n=128, max_tokens=2, temperature=1, extra_body={"ignore_eos": True}, timeout=30
    )
    assert [c.index for c in reply.choices] == list(range(128))
    assert all(c.finish_reason == "length" for c in reply.choices) and reply.usage.completion_tokens == 256


def test_n_chat_choices_with_a_forced_tool_call_each_call(client):
    named = {"type": "function", "function": {"name": "count_wagons"}}
    reply = client.chat.completions.create(
        model=MODEL, messages=ASK, tools=TOOLS, tool_choice=named, n=2, temperature=1, max_tokens=200
    )
    assert [c.index for c in reply.choices] == [0, 1]
    for choice in reply.choices:
        assert choice.finish_reason == "tool_calls"
        assert_valid_calls(choice.message)
    chunks = list(
        client.chat.completions.create(
            model=MODEL, messages=ASK, n=2, max_tokens=5, stream=True, extra_body={"ignore_eos": True}
        )
    )
    roles = [c.choices[0].index for c in chunks if c.choices and c.choices[0].delta.role == "assistant"]
    assert sorted(roles) == [0, 1]
    assert sorted(c.choices[0].index for c in chunks if c.choices and c.choices[0].finish_reason) == [0, 1]
