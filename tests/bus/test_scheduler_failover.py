"""Two scheduler replicas on a real nats-server with sim workers: one active, one standing
by; the active one dies, the standby takes over within 2 s, with the ledger rebuilt from
the workers, and every request in flight (queued, in prefill, waiting for decode, in
decode) finished, each token once."""

from __future__ import annotations

import time

import anyio
import pytest

from switchyard.observability import settle
from switchyard.observability.bus import connect
from switchyard.scheduler.config import SchedulerConfig
from switchyard.scheduler.service import SchedulerService, SchedulerServiceConfig
from switchyard.schemas import Admitted, RequestSpec, SamplingParams, SubmitRequest, codec, subjects
from switchyard.workers import SimCostModel, build_worker
from tests.support.stack import worker_config

pytestmark = pytest.mark.anyio

# A subject past the server's max_control_line: the server closes the client, as if it died
# (it cannot release its lease: the standby waits for the lease's TTL).
_OVERSIZED = "sy.test." + "x" * 5000
_INGRESS = "ing-failover"


def _spec(rid: str, tokens: int = 40, max_tokens: int = 4) -> RequestSpec:
    return RequestSpec(
        request_id=rid,
        ingress_id=_INGRESS,
        model="switchyard-sim",
        prompt_tokens=list(range(300 + len(rid), 300 + len(rid) + tokens)),
        block_size=16,
        block_keys=[],
        sampling=SamplingParams(max_tokens=max_tokens, temperature=0.0),
    )


def _replica(url: str) -> SchedulerService:
    core = SchedulerConfig(worker_expiry_s=5, decode_overcommit=3.0)  # room to queue for decode
    return SchedulerService(SchedulerServiceConfig(nats_url=url, core=core))


async def _wait(predicate, timeout_s: float = 5.0) -> None:
    with anyio.fail_after(timeout_s):
        while not predicate():
            await anyio.sleep(0.01)


async def _submit(nc, spec: RequestSpec):
    reply = await nc.request(subjects.SUBMIT, codec.SCHEDULER_REQUEST.encode(SubmitRequest(spec=spec)), timeout=5)
    return codec.SCHEDULER_REPLY.decode(reply.data)


class _Streams:
    """Every chunk the ingress subject carries, by request."""

    def __init__(self, sub) -> None:
        self.sub = sub
        self.chunks: dict[str, list] = {}

    async def serve(self) -> None:
        async for msg in self.sub.messages:
            for chunk in codec.STREAM_BATCH.decode(msg.data).chunks:
                self.chunks.setdefault(chunk.request_id, []).append(chunk)

    def positions(self, rid: str) -> list[int]:
        return sorted(c.seq + i for c in self.chunks.get(rid, []) for i in range(len(c.token_ids)))

    def finished(self, rid: str) -> bool:
        return any(c.finish_reason is not None for c in self.chunks.get(rid, []))

    def error(self, rid: str) -> str | None:
        return next((c.error.code for c in self.chunks.get(rid, []) if c.error is not None), None)


async def _streams(nc, tg) -> _Streams:
    streams = _Streams(await nc.subscribe(subjects.streams_of(_INGRESS)))
    tg.start_soon(streams.serve)
    await settle(nc)
    return streams


async def test_one_replica_answers_and_a_standby_takes_over_within_2_s_of_its_death(nats):
    first, second = _replica(nats.url), _replica(nats.url)
    async with connect(nats.url, "test") as nc, anyio.create_task_group() as tg:
        streams = await _streams(nc, tg)
        await tg.start(build_worker(worker_config(nats.url, "prefill")).run)
        await tg.start(build_worker(worker_config(nats.url, "decode")).run)
        with pytest.raises(ExceptionGroup):  # first dies of its closed connection
            async with anyio.create_task_group() as doomed:
                await doomed.start(first.run)
                await tg.start(second.run)  # returns standing by
                assert first.active.is_set() and not second.active.is_set()
                await _wait(lambda: len(first.core.workers) == 2)
                for i in range(3):
                    assert isinstance(await _submit(nc, _spec(f"r{i}")), Admitted)
                await _wait(lambda: all(streams.finished(f"r{i}") for i in range(3)))
                assert not second.core.requests and not second.core.workers  # it placed nothing
                assert first._nc is not None
                died = time.monotonic()
                await first._nc.publish(_OVERSIZED, b"")
                await anyio.sleep(30)
        # Submitted while nobody holds the lease: kept by the standby, answered when it takes over.
        assert not second.active.is_set()
        assert isinstance(await _submit(nc, _spec("in-the-gap")), Admitted)
        took_over = time.monotonic() - died
        assert second.active.is_set() and took_over < 2.0
        print(f"standby took over and answered {took_over:.2f} s after the active scheduler died")
        await _wait(lambda: streams.finished("in-the-gap"), timeout_s=3)
        assert streams.positions("in-the-gap") == [0, 1, 2, 3]
        reply = await _submit(nc, _spec("after"))
        assert isinstance(reply, Admitted)
        await _wait(lambda: streams.finished("after"), timeout_s=3)
        assert streams.positions("after") == [0, 1, 2, 3]
        tg.cancel_scope.cancel()


async def test_a_takeover_rebuilds_the_ledger_and_finishes_every_request_in_every_phase_once(nats):
    # Prefills of 2 s: the ledger is compared before "prefilling" ends and "queued" takes its
    # place. A takeover may wait a lease try (0.25 s) and the roll call (up to 0.5 s); with
    # 1 s prefills a loaded CI machine once compared after.
    slow = SimCostModel(prefill_base_s=2.0, decode_step_base_s=0.05)
    first, second = _replica(nats.url), _replica(nats.url)
    async with connect(nats.url, "test") as nc, anyio.create_task_group() as tg:
        streams = await _streams(nc, tg)
        # Room for one prompt of 40 in prefill (a second one waits in the scheduler's queue),
        # and for one decode of 40 + 60 (a second one waits for decode).
        await tg.start(build_worker(worker_config(nats.url, "prefill", cost=slow, token_budget=64)).run)
        await tg.start(build_worker(worker_config(nats.url, "decode", cost=slow, token_budget=120)).run)
        async with anyio.create_task_group() as active:
            await active.start(first.run)
            await tg.start(second.run)
            await _wait(lambda: len(first.core.workers) == 2)
            decoding, waiting = _spec("decoding", max_tokens=60), _spec("waiting")
            prefilling, queued = _spec("prefilling"), _spec("queued")
            assert isinstance(await _submit(nc, decoding), Admitted)
            await _wait(lambda: first.core.requests["decoding"].phase == "decode")
            assert isinstance(await _submit(nc, waiting), Admitted)
            await _wait(lambda: first.core.requests["waiting"].phase == "awaiting_decode")
            assert isinstance(await _submit(nc, prefilling), Admitted)
            assert isinstance(await _submit(nc, queued), Admitted)
            assert first.core.requests["queued"].phase == "queued"
            before = first.core.ledger()
            active.cancel_scope.cancel()
        switched = time.monotonic()
        await _wait(second._settled.is_set, timeout_s=2.0)
        assert second.core.ledger() == before  # the same tokens, before anything moved on
        phases = {r: t.phase for r, t in second.core.requests.items()}
        # Held by workers: adopted. Only in the dead scheduler: learnt from what the standby heard.
        assert phases == {
            "decoding": "decode",
            "prefilling": "prefill",
            "waiting": "awaiting_decode",
            "queued": "queued",
        }
        assert not any(t.adopted for t in second.core.requests.values())  # the standby had their prompts
        second.core.check_invariants()
        # Every one finishes, each token once: nothing was placed twice, nothing lost.
        done = ("decoding", "waiting", "prefilling", "queued")
        await _wait(lambda: all(streams.finished(r) for r in done), timeout_s=8)
        assert streams.positions("decoding") == list(range(60))
        for rid in ("waiting", "prefilling", "queued"):
            assert streams.positions(rid) == [0, 1, 2, 3], rid
        assert not any(streams.error(r) for r in done)
        assert time.monotonic() - switched < 8
        await _wait(lambda: not second.core.requests)
        assert second.core.ledger() == {}
        tg.cancel_scope.cancel()
