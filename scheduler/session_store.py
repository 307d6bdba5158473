"""Session bindings kept in a JetStream key-value bucket, so they outlive a scheduler.

The core emits ``BindSession`` actions; the service writes each one here. A scheduler
that starts reads the bucket back into its core. Values are msgpack, with the expiry as
wall-clock time, because the monotonic clock of one process means nothing to the next.
The bucket's own TTL drops entries nobody renews. Without JetStream the scheduler still
works, without persistence (logged once).

Keys are a fixed-length digest of (tenant, session) (``KEY_CHARS`` hex characters),
whatever a client sent: a key is part of a NATS protocol line, and a line over the
server's ``max_control_line`` (4,096 bytes) makes the server close the connection. The
tenant and the session themselves travel in the value.

A bucket that disappears (a NATS server restarted without its store, or the bucket
deleted) is created again on the next write, which reports it (``put`` returns True) so
the service can write back every binding it still holds.
"""

from __future__ import annotations

import hashlib
import logging
import time

import msgspec
from nats.aio.client import Client
from nats.js.api import KeyValueConfig
from nats.js.errors import BucketNotFoundError, NoKeysError, NoStreamResponseError, NotFoundError
from nats.js.kv import KeyValue

from switchyard.scheduler.sessions import Binding

log = logging.getLogger(__name__)

BUCKET = "switchyard_sessions"
KEY_CHARS = 32  # BLAKE2b-128, in hex


class _Stored(msgspec.Struct, frozen=True, kw_only=True):
    tenant: str
    session: str
    worker_id: str
    expires_unix: float


_ENCODER = msgspec.msgpack.Encoder()
_DECODER = msgspec.msgpack.Decoder(_Stored)


def session_key(tenant: str, session: str) -> str:
    """The bucket key of a (tenant, session): bounded and safe in a subject, whatever the input."""
    digest = hashlib.blake2b(digest_size=KEY_CHARS // 2)
    name = tenant.encode()
    digest.update(len(name).to_bytes(8, "little") + name)  # length first: no two pairs run together
    digest.update(session.encode())
    return digest.hexdigest()


class SessionStore:
    def __init__(self, nc: Client | None, ttl_s: float, kv: KeyValue | None) -> None:
        self._nc = nc
        self._config = KeyValueConfig(bucket=BUCKET, ttl=ttl_s, history=1)
        self._kv = kv

    @classmethod
    def disabled(cls) -> SessionStore:
        return cls(None, 1.0, None)

    @classmethod
    async def open(cls, nc: Client, ttl_s: float) -> SessionStore:
        store = cls(nc, ttl_s, None)
        try:
            store._kv = await store._create()
        except Exception as exc:  # no JetStream on this server: run without persistence
            log.warning("session bindings will not survive a restart: no JetStream KV (%s)", exc)
        return store

    async def _create(self) -> KeyValue:
        assert self._nc is not None
        return await self._nc.jetstream().create_key_value(self._config)

    @property
    def enabled(self) -> bool:
        return self._kv is not None

    async def put(self, binding: Binding, now: float) -> bool:
        """Write one binding; True if the bucket was missing and had to be created again."""
        if self._kv is None:
            return False
        stored = _Stored(
            tenant=binding.tenant,
            session=binding.session,
            worker_id=binding.worker_id,
            expires_unix=time.time() + (binding.expires_at - now),
        )
        key, value = session_key(binding.tenant, binding.session), _ENCODER.encode(stored)
        try:
            await self._kv.put(key, value)
            return False
        except (NoStreamResponseError, BucketNotFoundError):  # no stream behind the bucket's subjects
            log.warning("session bucket %s is gone (NATS restarted without its store?); creating it again", BUCKET)
        self._kv = await self._create()
        await self._kv.put(key, value)
        return True

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
