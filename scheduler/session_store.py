"""Session bindings kept in a JetStream key-value bucket, so they outlive a scheduler.

The core emits ``BindSession`` actions; the service writes each one here. A scheduler
that starts reads the bucket back into its core. Keys are the hex of
"tenant NUL session" (any bytes a client sends are safe as a subject token); values
are msgpack, with the expiry as wall-clock time, because the monotonic clock of one
process means nothing to the next. The bucket's own TTL drops entries nobody renews.
Without JetStream the scheduler still works, without persistence (logged once).
"""

from __future__ import annotations

import logging
import time

import msgspec
from nats.aio.client import Client
from nats.js.api import KeyValueConfig
from nats.js.errors import NoKeysError, NotFoundError
from nats.js.kv import KeyValue

from switchyard.scheduler.sessions import Binding

log = logging.getLogger(__name__)

BUCKET = "switchyard_sessions"


class _Stored(msgspec.Struct, frozen=True, kw_only=True):
    tenant: str
    session: str
    worker_id: str
    expires_unix: float


_ENCODER = msgspec.msgpack.Encoder()
_DECODER = msgspec.msgpack.Decoder(_Stored)


def _key(tenant: str, session: str) -> str:
    return f"{tenant}\x00{session}".encode().hex()


class SessionStore:
    def __init__(self, kv: KeyValue | None) -> None:
        self._kv = kv

    @classmethod
    async def open(cls, nc: Client, ttl_s: float) -> SessionStore:
        try:
            kv = await nc.jetstream().create_key_value(KeyValueConfig(bucket=BUCKET, ttl=ttl_s, history=1))
        except Exception as exc:  # no JetStream on this server: run without persistence
            log.warning("session bindings will not survive a restart: no JetStream KV (%s)", exc)
            return cls(None)
        return cls(kv)

    @property
    def enabled(self) -> bool:
        return self._kv is not None

    async def put(self, binding: Binding, now: float) -> None:
        if self._kv is None:
            return
        stored = _Stored(
            tenant=binding.tenant,
            session=binding.session,
            worker_id=binding.worker_id,
            expires_unix=time.time() + (binding.expires_at - now),
        )
        await self._kv.put(_key(binding.tenant, binding.session), _ENCODER.encode(stored))

    async def load(self, now: float) -> list[Binding]:
        """Every live binding, with its expiry on this process's clock ``now``."""
        if self._kv is None:
            return []
        try:
            keys = await self._kv.keys()
        except (NoKeysError, NotFoundError):  # an empty bucket
            return []
        bindings = []
        wall = time.time()
        for key in keys:
            try:
                entry = await self._kv.get(key)
            except NotFoundError:
                continue  # expired or deleted meanwhile
            if not entry.value:
                continue
            stored = _DECODER.decode(entry.value)
            bindings.append(
                Binding(stored.tenant, stored.session, stored.worker_id, now + (stored.expires_unix - wall))
            )
        return bindings
