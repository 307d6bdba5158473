"""``switchyard up`` under bus faults, through the real HTTP API: a client-supplied session
header of any length takes nothing down, a killed nats-server is restarted on its port
with its JetStream store, the services reconnecting to it without a restart of their own,
and a scheduler process paused past the workers' expiry takes none of them for dead."""

from __future__ import annotations

import concurrent.futures
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import anyio
import httpx
import msgspec
import nats
import openai
import psutil
import pytest

from switchyard import procs
from switchyard.observability.bus import Credentials
from switchyard.scheduler.session_store import BUCKET, session_key
from tests.e2e.test_up import READY_S, up_command
from tests.support.up_nats import admin_credentials

SESSION = "x-session-affinity"
READY = "Switchyard is ready"


@dataclass
class Up:
    port: int
    process: psutil.Popen
    log: Path

    def child(self, word: str) -> psutil.Process:
        return next(p for p in self.process.children(recursive=True) if word in " ".join(p.cmdline()))

    def complete(self, headers: dict[str, str] | None = None) -> int:
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{self.port}/v1", api_key="unused", max_retries=0, timeout=5)
        reply = client.chat.completions.create(
            model="switchyard-sim",
            max_tokens=3,
            messages=[{"role": "user", "content": "still there?"}],
            extra_headers=headers,
        )
        assert reply.usage is not None
        return reply.usage.completion_tokens


@pytest.fixture(scope="module")
def up(tmp_path_factory) -> Iterator[Up]:
    port = procs.free_port()
    log = tmp_path_factory.mktemp("up") / "up.log"
    command = up_command(port, "--sim-decode-step-base-s", "0.01")  # streams of 300 tokens: 3 s, long enough to cut
    with log.open("w") as out:
        process = psutil.Popen(command, env=procs.child_env(), stdout=out, stderr=out, start_new_session=True)
    stack = Up(port, process, log)
    try:
        # Ready when up says so: until then it treats a dead child as a failed start, not a crash.
        deadline = time.monotonic() + READY_S
        while not (_healthy(port) and READY in log.read_text()):
            assert process.poll() is None and time.monotonic() < deadline, log.read_text()
            time.sleep(0.2)
        yield stack
    finally:
        process.terminate()
        process.wait(30)


def _healthy(port: int) -> bool:
    try:
        return httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200
    except httpx.HTTPError:
        return False


def test_long_session_headers_are_refused_and_take_nothing_down(up: Up):
    scheduler = up.child("switchyard scheduler").pid
    with pytest.raises(openai.BadRequestError) as refused:
        up.complete({SESSION: "s" * 2_100})
    assert SESSION in refused.value.message and "256" in refused.value.message
    with pytest.raises(openai.APIStatusError) as huge:  # refused by us, or by the HTTP server first
        up.complete({SESSION: "s" * 100_000})
    assert 400 <= huge.value.status_code < 500
    assert up.complete({SESSION: "s" * 256}) == 3  # the longest allowed
    assert up.complete() == 3
    assert up.child("switchyard scheduler").pid == scheduler
    assert "scheduler exited" not in up.log.read_text()


def test_a_killed_nats_server_comes_back_and_the_stack_serves_again(up: Up):
    session = {SESSION: "agent-7"}
    assert up.complete(session) == 3
    scheduler = up.child("switchyard scheduler").pid
    victim = up.child("nats-server")
    nats_port = victim.cmdline()[victim.cmdline().index("-p") + 1]
    victim.kill()
    killed, served = time.monotonic(), False
    while not served and time.monotonic() - killed < 15:
        try:
            served = up.complete(session) == 3
        except openai.APIError:
            time.sleep(0.2)
    assert served, up.log.read_text()
    revived = up.child("nats-server")
    assert revived.pid != victim.pid and revived.cmdline()[revived.cmdline().index("-p") + 1] == nats_port
    assert up.child("switchyard scheduler").pid == scheduler  # reconnected, not restarted
    admin = admin_credentials(revived.cmdline())
    assert _bound_worker(f"nats://127.0.0.1:{nats_port}", admin, "default", "agent-7").startswith("prefill-")
    assert up.complete(session) == 3


STREAMS = 6


def _stream(port: int, index: int, started: threading.Barrier | None) -> tuple[str, str | None, float]:
    """A greedy stream of 300 tokens: its text, its error (None: it completed), its seconds."""
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0, timeout=60)
    begun, parts = time.monotonic(), []
    try:
        stream = client.completions.create(
            model="switchyard-sim", prompt=f"wagon {index} " * 20, max_tokens=300, temperature=0, stream=True
        )
        for chunk in stream:
            parts += [choice.text for choice in chunk.choices]
            if started is not None and len(parts) == 5:
                started.wait(10)
        return "".join(parts), None, time.monotonic() - begun
    except openai.APIError as exc:
        return "".join(parts), str(exc), time.monotonic() - begun


@pytest.fixture(scope="module")
def reference(up: Up) -> list[str]:
    """Each stream's text on the undisturbed stack (greedy: the same on every run)."""
    with concurrent.futures.ThreadPoolExecutor(STREAMS) as pool:
        runs = [pool.submit(_stream, up.port, i, None) for i in range(STREAMS)]
        texts = [run.result(timeout=60) for run in runs]
    assert all(error is None for _, error, _ in texts), texts
    return [text for text, _, _ in texts]


def test_streams_cut_by_a_nats_restart_continue_where_they_were(up: Up, reference: list[str]):
    """Tokens in flight when nats-server dies are lost (core NATS delivers at most once):
    each stream notices the stall once the bus is back and continues after the tokens it
    has, instead of waiting out the 60 s idle timeout."""
    started = threading.Barrier(STREAMS + 1)
    with concurrent.futures.ThreadPoolExecutor(STREAMS) as pool:
        runs = [pool.submit(_stream, up.port, i, started) for i in range(STREAMS)]
        started.wait(30)  # every stream is under way
        up.child("nats-server").kill()
        results = [run.result(timeout=60) for run in runs]
    for (text, error, seconds), expected in zip(results, reference, strict=True):
        assert error is None, f"{error} after {seconds:.1f} s"
        assert text == expected
        assert seconds < 30  # continued, not timed out


def test_a_stalled_scheduler_removes_no_worker_and_cuts_no_stream(up: Up, reference: list[str]):
    """The scheduler process paused (SIGSTOP) for longer than a worker's expiry while
    streams run, then resumed: the heartbeats of that time are still unread in its inbox, so
    it removes no worker. Every stream completes with its undisturbed text, the scheduler
    says it stalled, and it serves on."""
    scheduler = up.child("switchyard scheduler")
    started = threading.Barrier(STREAMS + 1)
    with concurrent.futures.ThreadPoolExecutor(STREAMS) as pool:
        runs = [pool.submit(_stream, up.port, i, started) for i in range(STREAMS)]
        started.wait(30)
        before = len(up.log.read_text())  # the module's earlier tests log into the same file
        scheduler.suspend()
        time.sleep(2.5)  # the workers' expiry is 2 s
        scheduler.resume()
        results = [run.result(timeout=60) for run in runs]
    for (text, error, seconds), expected in zip(results, reference, strict=True):
        assert error is None, f"{error} after {seconds:.1f} s"
        assert text == expected
    log = up.log.read_text()[before:]
    assert "loop stalled" in log and "worker_lost" not in log and "worker lost" not in log, log[-3000:]
    assert up.complete() == 3 and up.child("switchyard scheduler").pid == scheduler.pid


def _bound_worker(url: str, admin: Credentials, tenant: str, session: str) -> str:
    """The worker the session bucket binds a session to: the bucket survived the restart."""

    async def read() -> str:
        async with await nats.connect(url, user=admin.user, password=admin.password) as nc:
            kv = await nc.jetstream().key_value(BUCKET)
            entry = await kv.get(session_key(tenant, session))
            assert entry.value is not None
            return str(msgspec.msgpack.decode(entry.value)["worker_id"])

    return anyio.run(read)
