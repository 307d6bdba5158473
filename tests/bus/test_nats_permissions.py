"""NATS permissions, on a real nats-server started with the users ``switchyard.nats_auth``
writes: each role does its own work, and nothing else. A worker cannot publish a task or
read another worker's, nor forge a Cancel; an ingress cannot read a task or inject tokens
into a stream; a process without credentials is not let in at all.

A refused publish or subscription is checked twice: the server says so (counted in
``BusStats.denied``), and a listener with every right (admin) hears nothing of it."""

from __future__ import annotations

import shutil
import ssl
import subprocess
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from pathlib import Path

import anyio
import nats as nats_py
import pytest
from nats.aio.client import Client

from switchyard import nats_auth, procs
from switchyard.ingress.files import FileStore
from switchyard.observability import BusAuthError, BusStats, NatsClientConfig, connect, redacted, settle, subscribe
from switchyard.scheduler import SchedulerServiceConfig
from switchyard.scheduler.service import SchedulerService
from switchyard.schemas import files, subjects

pytestmark = pytest.mark.anyio

WORKERS = ("prefill-0", "decode-0")


class Secured:
    def __init__(self, server: procs.NatsServer, files: dict[str, Path]) -> None:
        self.server = server
        self.files = files

    @property
    def url(self) -> str:
        return self.server.url

    def client(self, user: str) -> NatsClientConfig:
        return NatsClientConfig(credentials_file=str(self.files[user]))

    @asynccontextmanager
    async def as_user(self, user: str, stats: BusStats | None = None) -> AsyncIterator[Client]:
        async with connect(self.url, user, stats, self.client(user)) as nc:
            yield nc


@pytest.fixture
def secured(tmp_path) -> Iterator[Secured]:
    files = nats_auth.write(tmp_path / "auth", WORKERS)
    with procs.nats_server(config=str(files[nats_auth.SERVER_CONFIG])) as server:
        yield Secured(server, files)


async def _denied(secured: Secured, user: str, subject: str) -> int:
    """Publish ``subject`` as ``user`` while admin listens: how many the admin heard, once the
    server refused it (``denied`` counted)."""
    stats = BusStats()
    async with secured.as_user("admin") as admin, secured.as_user(user, stats) as nc:
        heard = await subscribe(admin, subject)
        await settle(admin)
        await nc.publish(subject, b"forged")
        await settle(nc)
        with anyio.fail_after(5):
            while stats.denied == 0:
                await anyio.sleep(0.01)
        await settle(admin)
        return heard.pending_msgs


async def test_the_roles_do_their_work(secured: Secured):
    """What the stack needs: tasks and their acks, submits and their replies, the session bucket."""
    async with (
        secured.as_user("scheduler") as scheduler,
        secured.as_user(nats_auth.worker_user("prefill-0")) as worker,
        secured.as_user("ingress") as ingress,
        anyio.create_task_group() as tg,
    ):
        tasks = await subscribe(worker, subjects.worker_tasks("prefill-0"))
        submits = await subscribe(scheduler, subjects.SUBMIT, queue=subjects.SCHEDULER_QUEUE)
        streams = await subscribe(ingress, subjects.streams_of("ingress-1"))

        async def answer(sub, reply: bytes) -> None:
            async for msg in sub.messages:
                await msg.respond(reply)

        tg.start_soon(answer, tasks, b"ack")
        tg.start_soon(answer, submits, b"admitted")
        await settle(worker)
        await settle(scheduler)
        assert (await scheduler.request(subjects.worker_tasks("prefill-0"), b"task", timeout=5)).data == b"ack"
        assert (await ingress.request(subjects.SUBMIT, b"request", timeout=5)).data == b"admitted"
        await worker.publish(subjects.stream("ingress-1", "prefill-0"), b"tokens")
        assert (await streams.next_msg(timeout=5)).data == b"tokens"
        kv = await scheduler.jetstream().create_key_value(bucket="switchyard_sessions")
        await kv.put("k", b"v")
        assert (await kv.get("k")).value == b"v"
        tg.cancel_scope.cancel()


async def test_a_worker_cannot_publish_a_task(secured: Secured):
    assert await _denied(secured, nats_auth.worker_user("prefill-0"), subjects.worker_tasks("decode-0")) == 0


async def test_a_worker_cannot_forge_a_cancel(secured: Secured):
    assert await _denied(secured, nats_auth.worker_user("decode-0"), subjects.CANCEL) == 0


async def test_an_ingress_cannot_publish_a_task_nor_inject_into_a_stream(secured: Secured):
    assert await _denied(secured, "ingress", subjects.worker_tasks("prefill-0")) == 0
    assert await _denied(secured, "ingress", subjects.stream("ingress-1", "prefill-0")) == 0


async def test_a_worker_cannot_pass_as_another_in_a_stream(secured: Secured):
    """The subject names the sender: the ingress takes a request's tokens only from the
    workers assigned to it, so a worker must not publish under another's id."""
    worker = nats_auth.worker_user("decode-0")
    assert await _denied(secured, worker, subjects.stream("ingress-1", "decode-1")) == 0
    assert await _denied(secured, worker, subjects.stream("ingress-1", subjects.SCHEDULER_SENDER)) == 0


@pytest.mark.parametrize("user", [nats_auth.worker_user("decode-0"), "ingress"])
async def test_nobody_else_reads_a_workers_tasks(secured: Secured, user: str):
    """A refused subscription ends the service: it could not do its work."""
    stats = BusStats()
    async with secured.as_user("scheduler") as scheduler:
        with anyio.fail_after(5), pytest.raises(BusAuthError, match="subscription"):
            async with secured.as_user(user, stats) as snoop:
                stolen = await subscribe(snoop, subjects.worker_tasks("prefill-0"))
                await settle(snoop)
                await scheduler.publish(subjects.worker_tasks("prefill-0"), b"a victim's prompt")
                await settle(scheduler)
                await anyio.sleep(10)  # cancelled by the refusal
        assert stats.denied == 1 and stolen.pending_msgs == 0


async def test_an_ingress_cannot_read_the_schedulers_replies(secured: Secured):
    with anyio.fail_after(5), pytest.raises(BusAuthError, match=r"_inbox\.>"):
        async with secured.as_user("ingress") as ingress:
            await subscribe(ingress, "_INBOX.>")
            await anyio.sleep(10)


async def test_wrong_credentials_end_the_service_instead_of_retrying_forever(secured: Secured, tmp_path):
    wrong = tmp_path / "wrong.json"
    wrong.write_text('{"user": "ingress", "password": "guessed"}')
    with anyio.fail_after(5), pytest.raises(BusAuthError, match="refused these credentials"):
        async with connect(secured.url, "guesser", client=NatsClientConfig(credentials_file=str(wrong))):
            pass


async def test_no_credentials_no_connection(secured: Secured):
    with pytest.raises(nats_py.errors.Error, match="Authorization Violation"):
        await nats_py.connect(secured.url, allow_reconnect=False, connect_timeout=2)


async def test_a_service_with_its_credentials_runs(secured: Secured):
    config = SchedulerServiceConfig(nats_url=secured.url, nats_client=secured.client("scheduler"))
    service = SchedulerService(config)
    with anyio.fail_after(10):
        async with anyio.create_task_group() as tg:
            await tg.start(service.run)
            assert service.stats.denied == 0
            tg.cancel_scope.cancel()


async def test_a_password_never_shows_in_a_url_we_log():
    assert redacted("nats://scheduler:s3cret@nats:4222") == "nats://***@nats:4222"
    assert redacted("tls://t0ken@a:4222,nats://u:p@b:4222") == "tls://***@a:4222,nats://***@b:4222"
    assert redacted("nats://127.0.0.1:4222") == "nats://127.0.0.1:4222"


async def test_credentials_in_the_url_and_in_a_file_are_refused(secured: Secured):
    url = secured.url.replace("nats://", "nats://admin:pw@")
    with pytest.raises(BusAuthError) as refused:
        async with connect(url, "both", client=secured.client("admin")):
            pass
    assert "pw" not in str(refused.value)


async def test_a_missing_credentials_file_is_a_clear_error(tmp_path):
    with pytest.raises(BusAuthError, match="credentials file"):
        async with connect("nats://127.0.0.1:1", "lost", client=NatsClientConfig(credentials_file=str(tmp_path / "x"))):
            pass


@pytest.fixture
def tls_server(tmp_path) -> Iterator[tuple[str, Path]]:
    """A nats-server that requires TLS, with a self-signed certificate for 127.0.0.1 (its own CA)."""
    openssl = shutil.which("openssl")
    if openssl is None:
        pytest.skip("needs openssl to make a certificate")
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    make_cert = f"req -x509 -newkey ec -pkeyopt ec_paramgen_curve:prime256v1 -nodes -keyout {key} -out {cert}"
    make_cert += " -days 1 -subj /CN=127.0.0.1 -addext subjectAltName=IP:127.0.0.1"
    subprocess.run([openssl, *make_cert.split()], check=True, capture_output=True)
    port = procs.free_port()
    tls = ["--tls", "--tlscert", str(cert), "--tlskey", str(key)]
    command = [*procs.nats_server_command("127.0.0.1", port, None), *tls]
    server = procs.spawn(command, stdout=subprocess.DEVNULL)
    try:
        procs.wait_for_port("127.0.0.1", port, 10.0, server)
        yield f"nats://127.0.0.1:{port}", cert
    finally:
        procs.stop([server])


async def test_tls_to_an_external_server_is_one_setting(tls_server: tuple[str, Path]):
    url, ca = tls_server
    async with connect(url, "tls", client=NatsClientConfig(tls_ca=str(ca))) as nc:
        await settle(nc)
        assert nc.connected_url is not None
    with pytest.raises(ssl.SSLCertVerificationError):  # without the CA, nobody vouches for it
        await nats_py.connect(url, allow_reconnect=False, connect_timeout=2, tls=ssl.create_default_context())


# --- the Files API's buckets (schemas.permissions.file_store) -----------------------------------


async def test_the_ingress_keeps_its_file_buckets_and_nothing_more(secured: Secured):
    """Create the buckets, put, read, list and delete a file as the ingress user with no
    refusal; then everything else about those streams (and other buckets) is refused."""
    stats = BusStats()
    async with secured.as_user("ingress", stats) as nc:
        store = FileStore(nc.jetstream(timeout=5), max_bytes=1 << 20)
        await store.ensure()
        data = b"x" * 300_000  # three chunks
        file = await store.put("in.jsonl", "batch", data, tenant="acme")
        assert await store.read(file.id, tenant="acme") == data
        assert [f.id for f in (await store.list(tenant="acme"))[0]] == [file.id]
        assert await store.delete(file.id, tenant="acme")
        assert stats.denied == 0
        for stream in (files.OBJECT_STREAM, files.METADATA_STREAM):
            for api in ("STREAM.DELETE", "STREAM.UPDATE", "CONSUMER.DURABLE.CREATE"):
                await _refused_request(nc, stats, f"$JS.API.{api}.{stream}")
        await _refused_request(nc, stats, f"$JS.API.STREAM.PURGE.{files.METADATA_STREAM}")
        await _refused_request(nc, stats, "$JS.API.STREAM.INFO.KV_switchyard_sessions")
        await _refused_request(nc, stats, "$JS.API.STREAM.CREATE.OBJ_other")
        await _refused_request(nc, stats, "$O.other.M.x")
        await _refused_request(nc, stats, "$KV.switchyard_sessions.x")


async def _refused_request(nc: Client, stats: BusStats, subject: str) -> None:
    before = stats.denied
    await nc.publish(subject, b"{}", reply=nc.new_inbox())
    await settle(nc)
    with anyio.fail_after(5):
        while stats.denied == before:
            await anyio.sleep(0.01)


# --- batches (schemas.permissions.batch_ingress, batch_runner) -------------------------------------


async def test_a_batch_runs_under_the_ingress_and_batch_runner_users(secured: Secured):
    """The ingress user makes a batch (file, record, work queue), the scheduler user answers the
    runner's status requests, the batch-runner user runs every line and writes the output file:
    no refusal anywhere. Then what neither may do is refused."""
    import json

    import httpx

    from switchyard.ingress.batch_config import BatchRunnerConfig
    from switchyard.ingress.batch_runner import BatchRunner
    from switchyard.ingress.batch_store import BatchStore
    from switchyard.ingress.batches import BatchMaker

    def answer(request: httpx.Request) -> httpx.Response:
        usage = {"prompt_tokens": 1, "completion_tokens": 1, "prompt_tokens_details": {"cached_tokens": 0}}
        return httpx.Response(200, json={"id": "cmpl-1", "usage": usage})

    body = {"model": "m", "prompt": "hi", "max_tokens": 1}
    data = b"".join(
        json.dumps({"custom_id": f"c{i}", "method": "POST", "url": "/v1/completions", "body": body}).encode() + b"\n"
        for i in range(3)
    )
    ingress_stats, runner_stats = BusStats(), BusStats()
    scheduler = SchedulerService(SchedulerServiceConfig(nats_url=secured.url, nats_client=secured.client("scheduler")))
    runner = BatchRunner(
        BatchRunnerConfig(
            nats_url=secured.url, nats_client=secured.client(nats_auth.BATCH_RUNNER_USER), scan_interval_s=0.1
        ),
        transport=httpx.MockTransport(answer),
    )
    runner.stats = runner_stats
    async with secured.as_user("ingress", ingress_stats) as nc, anyio.create_task_group() as tg:
        await tg.start(scheduler.run)
        store = BatchStore(nc)
        await store.ensure()
        batch = await BatchMaker(store, "m").create(
            tenant="acme", endpoint="/v1/completions", window="24h", metadata=None, input_file_id="f", data=data
        )
        assert batch.status == "in_progress"
        await tg.start(runner.run)
        with anyio.fail_after(20):
            while (got := await store.get(batch.id)) is None or got.status != "completed":
                await anyio.sleep(0.05)
        assert got.request_counts.completed == 3 and got.output_file_id
        assert await store.visible(batch.id, "acme") == got
        assert ingress_stats.denied == 0 and runner_stats.denied == 0
        for subject in (
            "$KV.switchyard_batch_results.x",
            "$JS.API.CONSUMER.MSG.NEXT.SWITCHYARD_BATCH_WORK.x",
            "$JS.API.STREAM.DELETE.SWITCHYARD_BATCH_WORK",
            "$JS.API.STREAM.PURGE.KV_switchyard_batches",
            "$JS.API.STREAM.MSG.GET.KV_switchyard_batch_results",
        ):
            await _refused_request(nc, ingress_stats, subject)
        tg.cancel_scope.cancel()
    async with secured.as_user(nats_auth.BATCH_RUNNER_USER, runner_stats) as nc:
        for subject in (
            subjects.CANCEL,
            subjects.worker_tasks("prefill-0"),
            subjects.stream("ingress-1", "prefill-0"),
            "$JS.API.STREAM.DELETE.SWITCHYARD_BATCH_WORK",
            "$JS.API.STREAM.PURGE.SWITCHYARD_BATCH_WORK",
            "$JS.API.STREAM.INFO.SWITCHYARD_USAGE",
            "$KV.switchyard_sessions.x",
        ):
            await _refused_request(nc, runner_stats, subject)
