"""The sim engine: prefix cache, reproducible tokens, decode steps and the cost model.

Durations are never measured: ``anyio.sleep`` is replaced by a recorder, so the cost
model is checked by the seconds the engine asked to wait, not by a wall clock.
"""

from __future__ import annotations

import json

import anyio
import anyio.lowlevel
import msgspec
import pytest

import switchyard.workers.sim as sim
from switchyard.schemas import DecodeTask, PrefillTask, RequestSpec, SimKvHandle, StructuredOutput
from switchyard.workers.engine import StepOutput
from switchyard.workers.sim import SimCostModel, SimEngine, SimEngineConfig, sampling_key
from tests.support.factories import make_spec, prompt_of, usage_of

BLOCK = 16


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture
def sleeps(monkeypatch: pytest.MonkeyPatch) -> list[float]:
    """Every ``anyio.sleep`` the engine asks for, returned at once."""
    asked: list[float] = []

    async def fake_sleep(seconds: float) -> None:
        asked.append(seconds)
        await anyio.lowlevel.checkpoint()

    monkeypatch.setattr(sim.anyio, "sleep", fake_sleep)
    return asked


def prefill_task(spec: RequestSpec) -> PrefillTask:
    return PrefillTask(spec=spec, queued_s=0.0)


def decode_task(spec: RequestSpec, first_token: int = 0) -> DecodeTask:
    handle = SimKvHandle(worker_id="p", block_keys=spec.block_keys, num_tokens=len(spec.prompt_tokens))
    return DecodeTask(spec=spec, handle=handle, first_token=first_token, usage=usage_of(spec))


def engine(**config) -> SimEngine:
    return SimEngine(SimEngineConfig(**config), worker_id="sim-1")


async def cached_tokens(eng: SimEngine, spec: RequestSpec) -> int:
    (result,) = await eng.prefill([prefill_task(spec)])
    return result.cached_tokens


# --- prefix cache ---------------------------------------------------------------------------


@pytest.mark.anyio
async def test_repeated_prefix_is_cached_in_whole_blocks(sleeps: list[float]) -> None:
    eng = engine()
    base = prompt_of(3 * BLOCK + 5)
    assert await cached_tokens(eng, make_spec(prompt=base)) == 0
    # The same prompt again: its three full blocks hit, the 5-token tail never does.
    assert await cached_tokens(eng, make_spec(prompt=base)) == 3 * BLOCK
    # An extension shares the three full blocks (the old tail is now inside block 3: a miss).
    assert await cached_tokens(eng, make_spec(prompt=base + prompt_of(40, start=99))) == 3 * BLOCK
    # A change inside block 1 keeps only block 0.
    changed = list(base)
    changed[BLOCK + 2] += 1
    assert await cached_tokens(eng, make_spec(prompt=changed)) == BLOCK


@pytest.mark.anyio
async def test_cache_is_per_tenant(sleeps: list[float]) -> None:
    eng = engine()
    tokens = prompt_of(4 * BLOCK)
    await cached_tokens(eng, make_spec(prompt=tokens, tenant="a"))
    assert await cached_tokens(eng, make_spec(prompt=tokens, tenant="b")) == 0
    assert await cached_tokens(eng, make_spec(prompt=tokens, tenant="a")) == 4 * BLOCK


@pytest.mark.anyio
async def test_lru_bound_evicts_the_least_recently_used_blocks(sleeps: list[float]) -> None:
    eng = engine(cache_blocks=3)
    a = make_spec(prompt=prompt_of(2 * BLOCK, start=1))
    b = make_spec(prompt=prompt_of(BLOCK, start=2))
    c = make_spec(prompt=prompt_of(BLOCK, start=3))
    await cached_tokens(eng, a)
    await cached_tokens(eng, b)  # cache (oldest first): a0 a1 b0
    assert await cached_tokens(eng, a) == 2 * BLOCK  # a hit refreshes: b0 a0 a1
    await cached_tokens(eng, c)  # over the bound: b0 goes, not a0
    assert await cached_tokens(eng, b) == 0  # ... and b0 returns, evicting a0
    assert await cached_tokens(eng, c) == BLOCK
    assert await cached_tokens(eng, a) == 0  # a0 gone: the chain breaks at block 0


# --- reproducible tokens ---------------------------------------------------------------------


@pytest.mark.anyio
async def test_greedy_output_is_identical_across_engines(sleeps: list[float]) -> None:
    spec = make_spec("greedy-1", prompt_len=40, max_tokens=6, temperature=0.0)
    prefill_engine, decode_engine = engine(), SimEngine(SimEngineConfig(), worker_id="sim-2")
    (result,) = await prefill_engine.prefill([prefill_task(spec)])
    key = sampling_key(prefill_task(spec))
    assert sampling_key(decode_task(spec)) == key
    assert result.first_token == prefill_engine.token(key, 0)

    decode_engine.add(decode_task(spec, result.first_token))
    steps = [await decode_engine.step() for _ in range(5)]
    assert [s[0].position for s in steps] == [1, 2, 3, 4, 5]
    assert [s[0].token for s in steps] == [prefill_engine.token(key, i) for i in range(1, 6)]


def test_greedy_key_depends_on_the_prompt_only() -> None:
    tokens = prompt_of(30)
    same_a = make_spec("a", prompt=tokens, temperature=0.0)
    same_b = make_spec("b", prompt=tokens, temperature=0.0)
    other = make_spec("c", prompt=tokens[:-1], temperature=0.0)
    assert sampling_key(prefill_task(same_a)) == sampling_key(prefill_task(same_b))
    assert sampling_key(prefill_task(same_a)) != sampling_key(prefill_task(other))


def test_seeded_and_sampled_keys() -> None:
    tokens = prompt_of(30)
    seeded = [make_spec(rid, prompt=tokens, temperature=1.0, seed=7) for rid in ("a", "b")]
    assert sampling_key(prefill_task(seeded[0])) == sampling_key(prefill_task(seeded[1]))
    assert sampling_key(prefill_task(seeded[0])) != sampling_key(
        prefill_task(make_spec("a", prompt=tokens, temperature=1.0, seed=8))
    )
    sampled = [make_spec(rid, prompt=tokens, temperature=1.0) for rid in ("a", "b")]
    # Sampled without a seed: a fresh key per request, but the same one on both of its workers.
    assert sampling_key(prefill_task(sampled[0])) != sampling_key(prefill_task(sampled[1]))
    assert sampling_key(prefill_task(sampled[0])) == sampling_key(decode_task(sampled[0]))


def test_tokens_stay_in_the_configured_range() -> None:
    eng = engine(token_low=100, token_high=110)
    tokens = {eng.token(key, pos) for key in range(20) for pos in range(50)}
    assert tokens <= set(range(100, 110))
    assert len(tokens) == 10


def test_empty_token_range_is_refused() -> None:
    with pytest.raises(ValueError, match="empty token range"):
        engine(token_low=10, token_high=10)


# --- decode ----------------------------------------------------------------------------------


@pytest.mark.anyio
@pytest.mark.parametrize("max_tokens", [2, 3, 8])
async def test_decode_emits_max_tokens_minus_one_then_length(sleeps: list[float], max_tokens: int) -> None:
    eng = engine()
    spec = make_spec(prompt_len=20, max_tokens=max_tokens)
    eng.add(decode_task(spec))
    outputs = []
    while eng.running:
        outputs += await eng.step()
        assert len(outputs) < 100, "decode never finished"
    assert len(outputs) == max_tokens - 1
    assert [o.position for o in outputs] == list(range(1, max_tokens))
    assert [o.finished for o in outputs] == [None] * (max_tokens - 2) + ["length"]
    assert eng.held_tokens == 0


@pytest.mark.anyio
async def test_continuous_batch_steps_every_running_sequence(sleeps: list[float]) -> None:
    eng = engine()
    short, long = make_spec("short", max_tokens=2), make_spec("long", max_tokens=4)
    eng.add(decode_task(short))
    eng.add(decode_task(long))
    first = await eng.step()
    assert [(o.request_id, o.finished) for o in first] == [("short", "length"), ("long", None)]
    assert eng.running == 1
    rest = [await eng.step(), await eng.step()]
    assert [[(o.request_id, o.position, o.finished) for o in s] for s in rest] == [
        [("long", 2, None)],
        [("long", 3, "length")],
    ]


@pytest.mark.anyio
async def test_abort_frees_held_tokens(sleeps: list[float]) -> None:
    eng = engine()
    a = make_spec("a", prompt_len=20, max_tokens=10)
    b = make_spec("b", prompt_len=5, max_tokens=7)
    eng.add(decode_task(a))
    eng.add(decode_task(b))
    assert (eng.running, eng.held_tokens) == (2, 30 + 12)
    assert eng.abort("a") is True
    assert (eng.running, eng.held_tokens) == (1, 12)
    assert eng.abort("a") is False and eng.abort("never") is False
    assert eng.held_tokens == 12
    assert [o.request_id for o in await eng.step()] == ["b"]


# --- cost model ------------------------------------------------------------------------------


def test_cost_model_is_linear() -> None:
    cost = SimCostModel(
        prefill_base_s=0.01, prefill_per_token_s=0.001, decode_step_base_s=0.002, decode_step_per_seq_s=0.0005
    )
    assert cost.prefill_s(0) == pytest.approx(0.01)
    assert cost.prefill_s(1000) == pytest.approx(1.01)
    assert cost.decode_step_s(8) == pytest.approx(0.006)
    assert SimCostModel().prefill_s(10_000) == 0.0 and SimCostModel().decode_step_s(64) == 0.0


@pytest.mark.anyio
async def test_prefill_time_counts_only_uncached_tokens(sleeps: list[float]) -> None:
    eng = engine(cost=SimCostModel(prefill_base_s=0.5, prefill_per_token_s=0.01))
    prompt = prompt_of(4 * BLOCK + 3)
    await eng.prefill([prefill_task(make_spec(prompt=prompt))])
    await eng.prefill([prefill_task(make_spec(prompt=prompt))])
    longer = make_spec(prompt=prompt_of(10 * BLOCK, start=5))
    await eng.prefill([prefill_task(longer)])
    assert sleeps == pytest.approx([0.5 + 0.01 * 67, 0.5 + 0.01 * 3, 0.5 + 0.01 * 160])


@pytest.mark.anyio
async def test_a_prefill_batch_costs_its_uncached_tokens_together(sleeps: list[float]) -> None:
    eng = engine(cost=SimCostModel(prefill_base_s=1.0, prefill_per_token_s=0.01))
    warm = make_spec(prompt=prompt_of(2 * BLOCK, start=1))
    await eng.prefill([prefill_task(warm)])
    cold = make_spec(prompt=prompt_of(30, start=2))
    results = await eng.prefill([prefill_task(make_spec(prompt=warm.prompt_tokens)), prefill_task(cold)])
    assert [r.cached_tokens for r in results] == [2 * BLOCK, 0]
    assert sleeps[-1] == pytest.approx(1.0 + 0.01 * 30)


@pytest.mark.anyio
async def test_decode_step_time_grows_with_the_batch(sleeps: list[float]) -> None:
    eng = engine(cost=SimCostModel(decode_step_base_s=0.1, decode_step_per_seq_s=0.02))
    for i in range(3):
        eng.add(decode_task(make_spec(f"r{i}", max_tokens=10)))
    await eng.step()
    eng.abort("r0")
    await eng.step()
    assert sleeps == pytest.approx([0.16, 0.14])


@pytest.mark.anyio
async def test_prefill_result_carries_handle_and_usage(sleeps: list[float]) -> None:
    eng = engine()
    spec = make_spec("r1", prompt_len=3 * BLOCK)
    (result,) = await eng.prefill([prefill_task(spec)])
    assert result.request_id == "r1"
    assert result.handle == SimKvHandle(worker_id="sim-1", block_keys=spec.block_keys, num_tokens=3 * BLOCK)
    assert result.prefill_s >= 0.0


# --- the host tier ------------------------------------------------------------------------------


def _tiered(device: int, host: int, fetch: float = 0.0) -> SimEngine:
    return SimEngine(
        SimEngineConfig(cache_blocks=device, host_cache_blocks=host, cost=SimCostModel(host_fetch_per_token_s=fetch)),
        "w",
    )


@pytest.mark.anyio
async def test_device_evictions_move_to_the_host_tier_and_are_reported(sleeps: list[float]):
    engine = _tiered(device=2, host=4)
    first = prefill_task(make_spec("a", prompt_len=BLOCK * 2))
    second = prefill_task(make_spec("b", prompt_len=BLOCK * 2))
    await engine.prefill([first])
    engine.take_kv_events()
    await engine.prefill([second])
    events = {(type(e).__name__, e.tier): sorted(e.keys) for e in engine.take_kv_events()}
    a_keys = sorted(first.spec.block_keys)
    assert events[("BlocksRemoved", "device")] == a_keys and events[("BlocksStored", "host")] == a_keys
    assert engine.cached_blocks() == {"device": second.spec.block_keys, "host": first.spec.block_keys}


@pytest.mark.anyio
async def test_a_host_hit_is_cached_costs_only_its_fetch_and_moves_back_up(sleeps: list[float]):
    engine = _tiered(device=2, host=4, fetch=0.001)
    a = make_spec("a", prompt_len=BLOCK * 2)
    await engine.prefill([prefill_task(a)])
    await engine.prefill([prefill_task(make_spec("b", prompt_len=BLOCK * 2))])  # a goes to host
    sleeps.clear()
    again = make_spec("a2", prompt=list(a.prompt_tokens))
    (result,) = await engine.prefill([prefill_task(again)])
    assert result.cached_tokens == BLOCK * 2
    assert sleeps == [pytest.approx(0.001 * BLOCK * 2)]  # fetched, not recomputed
    assert engine.cached_blocks()["device"] == again.block_keys  # promoted back to the device


def test_no_host_tier_reports_only_the_device():
    assert set(_tiered(device=2, host=0).cached_blocks()) == {"device"}


# --- sampling controls, logprobs, structured outputs -----------------------------------------


def with_sampling(spec: RequestSpec, **changes) -> RequestSpec:
    return msgspec.structs.replace(spec, sampling=msgspec.structs.replace(spec.sampling, **changes))


async def decode_all(eng: SimEngine, task: DecodeTask) -> list[StepOutput]:
    eng.add(task)
    outputs: list[StepOutput] = []
    while eng.running:
        outputs += await eng.step()
    return outputs


EOS = 4095


@pytest.mark.anyio
async def test_eos_ends_early_unless_ignored_and_never_before_min_tokens(sleeps) -> None:
    eng = engine(token_low=256, token_high=300, eos_token_id=EOS, eos_per_token=0.3)
    spec = make_spec(max_tokens=40, seed=3)
    natural = await decode_all(eng, decode_task(spec))
    assert natural[-1].token == EOS and natural[-1].finished == "stop" and len(natural) < 39
    ignored = await decode_all(eng, decode_task(with_sampling(spec, ignore_eos=True)))
    assert len(ignored) == 39 and ignored[-1].finished == "length" and EOS not in [o.token for o in ignored]
    held = await decode_all(eng, decode_task(with_sampling(spec, min_tokens=30)))
    assert all(o.token != EOS for o in held if o.position < 30)


@pytest.mark.anyio
async def test_a_stop_token_ends_the_output_after_min_tokens(sleeps) -> None:
    eng = engine(token_low=256, token_high=300)
    stops = list(range(256, 300, 2))
    spec = with_sampling(make_spec(max_tokens=40, seed=5), stop_token_ids=stops, min_tokens=6)
    outputs = await decode_all(eng, decode_task(spec))
    assert outputs[-1].token in stops and outputs[-1].finished == "stop"
    assert all(o.token not in stops for o in outputs[:-1])
    assert outputs[-1].position >= 6


@pytest.mark.anyio
async def test_logprobs_come_with_every_token_when_asked(sleeps) -> None:
    eng = engine()
    spec = with_sampling(make_spec(max_tokens=5), logprobs=3)
    (result,) = await eng.prefill([prefill_task(spec)])
    assert result.logprobs is not None and result.logprobs.top_ids[0] == result.first_token
    outputs = await decode_all(eng, decode_task(spec, result.first_token))
    for out in outputs:
        assert out.logprobs is not None and len(out.logprobs.top_ids) == 3
        assert out.logprobs.top_ids[0] == out.token and out.logprobs.logprob <= -1
    (plain,) = await eng.prefill([prefill_task(make_spec())])
    assert plain.logprobs is None


@pytest.mark.anyio
async def test_a_structured_output_is_sampled_whole_by_decode_and_is_an_instance(sleeps) -> None:
    from tokenizers import Tokenizer

    from tests.support.stack import SIM

    eng = SimEngine(SIM, worker_id="sim-1")
    schema = '{"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}'
    spec = with_sampling(make_spec(max_tokens=100), structured=StructuredOutput(json_schema=schema))
    assert spec.sampling.decode_samples_first
    outputs = await decode_all(eng, decode_task(spec, first_token=-1))
    assert outputs[0].position == 0  # token 0 is decode's own
    assert outputs[-1].finished == "stop" and outputs[-1].token == SIM.eos_token_id
    text = Tokenizer.from_file(SIM.tokenizer_path).decode([o.token for o in outputs[:-1]])
    assert isinstance(json.loads(text)["n"], int)
    grammar = with_sampling(make_spec(), structured=StructuredOutput(grammar="root ::= 'a'"))
    assert [o.finished for o in await decode_all(eng, decode_task(grammar, -1))] == ["abort"]
