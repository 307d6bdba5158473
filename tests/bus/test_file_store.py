"""The Files API's store on a real nats-server with JetStream (file storage): what goes in
comes out, per tenant; pages hold together; a tenant never reaches another's files; the
size limit holds; and files outlive a restart of the server on the same store."""

from __future__ import annotations

import anyio
import pytest

from switchyard import procs
from switchyard.ingress.errors import InvalidRequest, RequestTooLarge
from switchyard.ingress.files import FileNotFound, FileStore, FilesUnavailable
from switchyard.observability import connect

pytestmark = pytest.mark.anyio

LINE = b'{"custom_id": "a", "method": "POST", "url": "/v1/chat/completions", "body": {}}\n'


def _store(nc, max_bytes: int = 1 << 20) -> FileStore:
    return FileStore(nc.jetstream(timeout=10), max_bytes=max_bytes)


async def test_put_info_read_delete(nats):
    async with connect(nats.url, "test") as nc:
        store = _store(nc)
        await store.ensure()
        await store.ensure()  # a second time finds the buckets
        data = LINE * 3000  # more than one 128 KiB chunk
        file = await store.put("input.jsonl", "batch", data, tenant="acme")
        assert file.id.startswith("file-") and len(file.id) == 29
        assert (file.bytes, file.filename, file.purpose, file.status) == (
            len(data),
            "input.jsonl",
            "batch",
            "processed",
        )
        assert await store.info(file.id, tenant="acme") == file
        assert await store.read(file.id, tenant="acme") == data
        assert await store.delete(file.id, tenant="acme") is True
        assert await store.delete(file.id, tenant="acme") is False
        with pytest.raises(FileNotFound, match=file.id):
            await store.info(file.id, tenant="acme")
        with pytest.raises(FileNotFound):
            await store.read(file.id, tenant="acme")
        empty = await store.put("empty.jsonl", "user_data", b"", tenant="acme")
        assert await store.read(empty.id, tenant="acme") == b""


async def test_list_pages_in_both_orders(nats):
    async with connect(nats.url, "test") as nc:
        store = _store(nc)
        made = [await store.put(f"f{i}.jsonl", "batch", LINE, tenant="acme") for i in range(7)]
        await store.put("other.jsonl", "user_data", LINE, tenant="acme")
        everything, more = await store.list(tenant="acme")
        assert len(everything) == 8 and not more
        newest_first = [f.id for f in reversed(made)]
        for order, expected in (("desc", newest_first), ("asc", newest_first[::-1])):
            pages: list[str] = []
            after = None
            while True:
                page, more = await store.list(tenant="acme", purpose="batch", after=after, limit=3, order=order)
                pages += [f.id for f in page]
                if not more:
                    break
                after = page[-1].id
            assert pages == expected, order
        # A cursor whose file has gone still places the next page.
        page, _ = await store.list(tenant="acme", purpose="batch", limit=2)
        await store.delete(page[-1].id, tenant="acme")
        rest, more = await store.list(tenant="acme", purpose="batch", after=page[-1].id)
        assert [f.id for f in rest] == newest_first[2:] and not more


async def test_one_tenant_never_reaches_anothers_files(nats):
    async with connect(nats.url, "test") as nc:
        store = _store(nc)
        mine = await store.put("secret.jsonl", "batch", b"acme's data\n", tenant="acme")
        # "acme.x" and "acme" must not share a key prefix (a dot is a subject token).
        theirs = await store.put("x.jsonl", "batch", b"x's data\n", tenant="acme.x")
        for other in ("beta", "acme.x", "acme=x", "acme.", "ACME"):
            with pytest.raises(FileNotFound):
                await store.info(mine.id, tenant=other)
            with pytest.raises(FileNotFound):
                await store.read(mine.id, tenant=other)
            assert await store.delete(mine.id, tenant=other) is False
            assert mine.id not in [f.id for f in (await store.list(tenant=other))[0]]
        assert [f.id for f in (await store.list(tenant="acme"))[0]] == [mine.id]
        assert [f.id for f in (await store.list(tenant="acme.x"))[0]] == [theirs.id]
        assert await store.read(mine.id, tenant="acme") == b"acme's data\n"
        for bogus in ("file-*", "file->", "acme.x", "", mine.id + ".x", "../" + mine.id):
            with pytest.raises(FileNotFound):
                await store.info(bogus, tenant="acme")


async def test_size_limit_and_purpose(nats):
    async with connect(nats.url, "test") as nc:
        store = _store(nc, max_bytes=1000)
        await store.put("ok.jsonl", "batch", b"x" * 1000, tenant="acme")
        with pytest.raises(RequestTooLarge):
            await store.put("big.jsonl", "batch", b"x" * 1001, tenant="acme")
        with pytest.raises(InvalidRequest) as bad:
            await store.put("f.jsonl", "fine-tune", b"x", tenant="acme")
        assert bad.value.param == "purpose"
        assert len((await store.list(tenant="acme"))[0]) == 1


async def test_without_jetstream_the_store_is_unavailable():
    with procs.nats_server(jetstream=False) as plain:
        async with connect(plain.url, "test") as nc:
            store = _store(nc)
            with pytest.raises(FilesUnavailable, match="JetStream"):
                await store.ensure()
            with pytest.raises(FilesUnavailable):
                await store.list(tenant="acme")


async def test_files_survive_a_server_restart_on_file_storage(tmp_path):
    port = procs.free_port()
    with procs.nats_server(port=port, store_dir=str(tmp_path)) as server:
        async with connect(server.url, "test") as nc:
            file = await _store(nc).put("input.jsonl", "batch", LINE * 100, tenant="acme")
    with procs.nats_server(port=port, store_dir=str(tmp_path)) as server:
        async with connect(server.url, "test") as nc:
            store = _store(nc)
            assert await store.info(file.id, tenant="acme") == file
            assert await store.read(file.id, tenant="acme") == LINE * 100
            assert [f.id for f in (await store.list(tenant="acme"))[0]] == [file.id]


async def test_a_long_listing_reads_every_record_and_skips_deleted_ones(nats):
    async with connect(nats.url, "test") as nc:
        store = _store(nc)
        made = [(await store.put(f"{i}.jsonl", "batch", b"x", tenant="many")).id for i in range(300)]
        for file_id in made[::3]:
            await store.delete(file_id, tenant="many")
        page, more = await store.list(tenant="many", order="asc")
        assert [f.id for f in page] == [f for i, f in enumerate(made) if i % 3] and not more


async def test_a_server_that_lost_its_store_gets_the_buckets_again(tmp_path):
    """A 503 at first (the buckets are gone), then they are created anew; old files are gone."""
    port = procs.free_port()
    with procs.nats_server(port=port, store_dir=str(tmp_path / "a")) as server:
        async with connect(server.url, "test") as nc:
            store = _store(nc)
            old = await store.put("old.jsonl", "batch", LINE, tenant="acme")
            server.process.terminate()
            server.process.wait()
            with procs.nats_server(port=port, store_dir=str(tmp_path / "b")):
                with anyio.fail_after(10):
                    while not (nc.stats["reconnects"] and nc.is_connected):  # nats-py offers flags, no event
                        await anyio.sleep(0.05)
                with pytest.raises(FilesUnavailable):
                    await store.put("new.jsonl", "batch", LINE, tenant="acme")
                new = await store.put("new.jsonl", "batch", LINE, tenant="acme")
                assert await store.read(new.id, tenant="acme") == LINE
                with pytest.raises(FileNotFound):
                    await store.info(old.id, tenant="acme")
