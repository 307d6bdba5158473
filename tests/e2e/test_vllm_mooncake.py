"""Real vLLM engines (the CPU build), KV handed from prefill to decode through a real
Mooncake Store with vLLM's ``MooncakeStoreConnector``, through the real HTTP API.

One stack for the module (``switchyard up --engine vllm``: nats, Mooncake master and
segment, scheduler, a prefill and a decode engine, ingress): engines take a minute to
boot here. What the tests prove, from the engines' own counters rather than timing:
- greedy output through prefill -> decode on two engines is one engine's output alone;
- the decode engine loaded every whole block it was handed (it did not recompute);
- a second request sharing a long prefix reports exactly the shared whole blocks as
  ``cached_tokens`` (body and final SSE chunk), and the prefill engine computed only the rest;
- the scheduler's index hears the engine's KV events under the keys the ingress computes;
- with the Mooncake segment killed, requests still complete correctly by recomputing,
  and the fallback is counted (``switchyard_worker_kv_fallbacks``);
- a stream whose decode engine is killed mid-stream continues after up restarts it, with
  the undisturbed greedy text.
"""

from __future__ import annotations

import itertools
import json
import random

import httpx
import jsonschema
import openai
import pytest

from tests.support.stack import wait_until
from tests.support.vllm_stack import (
    BLOCK,
    MAX_TOKENS,
    BusWatch,
    UpStack,
    assert_greedy_matches_reference,
    settled_stats,
    vllm_stack,
)

# Not skipped when vLLM is missing: `make test` installs it, and its absence is a failure.
pytestmark = [pytest.mark.slow, pytest.mark.vllm, pytest.mark.timeout(900)]

PREFIX = [random.Random(11).randrange(256, 4000) for _ in range(10 * BLOCK + 5)]  # 10 whole blocks and a bit


@pytest.fixture(scope="module")
def stack(module_nats, tmp_path_factory) -> UpStack:
    log = tmp_path_factory.mktemp("vllm") / "up.log"
    # A stream whose decode engine is killed waits for up to restart it (an engine boots in 30-105 s
    # on these machines): the stream's idle timeout (60 s by default) must outlast that wait too.
    extra = ["--migration-wait-s", "300", "--stream-idle-timeout-s", "300", "--tool-call-parser", "hermes"]
    with vllm_stack(module_nats.url, log, kv_transfer="mooncake-store", extra=extra) as s:
        yield s


def test_greedy_output_through_prefill_and_decode_is_one_engines_output(references, client, bus, tokenizer):
    assert_greedy_matches_reference(client, bus, tokenizer, references)


def test_logprobs_through_prefill_and_decode_are_one_engines(references, client):
    """The KV handed over is right, not only the greedy argmax: every token's logprob (token 0
    from the prefill engine, the rest from the decode engine on the loaded KV) is what one
    engine alone computes."""
    for prompt, expected in zip(references["prompts"], references["outputs"], strict=True):
        response = client.completions.create(
            model="tiny-llama", prompt=prompt, max_tokens=MAX_TOKENS, temperature=0, logprobs=2
        )
        got = response.choices[0].logprobs.token_logprobs
        assert got == pytest.approx(expected["logprobs"], abs=2e-3), f"prompt of {len(prompt)} tokens"
        assert all(len(top) >= 2 for top in response.choices[0].logprobs.top_logprobs)


ANSWER = {
    "type": "object",
    "properties": {
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
        "track": {"type": "integer", "enum": [1, 2, 9]},
        "open": {"type": "boolean"},
    },
    "required": ["unit", "track", "open"],
    "additionalProperties": False,
}


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_structured_outputs_hold_across_prefill_and_decode(client, bus, stream):
    """A random model under the engine's grammar still writes valid JSON: the grammar holds
    from token 0 (sampled on the decode engine, docs/architecture.md) to the end; the decode
    engine loaded the prompt's KV from the prefill."""
    fmt = {"type": "json_schema", "json_schema": {"name": "answer", "schema": ANSWER, "strict": True}}
    named = {"type": "function", "function": {"name": "set_track"}}
    tools = [{"type": "function", "function": {"name": "set_track", "parameters": ANSWER}}]
    messages = [{"role": "user", "content": "Which track, and is it open? " * 6}]
    for seed in range(3):
        for extra in ({"response_format": fmt}, {"tools": tools, "tool_choice": named}):
            kwargs = {"model": "tiny-llama", "messages": messages, "max_tokens": 200, "seed": seed, **extra}
            if stream:
                chunks = list(client.chat.completions.create(**kwargs, stream=True))
                rid = chunks[0].id
                text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
                arguments = "".join(
                    call.function.arguments or ""
                    for c in chunks
                    if c.choices and c.choices[0].delta.tool_calls
                    for call in c.choices[0].delta.tool_calls
                )
            else:
                reply = client.chat.completions.create(**kwargs)
                rid, message = reply.id, reply.choices[0].message
                text = message.content or ""
                arguments = message.tool_calls[0].function.arguments if message.tool_calls else ""
            value = json.loads(arguments if "tools" in extra else text)
            jsonschema.validate(value, ANSWER)
            assert wait_until(lambda r=rid: r in bus.finished(), 5)
            finished = bus.finished()[rid]
            assert finished.kv_loaded_tokens == finished.kv_expected_tokens > 0  # handed over, not recomputed


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_a_schema_the_engine_cannot_compile_is_the_clients_400_not_an_empty_answer(client, stream):
    """vLLM refuses a JSON schema none of its grammar backends compiles. Before, that came
    back 200 with no content and finish_reason "abort"; vLLM's own server answers 400."""
    fmt = {"type": "json_schema", "json_schema": {"name": "broken", "schema": {"type": "objekt"}}}
    messages = [{"role": "user", "content": "Describe a track."}]
    with pytest.raises(openai.BadRequestError) as refused:
        reply = client.chat.completions.create(
            model="tiny-llama", messages=messages, max_tokens=20, response_format=fmt, stream=stream
        )
        if stream:
            list(reply)  # a streamed refusal would come as the stream's error event
    assert refused.value.status_code == 400 and "objekt" in refused.value.message, refused.value.message
    after = client.chat.completions.create(model="tiny-llama", messages=messages, max_tokens=3)
    assert after.choices[0].finish_reason == "length"  # the engines serve on


def test_a_request_vllm_refuses_before_it_steps_is_a_400_not_a_hang(client):
    """vLLM refuses n > 1 with greedy sampling when it builds the request's SamplingParams,
    before any await: the decode ended before the worker's loop looked at its engine, and the
    refusal waited there for a step nobody took (the client hung until its timeout)."""
    with pytest.raises(openai.BadRequestError) as refused:
        client.with_options(timeout=20).completions.create(
            model="tiny-llama", prompt="Signals change", max_tokens=4, temperature=0, n=2
        )
    assert refused.value.status_code == 400 and "greedy" in refused.value.message, refused.value.message


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_a_tool_call_round_trip(client, stream):
    """Call (constrained to the named tool's schema), tool result, final answer: the template
    renders the call and the result into the next prompt, and the engine answers in text."""
    tools = [{"type": "function", "function": {"name": "set_track", "parameters": ANSWER}}]
    named = {"type": "function", "function": {"name": "set_track"}}
    ask = [{"role": "user", "content": "Set track nine open, in celsius."}]
    # Sampled, seeded: greedy, the random tiny model may fill max_tokens with the whitespace the
    # JSON grammar allows between tokens (a real model does not).
    kwargs = {"model": "tiny-llama", "tools": tools, "max_tokens": 200, "temperature": 1.0, "seed": 1}
    if stream:
        usage = {"include_usage": True}
        with client.chat.completions.stream(messages=ask, tool_choice=named, stream_options=usage, **kwargs) as events:
            first = events.get_final_completion()
    else:
        first = client.chat.completions.create(messages=ask, tool_choice=named, **kwargs)
    (call,) = first.choices[0].message.tool_calls
    assert first.choices[0].finish_reason == "tool_calls" and call.function.name == "set_track"
    jsonschema.validate(json.loads(call.function.arguments), ANSWER)
    conversation = [
        *ask,
        {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
        {"role": "tool", "tool_call_id": call.id, "content": "Track 9 is open."},
    ]
    final = client.chat.completions.create(messages=conversation, **kwargs | {"max_tokens": 6})
    assert final.choices[0].message.content and final.choices[0].message.tool_calls is None
    assert final.usage.prompt_tokens > first.usage.prompt_tokens  # the call and its result joined the prompt


def test_a_batch_runs_on_the_engines(client):
    """The Batch API once on the vllm engine: three chat lines sharing a system prompt go through
    the stack's batch runner, prefill -> decode, and come back one output line each with their
    usage (the shared prefix found in the cache after the first)."""
    import time

    system = "You dispatch freight trains between yards and answer very briefly. " * 8
    lines = [
        json.dumps(
            {
                "custom_id": f"q{i}",
                "method": "POST",
                "url": "/v1/chat/completions",
                "body": {
                    "model": "tiny-llama",
                    "messages": [{"role": "system", "content": system}, {"role": "user", "content": f"Yard {i}?"}],
                    "max_tokens": 4,
                    "temperature": 0,
                },
            }
        )
        for i in range(3)
    ]
    file = client.files.create(file=("in.jsonl", ("\n".join(lines) + "\n").encode()), purpose="batch")
    batch = client.batches.create(input_file_id=file.id, endpoint="/v1/chat/completions", completion_window="24h")
    deadline = time.monotonic() + 120
    while (batch := client.batches.retrieve(batch.id)).status not in ("completed", "failed", "expired", "cancelled"):
        assert time.monotonic() < deadline, batch.status
        time.sleep(0.5)
    assert batch.status == "completed" and batch.request_counts.completed == 3
    out = {
        json.loads(x)["custom_id"]: json.loads(x) for x in client.files.content(batch.output_file_id).text.splitlines()
    }
    assert sorted(out) == ["q0", "q1", "q2"]
    usages = [out[k]["response"]["body"]["usage"] for k in sorted(out)]
    assert all(u["completion_tokens"] == 4 for u in usages)
    assert max(u["prompt_tokens_details"]["cached_tokens"] for u in usages) >= BLOCK  # the system prompt, cached


def test_n_choices_are_prefilled_once_and_decoded_side_by_side(client, bus):
    """n=3: the prefill engine computes the prompt once (its own counters), the decode engine
    samples three choices from the KV it was handed (vLLM's n, seeded: seed + i per choice)."""
    prompt = [random.Random(23).randrange(256, 4000) for _ in range(3 * BLOCK + 7)]
    before = settled_stats(bus, "prefill")
    reply = client.completions.create(
        model="tiny-llama", prompt=prompt, max_tokens=8, n=3, temperature=1.0, seed=5, extra_body={"ignore_eos": True}
    )
    assert [c.index for c in reply.choices] == [0, 1, 2]
    assert len({c.text for c in reply.choices}) > 1 and reply.usage.completion_tokens == 24
    after = settled_stats(bus, "prefill", more_than=before.prompt_tokens)
    assert after.prompt_tokens - before.prompt_tokens == len(prompt)  # once, not three times
    assert wait_until(lambda: reply.id in bus.finished(), 5)
    finished = bus.finished()[reply.id]
    assert finished.generated_tokens == 24
    assert finished.kv_loaded_tokens == finished.kv_expected_tokens == 3 * BLOCK


def test_shared_prefix_is_reported_cached_and_not_recomputed(client, bus, tokenizer):
    first = client.completions.create(model="tiny-llama", prompt=[*PREFIX, 300, 301], max_tokens=4, temperature=0)
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    assert wait_until(lambda: bus.stats("prefill").prompt_tokens >= 1, 5)
    before = settled_stats(bus, "prefill")

    second = client.completions.create(model="tiny-llama", prompt=[*PREFIX, 400, 401, 402], max_tokens=4, temperature=0)
    shared = len(PREFIX) // BLOCK * BLOCK
    assert second.usage.prompt_tokens_details.cached_tokens == shared
    after = settled_stats(bus, "prefill", more_than=before.prompt_tokens)
    # The prefill engine's own counters: it computed only the tokens past the shared blocks.
    assert after.prompt_tokens - before.prompt_tokens == len(PREFIX) + 3
    assert after.computed_tokens - before.computed_tokens == len(PREFIX) + 3 - shared

    # Streamed, the final chunk carries the same usage (prefill side only: the decode
    # engine's own reuse of the handed-over blocks is not added on top).
    messages = [{"role": "user", "content": tokenizer.decode(PREFIX * 2)}]
    for _ in range(2):
        chunks = list(
            client.chat.completions.create(
                model="tiny-llama",
                messages=messages,
                max_tokens=4,
                temperature=0,
                stream=True,
                stream_options={"include_usage": True},
            )
        )
    usage = chunks[-1].usage
    assert usage.prompt_tokens_details.cached_tokens == _whole_blocks(usage.prompt_tokens)


def test_metrics_export_the_engines_counters(stack, client):
    client.completions.create(model="tiny-llama", prompt=[*PREFIX, 500], max_tokens=3, temperature=0)
    text = httpx.get(stack.url + "/metrics", timeout=5).text
    assert 'switchyard_worker_prompt_tokens{engine="vllm",role="prefill",source="computed"' in text
    assert 'switchyard_worker_boot_seconds{engine="vllm",role="decode"' in text
    boot = [
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith("switchyard_worker_boot_seconds{")
    ]
    assert len(boot) == 2 and all(0 < b < 600 for b in boot)


def test_the_index_holds_the_engines_blocks_under_the_ingress_keys(stack, bus):
    """The scheduler's prefix index is fed by the engine's KV events: a prompt already
    computed places its next request by prefix; here we check the keys agree by asking the
    index through the scheduler's status of a worker's held blocks."""
    from switchyard.kvbus import KeyScheme

    keys = KeyScheme("vllm-sha256-cbor").keys([*PREFIX, 300, 301], BLOCK, "default", "tiny-llama")
    snapshot = _snapshot(bus, "prefill")
    assert set(keys) <= set(snapshot), "the engine's stored blocks are not the ingress's keys"


def test_the_segment_dying_between_prefill_and_decode_means_recompute(stack, bus, references):
    """The test plays the scheduler for one request, on the bus, so that the segment dies
    exactly after the prefill stored the KV and before the decode engine loads it."""
    from switchyard.kvbus import KeyScheme
    from switchyard.schemas import (
        DecodeTask,
        PrefillDone,
        PrefillTask,
        RequestSpec,
        SamplingParams,
        TaskAck,
        codec,
        subjects,
    )

    prompt, expected = references["prompts"][1], references["outputs"][1]
    workers = {w.role: w.worker_id for w in bus.status().workers}
    spec = RequestSpec(
        request_id="between-1",
        ingress_id="test-ingress",
        model="tiny-llama",
        prompt_tokens=prompt,
        block_size=BLOCK,
        block_keys=KeyScheme("vllm-sha256-cbor").keys(prompt, BLOCK, "between", "tiny-llama"),
        sampling=SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0),
        tenant="between",
    )
    chunks = []

    async def subscribe():
        async def on_batch(msg):
            chunks.extend(c for c in codec.STREAM_BATCH.decode(msg.data).chunks if c.request_id == spec.request_id)

        await bus._nc.subscribe(subjects.streams_of("test-ingress"), cb=on_batch)

    async def dispatch(worker_id: str, task) -> TaskAck:
        reply = await bus._nc.request(subjects.worker_tasks(worker_id), codec.WORKER_TASK.encode(task), timeout=5)
        return codec.TASK_ACK.decode(reply.data)

    bus.portal.call(subscribe)
    assert bus.portal.call(dispatch, workers["prefill"], PrefillTask(spec=spec, queued_s=0.0)).accepted
    assert wait_until(
        lambda: any(isinstance(e, PrefillDone) and e.request_id == spec.request_id for e in bus.events), 60
    )
    done = next(e for e in bus.events if isinstance(e, PrefillDone) and e.request_id == spec.request_id)
    (segment,) = stack.children("mooncake_client")
    segment.kill()
    segment.wait(10)
    task = DecodeTask(spec=spec, handle=done.handle, first_token=done.first_token, usage=done.usage)
    assert bus.portal.call(dispatch, workers["decode"], task).accepted
    assert wait_until(lambda: any(c.finish_reason for c in chunks), 60), "the decode never finished"
    tokens = {}
    for chunk in chunks:
        for i, token in enumerate(chunk.token_ids):
            tokens[chunk.seq + i] = token
    assert [tokens[i] for i in sorted(tokens)] == expected["tokens"]
    assert wait_until(lambda: spec.request_id in bus.finished(), 5)
    finished = bus.finished()[spec.request_id]
    assert finished.kv_expected_tokens == len(prompt) // BLOCK * BLOCK > 0
    assert finished.kv_loaded_tokens < finished.kv_expected_tokens, "loaded from a dead segment?"
    assert wait_until(lambda: len(stack.children("mooncake_client")) == 1, 30)  # the stack restarts it


def test_a_dead_mooncake_segment_means_recompute_not_failure(stack, client, bus, references, tokenizer):
    (segment,) = stack.children("mooncake_client")
    segment.kill()
    segment.wait(10)
    fallbacks = bus.stats("decode").kv_fallbacks
    # A tenant of its own: nothing of this prompt is cached anywhere, so decode must load it.
    prompt, expected = references["prompts"][0], references["outputs"][0]
    tenant_client = client.with_options(default_headers={"x-switchyard-tenant": "segment-test"})
    response = tenant_client.completions.create(model="tiny-llama", prompt=prompt, max_tokens=MAX_TOKENS, temperature=0)
    assert response.choices[0].text == tokenizer.decode(expected["tokens"])
    assert wait_until(lambda: response.id in bus.finished(), 5)
    finished = bus.finished()[response.id]
    assert finished.kv_loaded_tokens < finished.kv_expected_tokens
    assert wait_until(lambda: bus.stats("decode").kv_fallbacks > fallbacks, 5), "the fallback was not counted"
    # The stack restarts the segment; the handoff works again afterwards.
    assert wait_until(lambda: len(stack.children("mooncake_client")) == 1, 30)

    attempts = itertools.count(1)

    def handed_over() -> bool:
        tenant = f"after-{next(attempts)}"
        again = client.with_options(default_headers={"x-switchyard-tenant": tenant}).completions.create(
            model="tiny-llama", prompt=prompt, max_tokens=MAX_TOKENS, temperature=0
        )
        assert again.choices[0].text == tokenizer.decode(expected["tokens"])
        assert wait_until(lambda: again.id in bus.finished(), 5)
        done = bus.finished()[again.id]
        return done.kv_loaded_tokens == done.kv_expected_tokens

    assert wait_until(handed_over, 60, interval_s=2), "KV never went through the restarted segment"


def test_a_stream_whose_decode_engine_is_killed_continues_with_the_same_greedy_text(stack, client, tokenizer):
    """The decode engine SIGKILLed mid-stream: the ingress submits the prompt and the tokens the
    client has again, the prefill engine computes them (what the store holds is loaded), and the
    restarted decode engine goes on. The client's greedy text is that of an undisturbed run."""
    prompt = [random.Random(23).randrange(256, 4000) for _ in range(3 * BLOCK + 7)]
    tenant = client.with_options(default_headers={"x-switchyard-tenant": "migration"})
    undisturbed = tenant.completions.create(model="tiny-llama", prompt=prompt, max_tokens=400, temperature=0)
    before = _metric(httpx.get(stack.url + "/metrics").text, 'switchyard_migrations_total{outcome="resumed"}')
    (decode,) = stack.children("--child decode")
    stream = tenant.completions.create(model="tiny-llama", prompt=prompt, max_tokens=400, temperature=0, stream=True)
    parts, finish = [], None
    for chunk in stream:
        for choice in chunk.choices:
            parts.append(choice.text)
            finish = choice.finish_reason or finish
        if len(parts) == 2:
            decode.kill()
    assert "".join(parts) == undisturbed.choices[0].text and finish == undisturbed.choices[0].finish_reason
    after = _metric(httpx.get(stack.url + "/metrics").text, 'switchyard_migrations_total{outcome="resumed"}')
    assert after == before + 1, "the stream ended before its decode engine was killed"


def _metric(text: str, name: str) -> float:
    line = next((line for line in text.splitlines() if line.startswith(name + " ")), None)
    return float(line.split()[1]) if line else 0.0


def _whole_blocks(prompt_tokens: int) -> int:
    """What a prefix cache can serve of a prompt: its whole blocks, but never its last token."""
    return (prompt_tokens - 1) // BLOCK * BLOCK


def _snapshot(bus: BusWatch, role: str) -> list[int]:
    from switchyard.schemas import KvSnapshot, KvSnapshotRequest, codec, subjects

    worker = next(w.worker_id for w in bus.status().workers if w.role == role)

    async def ask():
        reply = await bus._nc.request(
            subjects.kv_snapshot(worker),
            codec.KV_SNAPSHOT_REQUEST.encode(KvSnapshotRequest(scheduler_id="test")),
            timeout=5,
        )
        return codec.KV_SNAPSHOT.decode(reply.data)

    snapshot = bus.portal.call(ask)
    assert isinstance(snapshot, KvSnapshot)
    return [key for keys in snapshot.blocks.values() for key in keys]
