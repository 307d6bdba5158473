"""The scheduler's lease on a real nats-server with JetStream: a replica that stops deletes
its key, so a standby takes over at once instead of after the TTL, even when the stop cut a
renewal short."""

from __future__ import annotations

import time

import pytest
from nats.js.errors import KeyNotFoundError

from switchyard.observability import connect
from switchyard.scheduler.lease import BUCKET, KEY, LeaseKeeper, LeaseState

pytestmark = pytest.mark.anyio


async def _active(nc, holder: str) -> LeaseKeeper:
    keeper = LeaseKeeper(nc, holder, LeaseState(ttl_s=30.0, renew_s=1.0), time.monotonic)
    await keeper.open()
    assert await keeper.try_once()  # created: active
    return keeper


async def test_a_stopping_replica_deletes_its_lease(nats):
    async with connect(nats.url, "lease-test") as nc:
        keeper = await _active(nc, "sched-a")
        await keeper.try_once()  # a renewal, answered
        await keeper.release()
        with pytest.raises(KeyNotFoundError):
            await (await nc.jetstream().key_value(BUCKET)).get(KEY)


async def test_a_lease_whose_last_renewal_went_unanswered_is_still_deleted(nats):
    """The stop cancelled a renewal after the server stored it and before its answer was
    read: the revision held is one behind the key's. Before, that delete was refused and a
    standby waited out the TTL (a CI run of the failover test took longer than its prefill)."""
    async with connect(nats.url, "lease-test") as nc:
        keeper = await _active(nc, "sched-a")
        kv = await nc.jetstream().key_value(BUCKET)
        await kv.update(KEY, b"sched-a", last=keeper.state.revision)  # stored; the keeper never heard
        await keeper.release()
        with pytest.raises(KeyNotFoundError):
            await kv.get(KEY)


async def test_a_lease_someone_else_holds_by_now_is_left_to_them(nats):
    async with connect(nats.url, "lease-test") as nc:
        keeper = await _active(nc, "sched-a")
        kv = await nc.jetstream().key_value(BUCKET)
        await kv.update(KEY, b"sched-b", last=keeper.state.revision)
        await keeper.release()
        assert (await kv.get(KEY)).value == b"sched-b"
