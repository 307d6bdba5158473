"""The scheduler and workers on a real nats-server, without HTTP."""

from __future__ import annotations

import gc
import subprocess
import time

import anyio
import msgspec
import pytest
from nats.errors import NoRespondersError

from switchyard import procs
from switchyard.observability import settle
from switchyard.observability.bus import BusStats, connect
from switchyard.scheduler.config import SchedulerConfig
from switchyard.scheduler.service import SchedulerService, SchedulerServiceConfig
from switchyard.schemas import (
    Cancel,
    ClusterStatus,
    DecodeTask,
    LoadReport,
    PromptUsage,
    RequestSpec,
    SamplingParams,
    SimKvHandle,
    StatusRequest,
    SubmitRequest,
    TaskAck,
    codec,
    subjects,
)
from switchyard.workers import build_worker
from switchyard.workers.sim import SimCostModel
from tests.support.stack import worker_config

pytestmark = pytest.mark.anyio


def _spec(rid: str, ingress: str = "ing-test", tokens: int = 40, max_tokens: int = 4) -> RequestSpec:
    prompt = list(range(300, 300 + tokens))
    return RequestSpec(
        request_id=rid,
        ingress_id=ingress,
        model="switchyard-sim",
        prompt_tokens=prompt,
        block_size=16,
        block_keys=[],
        sampling=SamplingParams(max_tokens=max_tokens),
    )


def _keyed(spec: RequestSpec, shift: int = 0) -> RequestSpec:
    """The spec with (shifted) prompt tokens and their real chained block keys."""
    from switchyard.kvbus import block_keys, salt_for

    tokens = [t + shift for t in spec.prompt_tokens]
    return msgspec.structs.replace(spec, prompt_tokens=tokens, block_keys=block_keys(tokens, 16, salt_for("t", "m")))


async def _register_impostor(nc, worker_id: str) -> None:
    """One heartbeat of an idle, roomy prefill worker that is not really there."""
    report = LoadReport(
        worker_id=worker_id,
        role="prefill",
        seq=1,
        engine="sim",
        model="m",
        block_size=16,
        token_budget=1_000_000,
        inflight_tokens=0,
        running=0,
        interval_s=0.1,
    )
    await nc.publish(subjects.WORKER_EVENTS, codec.WORKER_EVENT.encode(report))


async def _wait(predicate, timeout_s: float = 5.0) -> None:
    with anyio.fail_after(timeout_s):
        while not predicate():
            await anyio.sleep(0.02)


def _positions(chunks) -> list[int]:
    """Output positions carried by the chunks, each token once (a chunk may carry several)."""
    return sorted(c.seq + i for c in chunks for i in range(len(c.token_ids)))


async def _collect(sub, rid: str, expect_tokens: int, senders: list[tuple[str, str]] | None = None) -> list:
    """The request's token chunks until ``expect_tokens``; in ``senders``, each chunk's
    sender (from its subject) and what it was: the scheduler's assignments, or tokens."""
    chunks = []
    with anyio.fail_after(5):
        while sum(len(c.token_ids) for c in chunks) < expect_tokens:
            msg = await sub.next_msg(timeout=5)
            for c in codec.STREAM_BATCH.decode(msg.data).chunks:
                if c.request_id != rid:
                    continue
                if senders is not None:
                    sender = subjects.stream_sender(msg.subject)
                    senders.append((sender, f"assigned {c.assigned}" if c.assigned else "tokens"))
                if c.assigned is None:
                    chunks.append(c)
    return chunks


async def test_roll_call_registers_workers_that_started_first(nats):
    # Workers beat only every 30 s: only the scheduler's roll call can register them quickly.
    prefill = build_worker(worker_config(nats.url, "prefill", report_interval_s=30))
    decode = build_worker(worker_config(nats.url, "decode", report_interval_s=30))
    async with anyio.create_task_group() as tg:
        await tg.start(prefill.run)
        await tg.start(decode.run)
        await anyio.sleep(0.2)  # their first beat is gone before the scheduler listens
        sched = SchedulerService(SchedulerServiceConfig(nats_url=nats.url))
        await tg.start(sched.run)
        await _wait(lambda: len(sched.core.workers) == 2, timeout_s=3)
        # Settled: its startup heap is out of the collector's passes (``scheduler.heap``).
        assert gc.get_freeze_count() > 0
        tg.cancel_scope.cancel()


async def test_a_request_flows_through_prefill_and_decode(nats):
    sched = SchedulerService(SchedulerServiceConfig(nats_url=nats.url))
    prefill = build_worker(worker_config(nats.url, "prefill"))
    decode = build_worker(worker_config(nats.url, "decode"))
    async with connect(nats.url, "test") as nc, anyio.create_task_group() as tg:
        await tg.start(sched.run)
        await tg.start(prefill.run)
        await tg.start(decode.run)
        await _wait(lambda: len(sched.core.workers) == 2)
        sub = await nc.subscribe(subjects.streams_of("ing-test"))
        reply = await nc.request(
            subjects.SUBMIT, codec.SCHEDULER_REQUEST.encode(SubmitRequest(spec=_spec("r1"))), timeout=5
        )
        assert type(codec.SCHEDULER_REPLY.decode(reply.data)).__name__ == "Admitted"
        senders: list[tuple[str, str]] = []
        chunks = await _collect(sub, "r1", 4, senders)
        assert _positions(chunks) == [0, 1, 2, 3]
        # Each worker announced by the scheduler before its first tokens, under its own id.
        p, d = prefill.config.worker_id, decode.config.worker_id
        assert senders[:2] == [("scheduler", f"assigned {p}"), (p, "tokens")]
        assert senders[2] == ("scheduler", f"assigned {d}") and set(senders[3:]) == {(d, "tokens")}
        assert chunks[0].usage is not None and chunks[0].usage.prompt_tokens == 40
        assert [c.finish_reason for c in sorted(chunks, key=lambda c: c.seq)][-1] == "length"
        assert sum(c.finish_reason is not None for c in chunks) == 1
        await _wait(lambda: not sched.core.requests)
        tg.cancel_scope.cancel()


async def test_graceful_stop_says_leaving(nats):
    sched = SchedulerService(SchedulerServiceConfig(nats_url=nats.url, core=SchedulerConfig(worker_expiry_s=60)))
    async with anyio.create_task_group() as tg:
        await tg.start(sched.run)
        async with anyio.create_task_group() as workers:
            await workers.start(build_worker(worker_config(nats.url, "decode")).run)
            await _wait(lambda: len(sched.core.workers) == 1)
            workers.cancel_scope.cancel()
        # expiry is 60 s: only WorkerLeaving can remove it this fast
        await _wait(lambda: not sched.core.workers, timeout_s=3)
        tg.cancel_scope.cancel()


async def test_silent_worker_expires_and_its_prefill_is_redone_elsewhere(nats):
    sched = SchedulerService(
        SchedulerServiceConfig(nats_url=nats.url, dispatch_timeout_s=0.3, core=SchedulerConfig(worker_expiry_s=0.5))
    )
    async with connect(nats.url, "test") as nc, anyio.create_task_group() as tg:
        await tg.start(sched.run)
        await tg.start(build_worker(worker_config(nats.url, "decode")).run)
        # A "worker" that registers with an ultra-low load, then never answers a task.
        await _register_impostor(nc, "ghost")
        await _wait(lambda: "ghost" in sched.core.workers and len(sched.core.workers) == 2)
        sub = await nc.subscribe(subjects.streams_of("ing-test"))
        await nc.request(subjects.SUBMIT, codec.SCHEDULER_REQUEST.encode(SubmitRequest(spec=_spec("r2"))), timeout=5)
        await _wait(lambda: "ghost" not in sched.core.workers, timeout_s=3)  # no responder: removed
        started = time.monotonic()
        real = build_worker(worker_config(nats.url, "prefill"))
        await tg.start(real.run)
        chunks = await _collect(sub, "r2", 4)
        assert _positions(chunks) == [0, 1, 2, 3]
        assert time.monotonic() - started < 3
        tg.cancel_scope.cancel()


async def test_slow_consumer_drops_are_counted(nats):
    stats = BusStats()
    async with connect(nats.url, "slow", stats) as slow, connect(nats.url, "fast") as fast:
        sub = await slow.subscribe("flood", pending_msgs_limit=10)
        await settle(slow)
        # Nobody reads the subscription: past its 10 pending messages, each one is dropped.
        # Flooded in rounds until a drop is counted (a loaded machine may deliver late),
        # for at most 10 s: without the count, this fails.
        with anyio.move_on_after(10):
            while stats.dropped == 0:
                for _ in range(500):
                    await fast.publish("flood", b"x" * 100)
                await settle(fast)
                await anyio.sleep(0.1)
        pending = sub.pending_msgs
        await sub.unsubscribe()
    assert stats.dropped > 0, f"no drop counted; {pending} messages pending"
    assert pending == 10  # what was not dropped is still there to read


async def test_a_worker_that_never_acks_times_out_and_its_request_is_handed_back_to_the_ingress(nats):
    sched = SchedulerService(
        SchedulerServiceConfig(nats_url=nats.url, dispatch_timeout_s=0.3, core=SchedulerConfig(worker_expiry_s=60))
    )
    async with connect(nats.url, "test") as nc, anyio.create_task_group() as tg:
        await tg.start(sched.run)
        await tg.start(build_worker(worker_config(nats.url, "decode")).run)
        # Registered and listening, but it never answers a task: only the ack timeout can tell.
        mute = await nc.subscribe(subjects.worker_tasks("mute"))
        await _register_impostor(nc, "mute")
        await _wait(lambda: "mute" in sched.core.workers)
        sub = await nc.subscribe(subjects.streams_of("ing-test"))
        spec = _spec("r3")
        await nc.request(subjects.SUBMIT, codec.SCHEDULER_REQUEST.encode(SubmitRequest(spec=spec)), timeout=5)
        # The worker may have run it: only the ingress knows if token 0 came, so it hears.
        with anyio.fail_after(5):
            while True:
                batch = codec.STREAM_BATCH.decode((await sub.next_msg(timeout=5)).data)
                errors = [c.error for c in batch.chunks if c.request_id == "r3" and c.error is not None]
                if errors:
                    break
        assert errors[0].code == "worker_lost"
        await tg.start(build_worker(worker_config(nats.url, "prefill")).run)
        # Until the scheduler has heard the new worker's first heartbeat it has no prefill
        # worker (mute is gone) and would refuse the resubmission (seen under CI load).
        await _wait(lambda: any(w.role == "prefill" and wid != "mute" for wid, w in sched.core.workers.items()))
        again = msgspec.structs.replace(spec, attempt=1)  # as an ingress submits it again
        await nc.request(subjects.SUBMIT, codec.SCHEDULER_REQUEST.encode(SubmitRequest(spec=again)), timeout=5)
        chunks = await _collect(sub, "r3", 4)
        assert _positions(chunks) == [0, 1, 2, 3]
        assert "mute" not in sched.core.workers
        assert (await mute.next_msg(timeout=1)).data  # the task did reach it: a timeout, not no-responders
        tg.cancel_scope.cancel()


async def test_a_short_prompt_is_prefilled_and_decoded_by_its_decode_worker(nats):
    sched = SchedulerService(
        SchedulerServiceConfig(
            nats_url=nats.url, dispatch_timeout_s=0.5, core=SchedulerConfig(local_prefill_max_tokens=64)
        )
    )
    async with connect(nats.url, "test") as nc, anyio.create_task_group() as tg:
        await tg.start(sched.run)
        await tg.start(build_worker(worker_config(nats.url, "decode")).run)
        await _register_impostor(nc, "unused-prefill")  # it would never answer: a handoff would time out
        await _wait(lambda: len(sched.core.workers) == 2)
        sub = await nc.subscribe(subjects.streams_of("ing-test"))
        await nc.request(
            subjects.SUBMIT, codec.SCHEDULER_REQUEST.encode(SubmitRequest(spec=_spec("r4", tokens=40))), timeout=5
        )
        chunks = await _collect(sub, "r4", 4)
        assert _positions(chunks) == [0, 1, 2, 3]
        assert chunks[0].usage is not None and chunks[0].usage.prompt_tokens == 40
        await _wait(lambda: not sched.core.requests)
        assert "unused-prefill" in sched.core.workers  # never dispatched to
        tg.cancel_scope.cancel()


async def test_session_bindings_survive_a_scheduler_restart(nats):
    def service():
        return SchedulerService(SchedulerServiceConfig(nats_url=nats.url, core=SchedulerConfig(policy="round_robin")))

    async with connect(nats.url, "test") as nc, anyio.create_task_group() as tg:
        for _ in range(3):
            await tg.start(build_worker(worker_config(nats.url, "prefill")).run)
        await tg.start(build_worker(worker_config(nats.url, "decode")).run)
        first = service()
        async with anyio.create_task_group() as sched_group:
            await sched_group.start(first.run)
            await _wait(lambda: len(first.core.workers) == 4)
            spec = msgspec.structs.replace(_spec("s1"), tenant="acme", session="agent-7")
            await nc.request(subjects.SUBMIT, codec.SCHEDULER_REQUEST.encode(SubmitRequest(spec=spec)), timeout=5)
            home = first.core.sessions.lookup("acme", "agent-7", first._clock())
            assert home is not None
            await anyio.sleep(0.3)  # the writer puts the binding in the bucket
            sched_group.cancel_scope.cancel()
        second = service()
        await tg.start(second.run)
        assert second.core.sessions.lookup("acme", "agent-7", second._clock()) == home
        assert second.core.sessions.lookup("other", "agent-7", second._clock()) is None
        tg.cancel_scope.cancel()


async def test_without_jetstream_the_scheduler_runs_without_persistence():
    from switchyard.procs import nats_server

    with nats_server(jetstream=False) as plain:
        sched = SchedulerService(SchedulerServiceConfig(nats_url=plain.url))
        async with anyio.create_task_group() as tg:
            await tg.start(build_worker(worker_config(plain.url, "prefill")).run)
            await tg.start(sched.run)
            await _wait(lambda: len(sched.core.workers) == 1)
            assert not sched._sessions.enabled
            tg.cancel_scope.cancel()


async def test_the_index_learns_what_moved_down_to_the_host_tier(nats):
    from switchyard.workers.sim import SimEngineConfig

    tiered = SimEngineConfig(token_low=256, token_high=4093, cache_blocks=3, host_cache_blocks=64)
    sched = SchedulerService(SchedulerServiceConfig(nats_url=nats.url))
    prefill = build_worker(worker_config(nats.url, "prefill", sim=tiered))
    async with connect(nats.url, "test") as nc, anyio.create_task_group() as tg:
        await tg.start(sched.run)
        await tg.start(prefill.run)
        await tg.start(build_worker(worker_config(nats.url, "decode")).run)
        await _wait(lambda: sched.core.index.knows(prefill.config.worker_id))
        first, second = _keyed(_spec("a", tokens=48)), _keyed(_spec("b", tokens=48), shift=1000)
        for spec in (first, second):  # 3 device blocks: the second pushes the first down to the host
            await nc.request(subjects.SUBMIT, codec.SCHEDULER_REQUEST.encode(SubmitRequest(spec=spec)), timeout=5)
            await _wait(lambda: not sched.core.requests)
        wid = prefill.config.worker_id
        await _wait(
            lambda: (
                (m := sched.core.index.match(first.block_keys).get(wid)) is not None
                and (m.device_blocks, m.blocks) == (0, 3)
            )
        )
        tg.cancel_scope.cancel()


async def test_a_later_attempt_ends_the_run_whose_cancel_the_worker_missed(nats):
    """Core NATS delivers at most once: a worker still reconnecting after nats-server
    restarted misses the ingress's cancel of a cut stream, and still decodes that run when
    the request's next attempt comes. The next attempt ends it and decodes; a task for the
    attempt it runs is still refused (a task delivered twice is one stream)."""
    decode = build_worker(worker_config(nats.url, "decode", SimCostModel(decode_step_base_s=0.01)))
    spec = _spec("r", max_tokens=2000)  # 20 s of decoding: alive throughout
    handle = SimKvHandle(worker_id="p", block_keys=[], num_tokens=len(spec.prompt_tokens))
    usage = PromptUsage(prompt_tokens=len(spec.prompt_tokens), cached_tokens=0)

    async def offer(nc, attempt: int) -> TaskAck:
        task = DecodeTask(
            spec=msgspec.structs.replace(spec, attempt=attempt), handle=handle, first_token=7, usage=usage
        )
        deadline = time.monotonic() + 5.0
        while True:  # the worker's subscription reaches the server on its own connection's flush
            try:
                reply = await nc.request(
                    subjects.worker_tasks(decode.config.worker_id), codec.WORKER_TASK.encode(task), 5
                )
                return codec.TASK_ACK.decode(reply.data)
            except NoRespondersError:
                if time.monotonic() > deadline:
                    raise
                await anyio.sleep(0.05)

    async with connect(nats.url, "test") as nc, anyio.create_task_group() as tg:
        await tg.start(decode.run)
        sub = await nc.subscribe(subjects.streams_of("ing-test"))
        assert (await offer(nc, 0)).accepted
        first = await _collect(sub, "r", 5)  # the first run decodes
        assert first[0].seq == 1
        assert (await offer(nc, 0)).reason == "already decoding"
        assert (await offer(nc, 1)).accepted  # no cancel came: the later attempt ends the earlier run
        assert decode.role.running() == 1 and decode.held.attempt("r") == 1
        assert (await offer(nc, 1)).reason == "already decoding"
        tg.cancel_scope.cancel()


async def test_after_the_bus_came_back_runs_that_ended_here_are_cancelled_not_adopted(tmp_path):
    """A run the scheduler placed and no longer tracks, still held by its worker after
    nats-server restarted, is one whose cancel the worker missed: the scheduler's audit ends
    it (its KV would otherwise stay held for nobody) instead of adopting it. A run the
    scheduler never placed on that worker is neither cancelled nor adopted: a worker cannot
    have the scheduler cancel what it names."""
    port = procs.free_port()
    url = f"nats://127.0.0.1:{port}"
    command = procs.nats_server_command("127.0.0.1", port, str(tmp_path))
    server = procs.spawn(command, stdout=subprocess.DEVNULL)
    procs.wait_for_port("127.0.0.1", port, 10.0, server)
    sched = SchedulerService(SchedulerServiceConfig(nats_url=url, core=SchedulerConfig(worker_expiry_s=30)))
    prefill = build_worker(worker_config(url, "prefill"))
    decode = build_worker(worker_config(url, "decode", SimCostModel(decode_step_base_s=0.01)))
    placed = _spec("placed", max_tokens=3000)  # 30 s of decoding unless cancelled
    unknown = _spec("unknown", max_tokens=3000)
    task = DecodeTask(
        spec=unknown,
        handle=SimKvHandle(worker_id="p", block_keys=[], num_tokens=len(unknown.prompt_tokens)),
        first_token=7,
        usage=PromptUsage(prompt_tokens=len(unknown.prompt_tokens), cached_tokens=0),
    )
    try:
        async with connect(url, "test") as nc, anyio.create_task_group() as tg:
            await tg.start(sched.run)
            await tg.start(prefill.run)
            await tg.start(decode.run)
            await _wait(lambda: len(sched.core.workers) == 2)
            submit = SubmitRequest(spec=placed)
            reply = await nc.request(subjects.SUBMIT, codec.SCHEDULER_REQUEST.encode(submit), timeout=5)
            assert type(codec.SCHEDULER_REPLY.decode(reply.data)).__name__ == "Admitted"
            await _wait(lambda: decode.held.attempt("placed") == 0)
            reply = await nc.request(subjects.worker_tasks(decode.config.worker_id), codec.WORKER_TASK.encode(task), 5)
            assert codec.TASK_ACK.decode(reply.data).accepted  # the scheduler never placed it
            await _wait(lambda: decode.role.running() == 2)
            # The client's cancel as only the scheduler heard it (its own path for a cancel).
            await sched._act(sched.core.on_cancel("placed", sched._clock()))
            assert "placed" not in sched.core.requests and decode.role.running() == 2
            server.kill()
            server.wait()
            server = procs.spawn(command, stdout=subprocess.DEVNULL)
            procs.wait_for_port("127.0.0.1", port, 10.0, server)
            await _wait(lambda: sched.strays_cancelled == 1 and sched.strays_ignored >= 1, timeout_s=15)
            await _wait(lambda: decode.held.attempt("placed") is None)
            assert decode.held.attempt("unknown") == 0  # not cancelled on the worker's word
            assert "placed" not in sched.core.requests and "unknown" not in sched.core.requests  # not adopted
            assert sched.core.ledger() == {}
            asked = codec.SCHEDULER_REQUEST.encode(StatusRequest())
            status = codec.SCHEDULER_REPLY.decode((await nc.request(subjects.SUBMIT, asked, timeout=5)).data)
            assert isinstance(status, ClusterStatus)
            assert status.strays_cancelled == 1 and status.strays_ignored == sched.strays_ignored >= 1
            tg.cancel_scope.cancel()
    finally:
        server.kill()
        server.wait()


async def test_a_refused_decode_waits_and_goes_through_once_the_worker_has_room(nats):
    """A decode worker whose KV is fuller than the scheduler's ledger knows (a run it never
    heard of) refuses the task. Retried at once, the task went straight back to it, and three
    refusals within milliseconds failed the request; then (with pauses of 0.1 s doubling) the
    third refusal still did, 0.3 s in. Now a refusal spends no dispatch: it is refused four
    times (0.7 s of pauses), and once the worker's KV is free the request completes."""
    sched = SchedulerService(SchedulerServiceConfig(nats_url=nats.url, core=SchedulerConfig(max_dispatch_attempts=3)))
    prefill = build_worker(worker_config(nats.url, "prefill"))
    decode = build_worker(worker_config(nats.url, "decode", SimCostModel(decode_step_base_s=0.01), token_budget=1000))
    hog = _spec("hog", max_tokens=900)  # 940 of the worker's 1,000 KV tokens, for 9 s
    task = DecodeTask(
        spec=hog,
        handle=SimKvHandle(worker_id="p", block_keys=[], num_tokens=len(hog.prompt_tokens)),
        first_token=7,
        usage=PromptUsage(prompt_tokens=len(hog.prompt_tokens), cached_tokens=0),
    )
    async with connect(nats.url, "test") as nc, anyio.create_task_group() as tg:
        await tg.start(sched.run)
        await tg.start(prefill.run)
        await tg.start(decode.run)
        await _wait(lambda: len(sched.core.workers) == 2)
        reply = await nc.request(subjects.worker_tasks(decode.config.worker_id), codec.WORKER_TASK.encode(task), 5)
        assert codec.TASK_ACK.decode(reply.data).accepted
        sub = await nc.subscribe(subjects.streams_of("ing-test"))
        submit = codec.SCHEDULER_REQUEST.encode(SubmitRequest(spec=_spec("r", max_tokens=100)))
        reply = await nc.request(subjects.SUBMIT, submit, timeout=5)
        assert type(codec.SCHEDULER_REPLY.decode(reply.data)).__name__ == "Admitted"
        tracked = sched.core.requests["r"]
        await _wait(lambda: tracked.phase == "paused")  # refused: "no KV capacity"
        assert decode.held.attempt("r") is None
        await _wait(lambda: len(tracked.refused_by) == 4 and tracked.phase == "paused")
        await nc.publish(subjects.CANCEL, codec.CANCEL.encode(Cancel(request_id="hog", reason="client_gone")))
        chunks = await _collect(sub, "r", 100)
        assert _positions(chunks) == list(range(100))
        assert all(c.error is None for c in chunks) and len(tracked.refused_by) in (4, 5)
        tg.cancel_scope.cancel()
