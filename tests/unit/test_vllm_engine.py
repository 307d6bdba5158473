"""The vllm engine's structure without booting vLLM: a fake ``AsyncLLM`` stands in for
the engine (``VllmEngine._boot``), so what is tested is ours: its tasks live in one task
group, a task that dies takes the worker down, decode and abort, and token 0 that ends
the request."""

from __future__ import annotations

from collections.abc import Callable
from types import SimpleNamespace

import anyio
import pytest

from switchyard.schemas import DecodeTask, MooncakeStoreKvHandle, PrefillTask, PromptUsage
from switchyard.workers.decode import DecodeRole
from switchyard.workers.errors import EngineError
from switchyard.workers.handoff import first_token
from switchyard.workers.runtime import WorkerRuntime
from switchyard.workers.vllm_config import VllmEngineConfig
from switchyard.workers.vllm_engine import VllmEngine, VllmKvEvents, first_token_finish
from tests.support.factories import make_spec
from tests.support.stack import worker_config

pytestmark = pytest.mark.anyio


def output(tokens: list[int], finish: str | None = None) -> SimpleNamespace:
    completion = SimpleNamespace(token_ids=tokens, finish_reason=finish)
    return SimpleNamespace(
        outputs=[completion], num_cached_tokens=0, kv_transfer_params=None, finished=finish is not None
    )


class FakeLLM:
    """vLLM's AsyncLLM as the engine uses it: ``generate`` per request, ``abort``, ``shutdown``."""

    def __init__(self, script: Callable[[str], list[SimpleNamespace]], step_s: float = 0.0) -> None:
        self.script = script  # request id -> its outputs
        self.step_s = step_s
        self.errored = False
        self.aborted: list[str] = []
        self.shut_down = False

    async def generate(self, prompt, params, request_id: str):
        for out in self.script(request_id):
            await anyio.sleep(self.step_s)
            yield out

    async def abort(self, request_id: str) -> None:
        self.aborted.append(request_id)

    def shutdown(self) -> None:
        self.shut_down = True


@pytest.fixture
def fake_vllm(monkeypatch):
    """Makes ``VllmEngine`` boot the fake (set ``.llm``) with a KV-event bridge that idles
    (or does what ``.bridge`` says)."""
    state = SimpleNamespace(llm=FakeLLM(lambda rid: [output([1], "length")]), bridge=None, order=[])

    async def bridge(self, *, task_status) -> None:
        state.order.append("bridge connected")
        task_status.started()
        if state.bridge is not None:
            await state.bridge()
        await anyio.sleep_forever()

    monkeypatch.setattr(VllmEngine, "_prepare_environment", lambda self: None)

    def boot(self) -> FakeLLM:
        state.order.append("engine booted")
        return state.llm

    monkeypatch.setattr(VllmEngine, "_boot", boot)
    monkeypatch.setattr(VllmKvEvents, "run", bridge)
    return state


def engine(tmp_path, role: str = "decode") -> VllmEngine:
    return VllmEngine(VllmEngineConfig(work_dir=str(tmp_path), kv_transfer="none"), "model", role, "w-1")


def decode_task(rid: str, max_tokens: int = 8) -> DecodeTask:
    spec = make_spec(rid, max_tokens=max_tokens)
    handle = MooncakeStoreKvHandle(worker_id="p", num_tokens=len(spec.prompt_tokens), block_size=16)
    return DecodeTask(spec=spec, handle=handle, first_token=7, usage=PromptUsage(prompt_tokens=32, cached_tokens=0))


# --- a task that dies takes the worker down -----------------------------------------------------


async def test_a_dying_kv_event_bridge_takes_the_worker_down(fake_vllm, nats, tmp_path):
    async def fail() -> None:
        await anyio.sleep(0.3)  # the worker is up and serving by now
        raise RuntimeError("the ZMQ socket went away")

    fake_vllm.bridge = fail
    config = worker_config(nats.url, "decode").with_id()
    worker = WorkerRuntime(config, DecodeRole(engine(tmp_path), config.worker_id, config.token_budget))
    with anyio.fail_after(10), pytest.raises(BaseExceptionGroup) as caught:
        await worker.run()
    (error,) = caught.value.subgroup(EngineError).exceptions
    assert "KV-event bridge failed" in str(error) and "ZMQ socket" in str(error)
    assert fake_vllm.llm.shut_down


async def test_a_bridge_that_ends_takes_the_engine_down_too(fake_vllm, tmp_path):
    async def stop() -> None:
        raise EngineError("ended")  # stands for run() returning: ``_bridge_kv_events`` raises either way

    fake_vllm.bridge = stop
    with anyio.fail_after(5), pytest.raises(BaseExceptionGroup) as caught:
        async with engine(tmp_path).serving():
            await anyio.sleep_forever()
    assert caught.value.subgroup(EngineError) is not None


async def test_the_bridge_connects_before_the_engine_boots(fake_vllm, tmp_path):
    async with engine(tmp_path).serving():
        assert fake_vllm.order == ["bridge connected", "engine booted"]  # no event of the engine's is missed
    assert fake_vllm.llm.shut_down


# --- decode ---------------------------------------------------------------------------------------


async def test_decode_streams_positions_from_one_and_finishes(fake_vllm, tmp_path):
    fake_vllm.llm = FakeLLM(lambda rid: [output([11, 12]), output([13], "length")])
    vllm = engine(tmp_path)
    async with vllm.serving():
        vllm.add(decode_task("r1", max_tokens=4))
        outs = []
        with anyio.fail_after(5):
            while not outs or outs[-1].finished is None:
                outs += await vllm.step()
        assert [(o.token, o.position) for o in outs] == [(11, 1), (12, 2), (13, 3)]
        assert outs[-1].finished == "length" and vllm.running == 0


async def test_abort_cancels_the_decode_and_tells_vllm(fake_vllm, tmp_path):
    fake_vllm.llm = FakeLLM(lambda rid: [output([5])] * 1000, step_s=0.01)
    vllm = engine(tmp_path)
    async with vllm.serving():
        vllm.add(decode_task("r1", max_tokens=2000))
        with anyio.fail_after(5):
            assert await vllm.step()
        assert vllm.abort("r1") and vllm.running == 0
        with anyio.fail_after(5):
            while not fake_vllm.llm.aborted:
                await anyio.sleep(0.01)
    assert fake_vllm.llm.aborted == [r for r in fake_vllm.llm.aborted if r.startswith("r1.")]


async def test_a_request_vllm_fails_fails_alone(fake_vllm, tmp_path):
    def script(rid: str):
        if rid.startswith("bad."):
            raise ValueError("a request vLLM refuses")
        return [output([9], "stop")]

    fake_vllm.llm = FakeLLM(script)
    vllm = engine(tmp_path)
    async with vllm.serving():
        vllm.add(decode_task("bad"))
        vllm.add(decode_task("good"))
        outs = []
        with anyio.fail_after(5):
            while len([o for o in outs if o.finished]) < 2:
                outs += await vllm.step()
    finished = {o.request_id: o.finished for o in outs if o.finished}
    assert finished == {"bad": "abort", "good": "stop"}


class _Bus:
    """What the decode role publishes: its stream chunks and its events."""

    def __init__(self) -> None:
        self.chunks: list = []
        self.events: list = []

    async def stream(self, ingress_id, chunks) -> None:
        self.chunks += chunks

    async def event(self, event) -> None:
        self.events.append(event)

    async def kv_changes(self) -> None:
        pass


async def test_a_request_refused_before_vllm_steps_still_reaches_its_client(fake_vllm, tmp_path):
    """vLLM refuses some requests before any await (``SamplingParams``: n > 1 with greedy
    sampling): the decode ends within ``add``'s task before the role's loop looks at the
    engine. Its refusal must still go out, not wait in the engine for a step nobody takes."""

    def script(rid: str):
        raise ValueError("n must be 1 when using greedy sampling, got 2.")

    fake_vllm.llm = FakeLLM(script)
    vllm = engine(tmp_path)
    role, bus = DecodeRole(vllm, "w-1", 100_000, min_publish_interval_s=0.01), _Bus()
    async with vllm.serving(), anyio.create_task_group() as tg:
        tg.start_soon(role.serve, bus)
        await anyio.sleep(0.01)  # the role's loop waits for work
        role.offer(decode_task("greedy"), {})
        with anyio.fail_after(5):
            while not bus.events:
                await anyio.sleep(0.005)
        tg.cancel_scope.cancel()
    assert [(c.finish_reason, c.error and c.error.code) for c in bus.chunks] == [("abort", "invalid_request")]
    assert "greedy sampling" in bus.chunks[0].error.message
    assert [e.request_id for e in bus.events] == ["greedy"] and vllm.running == 0


async def test_a_dead_vllm_engine_takes_the_worker_down(fake_vllm, tmp_path):
    llm = FakeLLM(lambda rid: (_ for _ in ()).throw(RuntimeError("engine core died")))
    llm.errored = True
    fake_vllm.llm = llm
    vllm = engine(tmp_path)
    with anyio.fail_after(5), pytest.raises(BaseExceptionGroup) as caught:
        async with vllm.serving():
            vllm.add(decode_task("r1"))
            await anyio.sleep_forever()
    (error,) = caught.value.subgroup(EngineError).exceptions
    assert "died decoding r1" in str(error)


# --- token 0 that ends the request ------------------------------------------------------------------


@pytest.mark.parametrize(
    ("vllm_reason", "max_tokens", "finish"),
    [("stop", 8, "stop"), ("length", 8, None), ("length", 1, "length"), ("stop", 1, "stop")],
)
async def test_token_0_eos_finishes_the_request_at_prefill(fake_vllm, tmp_path, vllm_reason, max_tokens, finish):
    fake_vllm.llm = FakeLLM(lambda rid: [output([2], vllm_reason)])
    vllm = engine(tmp_path, "prefill")
    task = PrefillTask(spec=make_spec("r1", max_tokens=max_tokens), queued_s=0.0)
    async with vllm.serving():
        (result,) = await vllm.prefill([task])
    chunk, done = first_token("w-1", task, result)
    assert chunk.token_ids == [2] and chunk.finish_reason == finish
    assert done.finished is (finish is not None)  # finished: the scheduler starts no decode


def test_only_a_stop_ends_the_request_at_token_0():
    assert first_token_finish("stop") == "stop"
    assert first_token_finish("length") is None  # our cap of one token, not the request's
    assert first_token_finish(None) is None


async def test_a_failed_prefill_is_an_engine_error(fake_vllm, tmp_path):
    fake_vllm.llm = FakeLLM(lambda rid: [])  # no output at all
    vllm = engine(tmp_path, "prefill")
    async with vllm.serving():
        with pytest.raises(EngineError, match="no token"):
            await vllm.prefill([PrefillTask(spec=make_spec("r1"), queued_s=0.0)])


class RecordingLLM(FakeLLM):
    def __init__(self, script) -> None:
        super().__init__(script)
        self.calls: list[tuple[dict, object]] = []

    async def generate(self, prompt, params, request_id: str):
        self.calls.append((prompt, params))
        async for out in super().generate(prompt, params, request_id):
            yield out


async def test_a_constrained_request_is_decoded_whole_under_its_grammar(fake_vllm, tmp_path):
    """Token 0 is the decode engine's (decode_samples_first): it is given the prompt alone,
    every token to generate and the grammar; its first output is position 0."""
    import msgspec

    from switchyard.schemas import StructuredOutput

    fake_vllm.llm = RecordingLLM(lambda rid: [output([5, 6], None), output([7], "stop")])
    task = decode_task("r1", max_tokens=8)
    structured = StructuredOutput(json_schema='{"type": "object"}')
    spec = msgspec.structs.replace(
        task.spec, sampling=msgspec.structs.replace(task.spec.sampling, structured=structured, min_tokens=2)
    )
    task = msgspec.structs.replace(task, spec=spec, first_token=-1)
    vllm = engine(tmp_path)
    async with vllm.serving():
        vllm.add(task)
        outputs = []
        while vllm.running or not outputs:
            outputs += await vllm.step()
    ((prompt, params),) = fake_vllm.llm.calls
    assert prompt["prompt_token_ids"] == spec.prompt_tokens  # no token 0 appended
    assert params.max_tokens == 8 and params.min_tokens == 2
    assert params.structured_outputs.json == '{"type": "object"}'
    assert [(o.position, o.token) for o in outputs] == [(0, 5), (1, 6), (2, 7)]
    assert outputs[-1].finished == "stop"


def test_a_constrained_prefill_sends_the_usage_but_not_its_token():
    import msgspec

    from switchyard.schemas import StructuredOutput
    from switchyard.workers.engine import PrefillResult

    spec = make_spec("r1", max_tokens=1)
    spec = msgspec.structs.replace(
        spec, sampling=msgspec.structs.replace(spec.sampling, structured=StructuredOutput(json_object=True))
    )
    handle = MooncakeStoreKvHandle(worker_id="p", num_tokens=len(spec.prompt_tokens), block_size=16)
    result = PrefillResult(request_id="r1", first_token=9, cached_tokens=16, handle=handle, prefill_s=0.1)
    chunk, done = first_token("w-1", PrefillTask(spec=spec, queued_s=0.0), result)
    assert chunk.token_ids == [] and chunk.finish_reason is None and chunk.usage.cached_tokens == 16
    assert done.first_token == -1 and not done.finished  # decode samples token 0, even for max_tokens 1


async def test_a_constrained_prefill_compiles_no_grammar(fake_vllm, tmp_path):
    """The prefill's token 0 of a constrained request is dropped: its run carries no grammar, so a
    schema vLLM refuses cannot fail the prefill batch it shares with other requests."""
    import msgspec

    from switchyard.schemas import StructuredOutput

    fake_vllm.llm = RecordingLLM(lambda rid: [output([5], "length")])
    spec = make_spec("r1", max_tokens=8)
    spec = msgspec.structs.replace(
        spec, sampling=msgspec.structs.replace(spec.sampling, structured=StructuredOutput(json_object=True))
    )
    vllm = engine(tmp_path, "prefill")
    async with vllm.serving():
        await vllm.prefill([PrefillTask(spec=spec, queued_s=0.0)])
    ((_, params),) = fake_vllm.llm.calls
    assert params.structured_outputs is None and params.max_tokens == 1
