"""A colocated fleet (workers of role ``both``) over the real bus, through the real HTTP API.

Each worker prefills and decodes its own requests; with a TPOT SLO the scheduler lends one
to decoding when decodes run slow, and the others then prefill for it and hand their KV
over (``PrefillTask`` on a colocated worker). Every request must still complete whole.
"""

from __future__ import annotations

import concurrent.futures
import signal
import subprocess
import time

import openai
import pytest

from switchyard import procs
from switchyard.scheduler.config import SchedulerConfig
from switchyard.schemas import PrefillTask
from switchyard.workers.decode import DecodeRole
from switchyard.workers.sim import SimCostModel, SimEngine, SimEngineConfig
from tests.support.factories import make_spec
from tests.support.stack import MODEL, running_stack, wait_until, worker_config

# Decode steps of 20 ms against a 10 ms TPOT SLO: decodes run slow from the first one.
SLOW_DECODE = SimCostModel(prefill_per_token_s=0.0001, decode_step_base_s=0.02)
TOKENS = 12


def test_only_a_colocated_worker_prefills_for_handoff() -> None:
    """A decode worker (kv_consumer under vLLM) cannot hand KV off; a colocated one can."""
    engine = SimEngine(SimEngineConfig(), "w")
    task = PrefillTask(spec=make_spec("r1", prompt_len=40), queued_s=0.0)
    assert DecodeRole(engine, "w", 4096).offer(task, {}) == "a decode worker takes no PrefillTask"
    colocated = DecodeRole(engine, "w", 4096, prefills=True)
    assert colocated.offer(task, {}) is None
    assert colocated.inflight_tokens() == 40  # the queued prompt counts until it is handed off
    assert colocated.offer(task, {}) == "already decoding"  # delivered twice: computed once
    colocated.cancel("r1")
    assert colocated.inflight_tokens() == 0


def test_a_colocated_worker_refuses_prompts_past_twice_its_budget_as_a_prefill_worker_does() -> None:
    """The scheduler keeps a worker's prompts within its budget: twice the budget queued means
    its ledger is off (counted in the tokens it charged), and the worker says no."""
    colocated = DecodeRole(SimEngine(SimEngineConfig(), "w"), "w", 100, prefills=True)
    big = PrefillTask(spec=make_spec("big", prompt_len=150), queued_s=0.0, charged_tokens=150)
    assert colocated.offer(big, {}) is None  # alone, a prompt past the budget runs
    more = PrefillTask(spec=make_spec("more", prompt_len=80), queued_s=0.0, charged_tokens=60)
    assert colocated.offer(more, {}) == "over token budget"  # 210 > 200
    cached = PrefillTask(spec=make_spec("cached", prompt_len=80), queued_s=0.0, charged_tokens=50)
    assert colocated.offer(cached, {}) is None  # 200: its cached tokens are not charged
    colocated.cancel("big")
    assert colocated.offer(more, {}) is None


def test_colocated_fleet_lends_a_worker_and_loses_nothing(nats) -> None:
    sched = SchedulerConfig(worker_expiry_s=1.0, ttft_slo_s=5.0, tpot_slo_s=0.01)
    with running_stack(nats.url, prefill=0, decode=0, scheduler=sched) as stack:
        workers = [stack.add_worker(worker_config(nats.url, "both", SLOW_DECODE)) for _ in range(3)]
        health = stack.wait_healthy(3, 3)
        assert health["colocated_workers"] == 3
        client = openai.OpenAI(base_url=stack.base_url, api_key="unused", max_retries=0, timeout=30)

        def ask(i: int) -> tuple[str, int, str]:
            stream = client.completions.create(
                model=MODEL, prompt=f"wagon {i} " * 30, max_tokens=TOKENS, stream=True, temperature=0
            )
            text, finish = "", None
            for chunk in stream:
                text += chunk.choices[0].text
                finish = chunk.choices[0].finish_reason or finish
            done = client.completions.create(model=MODEL, prompt=f"wagon {i} " * 30, max_tokens=TOKENS, temperature=0)
            assert done.usage is not None
            return text, done.usage.completion_tokens, str(finish) + "/" + str(done.choices[0].finish_reason)

        with concurrent.futures.ThreadPoolExecutor(4) as pool:
            results = list(pool.map(ask, range(24)))
        core = stack.scheduler.core
        assert core._lending.lent_total >= 1, "slow decodes lent no worker"
        assert sum(w.role.handed_off for w in workers) > 0, "no colocated worker prefilled for a lent one"
        for text, completion, finishes in results:
            assert finishes == "length/length"
            assert completion == TOKENS
            assert text  # the streamed copy came whole too (the sim's text is its tokens')
        assert wait_until(lambda: all(w.role.running() == 0 and w.role.inflight_tokens() == 0 for w in workers))
        assert wait_until(lambda: all(w.inflight_tokens == 0 for w in core.status().workers))


def test_a_disaggregated_fleet_lends_a_colocated_prefill_worker_beside_the_decode_worker(nats) -> None:
    """Prefill workers of role ``both`` beside a decode worker (``docs/architecture.md``,
    "Colocated workers lent to decoding"): they prefill and hand every decode over, to the
    decode worker; once its decodes run slow one of them is lent and takes handovers too.
    Every request completes whole."""
    sched = SchedulerConfig(worker_expiry_s=1.0, ttft_slo_s=5.0, tpot_slo_s=0.01)
    with running_stack(nats.url, prefill=0, decode=0, scheduler=sched) as stack:
        prefillers = [stack.add_worker(worker_config(nats.url, "both", SLOW_DECODE)) for _ in range(2)]
        decoder = stack.add_worker(worker_config(nats.url, "decode", SLOW_DECODE))
        stack.wait_healthy(2, 3)
        received: dict[str, list[str]] = {}
        for worker in (*prefillers, decoder):
            offer, name = worker.role.offer, worker.config.worker_id

            def recording(task, headers, offer=offer, name=name):  # type: ignore[no-untyped-def]
                received.setdefault(name, []).append(type(task).__name__)
                return offer(task, headers)

            worker.role.offer = recording  # type: ignore[method-assign]
        client = openai.OpenAI(base_url=stack.base_url, api_key="unused", max_retries=0, timeout=30)

        def ask(i: int) -> tuple[str, str | None]:
            done = client.completions.create(
                model=MODEL, prompt=f"coupling {i} " * 30, max_tokens=TOKENS, temperature=0
            )
            assert done.usage is not None and done.usage.completion_tokens == TOKENS
            return done.choices[0].text, done.choices[0].finish_reason

        with concurrent.futures.ThreadPoolExecutor(4) as pool:
            results = list(pool.map(ask, range(24)))
        assert all(text and finish == "length" for text, finish in results)
        core = stack.scheduler.core
        assert core._lending.lent_total >= 1, "slow decodes lent no prefill worker"
        decoder_id = decoder.config.worker_id
        assert set(received[decoder_id]) == {"DecodeTask"}  # it decodes what they prefilled
        by_prefiller = [received.get(w.config.worker_id, []) for w in prefillers]
        assert any("DecodeTask" in tasks for tasks in by_prefiller), "no lent prefill worker took a handover"
        assert sum(w.role.handed_off for w in prefillers) > 0
        assert wait_until(lambda: all(w.role.running() == 0 and w.role.inflight_tokens() == 0 for w in prefillers))
        assert wait_until(lambda: all(w.inflight_tokens == 0 for w in core.status().workers))


def _colocated_process(nats_url: str, worker_id: str) -> subprocess.Popen:
    """A colocated worker in its own process, decoding as slowly as ``SLOW_DECODE``, so that
    the test can SIGKILL it."""
    flags = ["--role", "both", "--nats", nats_url, "--worker-id", worker_id, "--report-interval-s", "0.1"]
    flags += ["--log-level", "warning", "--sim-prefill-per-token-s", "0.0001", "--sim-decode-step-base-s", "0.02"]
    return procs.spawn(procs.service_command("worker", *flags), env=procs.child_env())


@pytest.mark.parametrize("decode_workers", [0, 1], ids=["colocated", "beside-a-decode-worker"])
def test_a_colocated_worker_killed_while_the_fleet_hands_off_loses_no_stream(nats, decode_workers: int) -> None:
    """A colocated worker SIGKILLed while it holds requests, on a fleet that lends workers to
    decoding and hands prompts over (alone, or beside a decode worker: then it prefills as a
    prefill worker does until lent): what it held (prefills, handoffs on their way to it or
    from it, decodes) continues on the other workers, and every client gets the text an
    undisturbed run gives."""
    sched = SchedulerConfig(worker_expiry_s=0.5, ttft_slo_s=5.0, tpot_slo_s=0.01)
    with running_stack(nats.url, prefill=0, decode=0, scheduler=sched) as stack:
        for _ in range(2):
            stack.add_worker(worker_config(nats.url, "both", SLOW_DECODE))
        for _ in range(decode_workers):
            stack.add_worker(worker_config(nats.url, "decode", SLOW_DECODE))
        child = _colocated_process(nats.url, "both-victim")
        try:
            assert stack.wait_healthy(3, 3 + decode_workers, timeout_s=20)["colocated_workers"] == 3
            client = openai.OpenAI(base_url=stack.base_url, api_key="unused", max_retries=0, timeout=60)
            core = stack.scheduler.core

            def ask(i: int) -> tuple[int, str, str | None, int]:
                stream = client.completions.create(
                    model=MODEL, prompt=f"tender {i} " * 30, max_tokens=40, stream=True, temperature=0,
                    stream_options={"include_usage": True},
                )  # fmt: skip
                text, finish, tokens = "", None, 0
                for chunk in stream:
                    if chunk.usage is not None:
                        tokens = chunk.usage.completion_tokens
                    for choice in chunk.choices:
                        text += choice.text
                        finish = choice.finish_reason or finish
                return i, text, finish, tokens

            with concurrent.futures.ThreadPoolExecutor(12) as pool:
                futures = [pool.submit(ask, i) for i in range(24)]
                victim = None
                deadline = time.monotonic() + 20
                while victim is None and time.monotonic() < deadline:
                    worker = core.workers.get("both-victim")
                    held = [] if worker is None else [core.requests.get(r) for r in {*worker.assigned, *worker.held}]
                    # A handoff: a prompt it prefills for a lent worker, or a decode handed to it, lent.
                    if any(t is not None and not t.local for t in held):
                        victim = held
                    else:
                        time.sleep(0.005)
                assert victim, "the worker to kill never took part in a handoff"
                child.send_signal(signal.SIGKILL)
                results = [f.result() for f in futures]
        finally:
            procs.stop([child])
        assert child.returncode == -signal.SIGKILL
        assert "both-victim" not in core.workers
        for i, text, finish, tokens in results:
            undisturbed = client.completions.create(
                model=MODEL, prompt=f"tender {i} " * 30, max_tokens=40, temperature=0
            )
            assert (text, finish, tokens) == (undisturbed.choices[0].text, "length", 40), i
