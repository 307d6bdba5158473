"""Mid-stream migration without a bus: the continuation spec the ingress builds, and the
workers numbering and producing a continued request's output exactly as an undisturbed run."""

from __future__ import annotations

import anyio.lowlevel
import pytest

import switchyard.workers.sim as sim
from switchyard.ingress.app import continuation_spec
from switchyard.kvbus import KeyScheme
from switchyard.schemas import DecodeTask, PrefillTask, PromptUsage, RequestSpec, SimKvHandle
from switchyard.workers.engine import PrefillResult
from switchyard.workers.handoff import first_token
from switchyard.workers.sim import SimEngine, SimEngineConfig
from tests.support.factories import make_spec

BLAKE = KeyScheme("blake2b", "vllm-none-hash")


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
