"""Usage records on a real nats-server with JetStream: each record stored once, a retry
within the duplicate window deduplicated by the stream, records held while JetStream is
not there and delivered once it is (or dropped and counted when the buffer is full), the
ingress's NATS user able to write records and nothing more, and ``switchyard usage``'s
numbers (cached share included, each request id counted once)."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import anyio
import pytest
from nats.aio.client import Client
from nats.js.api import StorageType

from switchyard import cli, nats_auth, procs
from switchyard import usage as usage_cli
from switchyard.ingress.config import IngressConfig, UsageConfig
from switchyard.ingress.usage import UsageRecorder
from switchyard.observability import BusStats, NatsClientConfig, ServingMetrics, connect, settle
from switchyard.schemas import UsageRecord, subjects, usage

pytestmark = pytest.mark.anyio

ANONYMOUS = NatsClientConfig()


def record(request_id: str, tenant: str = "acme", prompt: int = 100, cached: int = 64, completion: int = 8):
    return UsageRecord(
        request_id=request_id,
        tenant=tenant,
        model="switchyard-sim",
        kind="chat",
        outcome="ok",
        prompt_tokens=prompt,
        cached_tokens=cached,
        completion_tokens=completion,
        arrived_unix=1_700_000_000.0,
        finished_unix=1_700_000_001.0,
        first_token_unix=1_700_000_000.5,
        ingress_id="ingress-t",
    )


def config(url: str, **usage_settings) -> IngressConfig:
    return IngressConfig(nats_url=url, ingress_id="ingress-t", usage=UsageConfig(**usage_settings))


@asynccontextmanager
async def recorder(
    url: str, cfg: IngressConfig | None = None, client: NatsClientConfig = ANONYMOUS, stats: BusStats | None = None
) -> AsyncIterator[UsageRecorder]:
    async with connect(url, "ingress-t", stats, client) as nc, anyio.create_task_group() as tg:
        rec = UsageRecorder(nc, cfg or config(url), ServingMetrics())
        await tg.start(rec.run)
        yield rec
        tg.cancel_scope.cancel()


async def published(rec: UsageRecorder, count: int, timeout_s: float = 10) -> None:
    with anyio.fail_after(timeout_s):
        while rec.published < count:
            await anyio.sleep(0.01)


async def stored(url: str, client: NatsClientConfig = ANONYMOUS) -> list[UsageRecord]:
    return await usage_cli.read_records(url, client)


async def test_each_record_is_stored_once_on_its_tenants_subject(nats):
    records = [record("chatcmpl-1"), record("chatcmpl-2", tenant="team.b"), record("chatcmpl-3")]
    async with recorder(nats.url) as rec:
        for r in records:
            rec.add(r)
        await published(rec, 3)
    assert await stored(nats.url) == records
    async with connect(nats.url, "admin") as nc:
        js = nc.jetstream()
        info = await js.stream_info(usage.STREAM)
        second = await js.get_msg(usage.STREAM, 2)
    assert info.config.subjects == [subjects.every_usage()] and info.config.storage == StorageType.FILE
    assert info.config.duplicate_window == 600 and info.config.max_age == 90 * 86400
    assert second.subject == "sy.v1.usage.team~b" and second.headers["Nats-Msg-Id"] == "chatcmpl-2"


async def test_a_record_retried_within_the_window_is_stored_once(nats):
    async with recorder(nats.url) as rec:
        rec.add(record("chatcmpl-1"))
        rec.add(record("chatcmpl-1"))  # its ack was lost, say: published again
        rec.add(record("chatcmpl-2"))
        await published(rec, 2)
        async with connect(nats.url, "billing") as nc:
            ack = await nc.jetstream().publish(
                subjects.usage("acme"), usage.encode(record("chatcmpl-2")), headers={"Nats-Msg-Id": "chatcmpl-2"}
            )
    assert ack.duplicate
    assert [r.request_id for r in await stored(nats.url)] == ["chatcmpl-1", "chatcmpl-2"]
    assert rec.published == 2 and rec.dropped == 0


async def test_a_stream_that_exists_keeps_its_operators_configuration(nats):
    async with connect(nats.url, "operator") as nc:
        js = nc.jetstream()
        await js.add_stream(name=usage.STREAM, subjects=[subjects.every_usage()], max_age=86400, duplicate_window=60)
        async with recorder(nats.url) as rec:
            rec.add(record("chatcmpl-1"))
            await published(rec, 1)
        kept = (await js.stream_info(usage.STREAM)).config
    assert (kept.max_age, kept.duplicate_window, kept.storage) == (86400, 60, StorageType.FILE)
    assert [r.request_id for r in await stored(nats.url)] == ["chatcmpl-1"]


async def test_a_stream_deleted_under_a_running_ingress_is_created_again(nats):
    async with recorder(nats.url) as rec, connect(nats.url, "operator") as nc:
        rec.add(record("chatcmpl-1"))
        await published(rec, 1)
        await nc.jetstream().delete_stream(usage.STREAM)
        rec.add(record("chatcmpl-2"))
        await published(rec, 2)
    assert [r.request_id for r in await stored(nats.url)] == ["chatcmpl-2"]


async def test_records_wait_for_jetstream_and_are_delivered_once_it_is_there():
    port = procs.free_port()
    with procs.nats_server(port=port, jetstream=False) as plain:
        url = plain.url
        async with connect(url, "ingress-t") as nc, anyio.create_task_group() as tg:
            rec = UsageRecorder(nc, config(url), ServingMetrics())
            await tg.start(rec.run)
            rec.add(record("chatcmpl-1"))
            rec.add(record("chatcmpl-2"))
            with anyio.fail_after(10):
                while not rec.stalled:
                    await anyio.sleep(0.01)
            assert rec.published == 0
            plain.process.terminate()
            plain.process.wait(5)
            with procs.nats_server(port=port, jetstream=True):  # the same address, now with JetStream
                await published(rec, 2, timeout_s=30)
                assert not rec.stalled
                assert [r.request_id for r in await stored(url)] == ["chatcmpl-1", "chatcmpl-2"]
                tg.cancel_scope.cancel()
    assert rec.dropped == 0


async def test_a_full_buffer_drops_records_and_counts_them():
    with procs.nats_server(jetstream=False) as plain:
        metrics = ServingMetrics()
        async with connect(plain.url, "ingress-t") as nc:
            rec = UsageRecorder(nc, config(plain.url, buffer=2), metrics)
            for n in range(5):
                rec.add(record(f"chatcmpl-{n}"))
            assert rec.dropped == 3  # two held
            async with anyio.create_task_group() as tg:
                await tg.start(rec.run)
                tg.cancel_scope.cancel()  # stopped with two unpublished: no JetStream to take them
            rec.add(record("chatcmpl-late"))
    assert rec.dropped == 6 and rec.published == 0
    text = metrics.exposition().decode()
    assert "switchyard_usage_records_dropped_total 6.0" in text
    assert "switchyard_usage_records_pending 0.0" in text


async def test_records_off_publish_nothing(nats):
    async with recorder(nats.url, config(nats.url, records=False)) as rec:
        assert not rec.enabled
    assert await stored(nats.url) == []


# --- who may write and read -------------------------------------------------------------------


async def test_the_ingress_user_writes_records_and_cannot_remove_them(tmp_path):
    files = nats_auth.write(tmp_path / "auth", ["prefill-0"])
    admin = NatsClientConfig(credentials_file=str(files["admin"]))
    ingress = NatsClientConfig(credentials_file=str(files["ingress"]))
    with procs.nats_server(config=str(files[nats_auth.SERVER_CONFIG])) as server:
        stats = BusStats()
        async with recorder(server.url, client=ingress, stats=stats) as rec:
            rec.add(record("chatcmpl-1"))
            await published(rec, 1)
            async with connect(server.url, "ingress-t2", stats, ingress) as nc:
                await _refused(nc, stats, f"$JS.API.STREAM.DELETE.{usage.STREAM}")
                await _refused(nc, stats, f"$JS.API.STREAM.PURGE.{usage.STREAM}")
                await _refused(nc, stats, f"$JS.API.STREAM.UPDATE.{usage.STREAM}")
                await _refused(nc, stats, f"$JS.API.CONSUMER.CREATE.{usage.STREAM}")
                await _refused(nc, stats, "$JS.API.STREAM.CREATE.KV_switchyard_sessions")
        assert [r.request_id for r in await stored(server.url, admin)] == ["chatcmpl-1"]


async def _refused(nc: Client, stats: BusStats, subject: str) -> None:
    before = stats.denied
    await nc.publish(subject, b"{}", reply=nc.new_inbox())
    await settle(nc)
    with anyio.fail_after(5):
        while stats.denied == before:
            await anyio.sleep(0.01)


# --- switchyard usage ---------------------------------------------------------------------------


async def test_the_command_sums_by_tenant_once_per_request(nats, capsys):
    async with recorder(nats.url) as rec:
        rec.add(record("a-1", "acme", prompt=200, cached=0, completion=10))
        rec.add(record("a-2", "acme", prompt=200, cached=160, completion=10))
        rec.add(record("b-1", "bravo", prompt=50, cached=0, completion=5))
        await published(rec, 3)
    async with connect(nats.url, "late-retry") as nc:  # retried after the window: a new message id
        await nc.jetstream().publish(subjects.usage("acme"), usage.encode(record("a-2", "acme", 200, 160, 10)))

    assert await anyio.to_thread.run_sync(cli.main, ["usage", "--nats-url", nats.url, "--json"]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["tenants"] == [
        {
            "tenant": "acme",
            "requests": 2,
            "prompt_tokens": 400,
            "cached_tokens": 160,
            "completion_tokens": 20,
            "cached_share": 0.4,
        },
        {
            "tenant": "bravo",
            "requests": 1,
            "prompt_tokens": 50,
            "cached_tokens": 0,
            "completion_tokens": 5,
            "cached_share": 0.0,
        },
    ]
    assert summary["total"]["requests"] == 3 and summary["total"]["cached_share"] == round(160 / 450, 4)
    assert summary["duplicates"] == 1

    assert await anyio.to_thread.run_sync(cli.main, ["usage", "--nats", nats.url]) == 0
    rows = {line.split()[0]: line.split() for line in capsys.readouterr().out.splitlines()}
    assert rows["acme"] == ["acme", "2", "400", "160", "40.0%", "20"]
    assert rows["bravo"] == ["bravo", "1", "50", "0", "0.0%", "5"]
    assert rows["(total)"] == ["(total)", "3", "450", "160", "35.6%", "25"]


async def test_since_reads_only_the_records_stored_since(nats):
    async with recorder(nats.url) as rec:
        rec.add(record("old"))
        await published(rec, 1)
        await anyio.sleep(2.5)
        rec.add(record("new"))
        await published(rec, 2)
        recent = await usage_cli.read_records(nats.url, ANONYMOUS, since_s=1.5)
        await anyio.sleep(0.5)
        none = await usage_cli.read_records(nats.url, ANONYMOUS, since_s=0.2)  # no consumer waits forever
    assert [r.request_id for r in recent] == ["new"] and none == []


async def test_the_command_on_a_server_without_records(nats, capsys):
    assert await anyio.to_thread.run_sync(cli.main, ["usage", "--nats-url", nats.url, "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["total"]["requests"] == 0


async def test_the_command_says_why_it_cannot_read(capsys):
    with procs.nats_server(jetstream=False) as plain:
        assert await anyio.to_thread.run_sync(cli.main, ["usage", "--nats-url", plain.url]) == 2
    assert "cannot read the usage stream SWITCHYARD_USAGE" in capsys.readouterr().err
    nobody = f"nats://127.0.0.1:{procs.free_port()}"
    assert await anyio.to_thread.run_sync(cli.main, ["usage", "--nats-url", nobody, "--timeout-s", "1"]) == 2
    assert "no answer within 1 s" in capsys.readouterr().err
