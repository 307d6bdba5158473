"""The session bucket on a real nats-server: keys bounded whatever a client sends, and a
bucket that disappears is created again, with every binding the scheduler holds."""

from __future__ import annotations

import anyio
import nats
import pytest
from nats.js.errors import BucketNotFoundError

from switchyard.scheduler import SchedulerServiceConfig
from switchyard.scheduler.service import SchedulerService
from switchyard.scheduler.session_store import BUCKET, KEY_CHARS, SessionStore, session_key
from switchyard.scheduler.sessions import Binding

pytestmark = pytest.mark.anyio


def test_keys_are_bounded_and_safe_whatever_the_session():
    keys = {session_key("t", "s" * n) for n in (0, 1, 2_100, 100_000)} | {session_key("t", "a.b *>\x00\n")}
    assert len(keys) == 5
    assert all(len(k) == KEY_CHARS and k.isalnum() for k in keys)
    assert session_key("a", "b\x00c") != session_key("a\x00b", "c")  # the tenant ends where it should


async def test_a_huge_session_is_stored_and_the_connection_survives(nats):
    async with await _client(nats.url) as nc:
        store = await SessionStore.open(nc, ttl_s=60)
        huge = Binding("tenant-1", "s" * 100_000, "prefill-a", expires_at=50.0)
        assert not await store.put(huge, now=0.0)
        [loaded] = await store.load(now=0.0)
        assert nc.is_connected
    assert (loaded.tenant, loaded.session, loaded.worker_id) == (huge.tenant, huge.session, "prefill-a")


async def test_a_deleted_bucket_is_created_again_on_the_next_write(nats):
    async with await _client(nats.url) as nc:
        store = await SessionStore.open(nc, ttl_s=60)
        await store.put(Binding("t", "old", "prefill-a", expires_at=50.0), now=0.0)
        await nc.jetstream().delete_key_value(BUCKET)
        assert await store.put(Binding("t", "new", "prefill-b", expires_at=50.0), now=0.0)
        assert [b.session for b in await store.load(now=0.0)] == ["new"]


async def test_the_scheduler_writes_back_what_it_holds_when_the_bucket_was_lost(nats):
    service = SchedulerService(SchedulerServiceConfig(nats_url=nats.url))
    async with anyio.create_task_group() as tg, await _client(nats.url) as nc:
        await tg.start(service.run)
        now = service._clock()
        service.core.restore_session(Binding("t", "held", "prefill-a", expires_at=now + 60), now)
        await nc.jetstream().delete_key_value(BUCKET)
        service._queue_binding(Binding("t", "new", "prefill-b", expires_at=now + 60))
        with anyio.fail_after(5):
            while await _sessions_in_bucket(nc) != ["held", "new"]:
                await anyio.sleep(0.05)
        tg.cancel_scope.cancel()


async def _sessions_in_bucket(nc) -> list[str]:
    """What the bucket holds, read without creating it (that is the scheduler's job)."""
    try:
        kv = await nc.jetstream().key_value(BUCKET)
    except BucketNotFoundError:
        return []
    store = SessionStore(nc, 60.0, kv)
    return sorted(b.session for b in await store.load(now=0.0))


async def _client(url: str):
    return await nats.connect(url)
