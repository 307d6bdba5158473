"""Who is calling, as which tenant, and how much they may ask for.

The tenant scopes a request's cache (every block key is salted with it), so whoever may
name a tenant may read that tenant's cache through ``usage.prompt_tokens_details.cached_tokens``.
Hence the tenant comes from the caller's API key, never from what a client says: the
``x-switchyard-tenant`` header is honoured only from a key with the trusted-proxy right (a
front proxy asserting its end user's tenant) and refused with 403 from anyone else.

The modes (``IngressConfig.auth``), each announced at start:
- ``keys``: every ``/v1`` route needs ``Authorization: Bearer sk-sy-...``, a live key of the
  keys file (401 without one); the tenant is the key's.
- ``none``: no keys; every client is tenant ``default`` and the header is refused (403), so
  no client can pick another tenant's cache. What the embedded stack starts with.
- ``proxy``: no keys; the header is trusted from every client. Only for an ingress that
  nothing but a front proxy setting the header can reach.

The keys file (JSON) holds, per key, the SHA-256 of its secret, never the secret. A secret is
32 random bytes, so a fast hash is enough (a slow KDF protects guessable passwords, not
random keys); the digest is compared in constant time. The file is written whole and
atomically (a temporary file renamed over it, mode 0600) under an advisory lock; the ingress
looks at it at most once a second and re-reads it when it changed, so a revoked key stops
working within about a second. A file that becomes unreadable refuses every key (fail closed).

Limits, per key and per ingress process (N ingresses admit up to N times as much); 0 is
no limit:
- ``rpm``: a bucket of ``rpm`` requests refilled over a minute, charged for every ``/v1``
  request before its body is read;
- ``tpm``: a bucket of ``tpm`` tokens, charged prompt + ``max_tokens`` at admission and
  refunded, when the request ends, what it did not use. A request larger than the bucket
  is admitted when the bucket is full and leaves it in debt, so every 429 has a true
  ``Retry-After``;
- ``max_streams``: requests generating at once (streamed or not), held until the response
  ends (its last byte sent, or its client gone).
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import hmac
import logging
import math
import os
import re
import secrets
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import msgspec
from starlette.datastructures import Headers

from switchyard.ingress.errors import (
    ApiError,
    IngressError,
    InvalidRequest,
    PermissionDenied,
    RateLimited,
    Unauthorized,
)

if TYPE_CHECKING:
    from starlette.requests import Request
    from starlette.types import ASGIApp, Receive, Scope, Send

    from switchyard.ingress.config import IngressConfig

log = logging.getLogger(__name__)

AuthMode = Literal["none", "keys", "proxy"]
TENANT_HEADER = "x-switchyard-tenant"
DEFAULT_TENANT = "default"
TENANT_PATTERN = r"^[A-Za-z0-9._-]{1,64}$"
KEY_PREFIX = "sk-sy-"
_TENANT_RE = re.compile(TENANT_PATTERN)
_MAX_KEY_CHARS = 256  # a real key is about 62; longer is not one of ours, and is not hashed whole
_RELOAD_EVERY_S = 1.0
_NO_DIGEST = hashlib.sha256(b"no such key").hexdigest()  # compared against for an unknown key id
_CALLER = "switchyard.caller"  # the ASGI scope key of a request's Caller


class KeyStoreError(IngressError):
    """A keys file that cannot be read or written, or a key it does not hold."""


# --- the keys file --------------------------------------------------------------------------------


class Limits(msgspec.Struct, frozen=True, kw_only=True):
    rpm: int = 0  # requests per minute
    tpm: int = 0  # tokens per minute: prompt + max_tokens reserved, the unused part refunded
    max_streams: int = 0  # requests generating at once

    def __post_init__(self) -> None:
        for name in ("rpm", "tpm", "max_streams"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be 0 (no limit) or more")


NO_LIMITS = Limits()


class KeyRecord(msgspec.Struct, frozen=True, kw_only=True):
    key_id: str  # public: the part of the secret after sk-sy-, before the next dash
    tenant: str
    sha256: str  # hex digest of the whole secret
    created: float  # unix time
    limits: Limits = NO_LIMITS
    trusted_proxy: bool = False  # may assert the end tenant with x-switchyard-tenant
    revoked: float | None = None  # unix time


class _KeyFile(msgspec.Struct, kw_only=True):
    version: int = 1
    keys: list[KeyRecord] = msgspec.field(default_factory=list)


def digest(secret: str) -> str:
    return hashlib.sha256(secret.encode()).hexdigest()


def key_id_of(secret: str) -> str | None:
    """The key id a secret names (``sk-sy-<id>-<random>``), or None for no key of ours."""
    if not secret.startswith(KEY_PREFIX) or len(secret) > _MAX_KEY_CHARS:
        return None
    key_id, dash, rest = secret[len(KEY_PREFIX) :].partition("-")
    return key_id if key_id and dash and rest else None


def valid_tenant(tenant: str) -> bool:
    return _TENANT_RE.match(tenant) is not None


class KeyStore:
    """The keys file: read whole, written whole and atomically, one writer at a time."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)

    def read(self) -> list[KeyRecord]:
        try:
            data = self.path.read_bytes()
        except FileNotFoundError:
            raise KeyStoreError(
                f"{self.path}: no keys file (`switchyard keys create --keys-file {self.path} --tenant NAME` makes one)"
            ) from None
        except OSError as exc:
            raise KeyStoreError(f"{self.path}: {exc.strerror or exc}") from None
        try:
            return msgspec.json.decode(data, type=_KeyFile).keys
        except msgspec.DecodeError as exc:
            raise KeyStoreError(f"{self.path}: not a keys file: {exc}") from None

    def create(
        self, tenant: str, limits: Limits = NO_LIMITS, *, trusted_proxy: bool = False, now: float | None = None
    ) -> tuple[KeyRecord, str]:
        """A new key for ``tenant``: its record (stored) and its secret (not stored anywhere)."""
        if not valid_tenant(tenant):
            raise KeyStoreError(f"tenant {tenant!r}: must match {TENANT_PATTERN}")
        with self._update() as records:
            taken = {r.key_id for r in records}
            key_id = secrets.token_hex(6)
            while key_id in taken:
                key_id = secrets.token_hex(6)
            secret = f"{KEY_PREFIX}{key_id}-{secrets.token_urlsafe(32)}"
            record = KeyRecord(
                key_id=key_id,
                tenant=tenant,
                sha256=digest(secret),
                created=time.time() if now is None else now,
                limits=limits,
                trusted_proxy=trusted_proxy,
            )
            records.append(record)
        return record, secret

    def revoke(self, key_id: str, *, now: float | None = None) -> KeyRecord:
        """Mark a key revoked (kept in the file, for the record); revoking twice keeps the first time."""
        with self._update() as records:
            for i, record in enumerate(records):
                if record.key_id == key_id:
                    if record.revoked is None:
                        records[i] = msgspec.structs.replace(record, revoked=time.time() if now is None else now)
                    return records[i]
            raise KeyStoreError(f"{self.path}: no key {key_id!r}")

    @contextlib.contextmanager
    def _update(self) -> Iterator[list[KeyRecord]]:
        """The records, locked against other writers; written back unless the block raised."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        lock = self.path.with_name(self.path.name + ".lock")
        with open(lock, "a") as held:
            fcntl.flock(held, fcntl.LOCK_EX)
            records = self.read() if self.path.exists() else []
            yield records
            self._write(records)

    def _write(self, records: list[KeyRecord]) -> None:
        tmp = self.path.with_name(f".{self.path.name}.{os.getpid()}.tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "wb") as out:
            out.write(msgspec.json.format(msgspec.json.encode(_KeyFile(keys=records))) + b"\n")
            out.flush()
            os.fsync(out.fileno())
        os.replace(tmp, self.path)


# --- limits ---------------------------------------------------------------------------------------


@dataclass
class _Bucket:
    """``capacity`` units, refilled at ``capacity`` per minute; taking may leave it in debt."""

    capacity: float
    level: float
    at: float  # monotonic time of the last refill

    def wait_s(self, amount: float, now: float) -> float:
        """Seconds until ``amount`` may be taken: 0 now. More than the capacity may be taken
        once the bucket is full."""
        self.level = min(self.capacity, self.level + (now - self.at) * self.capacity / 60.0)
        self.at = now
        return max(0.0, (min(amount, self.capacity) - self.level) * 60.0 / self.capacity)

    def take(self, amount: float) -> None:
        self.level -= amount

    def give(self, amount: float) -> None:
        self.level = min(self.capacity, self.level + amount)


def _bucket(per_minute: int, now: float) -> _Bucket | None:
    return _Bucket(per_minute, per_minute, now) if per_minute else None


@dataclass
class _Usage:
    """One key's state on this ingress."""

    limits: Limits
    requests: _Bucket | None
    tokens: _Bucket | None
    streams: int = 0

    @classmethod
    def fresh(cls, limits: Limits, now: float) -> _Usage:
        return cls(limits, _bucket(limits.rpm, now), _bucket(limits.tpm, now))


@dataclass(frozen=True)
class Principal:
    tenant: str
    key: KeyRecord | None  # None: no keys (--auth none or proxy)


class Ticket:
    """What one admitted request holds of its key's limits, until ``close``."""

    def __init__(self, usage: _Usage | None, reserved: int) -> None:
        self._usage = usage
        self.reserved = reserved
        self._used: Callable[[], int] = lambda: 0  # a request that never ran used nothing
        self._closed = False

    def measure(self, used: Callable[[], int]) -> None:
        """How to count the tokens the request really used (prompt + completion), at its end."""
        self._used = used

    def close(self) -> None:
        if self._closed or self._usage is None:
            return
        self._closed = True
        self._usage.streams -= 1
        if self._usage.tokens is not None:
            self._usage.tokens.give(max(0, self.reserved - self._used()))


# --- the gate -------------------------------------------------------------------------------------


class Gate:
    """Authentication and limits: time is passed in, the keys file is the only I/O."""

    def __init__(
        self, mode: AuthMode, store: KeyStore | None = None, *, reload_every_s: float = _RELOAD_EVERY_S
    ) -> None:
        if (mode == "keys") != (store is not None):
            raise ValueError("a keys file goes with --auth keys, and only with it")
        self.mode = mode
        self.store = store
        self.reload_every_s = reload_every_s
        self._keys: dict[str, KeyRecord] = {}
        self._stamp: tuple[int, int, int] | None = None
        self._checked_at = -math.inf
        self._usage: dict[str, _Usage] = {}
        if store is not None:  # at start, a missing or unreadable file is an error, not "no keys"
            self._stamp = _stamp(store.path)
            self._keys = {r.key_id: r for r in store.read()}

    @classmethod
    def for_config(cls, config: IngressConfig) -> Gate:
        gate = cls(config.auth, KeyStore(config.keys_file) if config.auth == "keys" else None)
        gate.announce()
        return gate

    def announce(self) -> None:
        match self.mode:
            case "none":
                log.warning(
                    "AUTHENTICATION IS OFF (--auth none): anyone who reaches this port is tenant %r "
                    "(%s is refused). To turn keys on: `switchyard keys create --keys-file FILE --tenant NAME`, "
                    "then start with `--auth keys --keys-file FILE`.",
                    DEFAULT_TENANT,
                    TENANT_HEADER,
                )
            case "proxy":
                log.warning(
                    "AUTHENTICATION IS OFF (--auth proxy): %s is trusted from every client, so anyone who "
                    "reaches this port can act as any tenant; run it only behind a front proxy that sets it.",
                    TENANT_HEADER,
                )
            case "keys":
                assert self.store is not None
                live = sum(1 for r in self._keys.values() if r.revoked is None)
                log.info("API keys from %s: %d live", self.store.path, live)

    # --- who is calling

    def authenticate(self, authorization: str | None, asserted: list[str], now: float) -> Principal:
        """The caller of one request from its Authorization and x-switchyard-tenant headers,
        charged one request against its key's ``rpm``; raises the ApiError to answer."""
        if self.mode == "proxy":
            return Principal(_asserted_tenant(asserted) or DEFAULT_TENANT, None)
        if self.mode == "none":
            if asserted:
                raise PermissionDenied(
                    f"The {TENANT_HEADER} header needs an API key with the trusted-proxy right; "
                    f"authentication is off here, so every client is tenant {DEFAULT_TENANT!r}."
                )
            return Principal(DEFAULT_TENANT, None)
        key = self._key(authorization, now)
        if asserted and not key.trusted_proxy:
            raise PermissionDenied(
                f"This API key may not choose a tenant with the {TENANT_HEADER} header "
                "(only a key with the trusted-proxy right may)."
            )
        tenant = _asserted_tenant(asserted) or key.tenant
        usage = self._usage_of(key, now)
        if usage.requests is not None:
            wait = usage.requests.wait_s(1, now)
            if wait > 0:
                raise _limited(f"{key.limits.rpm} requests per minute", wait)
            usage.requests.take(1)
        return Principal(tenant, key)

    def _key(self, authorization: str | None, now: float) -> KeyRecord:
        self._refresh(now)
        scheme, _, secret = (authorization or "").partition(" ")
        secret = secret.strip()
        if not authorization:
            raise Unauthorized("You didn't provide an API key: send it as `Authorization: Bearer sk-sy-...`.")
        if scheme.lower() != "bearer" or not secret:
            raise Unauthorized("The Authorization header must be `Bearer <API key>`.")
        record = self._keys.get(key_id_of(secret) or "")
        presented = digest(secret[:_MAX_KEY_CHARS])
        if not hmac.compare_digest(presented, record.sha256 if record else _NO_DIGEST) or record is None:
            raise Unauthorized("Incorrect API key provided.")
        if record.revoked is not None:
            raise Unauthorized("This API key has been revoked.")
        return record

    def _refresh(self, now: float) -> None:
        """Re-read the keys file if it changed; looked at once per ``reload_every_s`` at most."""
        if self.store is None or now - self._checked_at < self.reload_every_s:
            return
        self._checked_at = now
        stamp = _stamp(self.store.path)
        if stamp == self._stamp:
            return
        self._stamp = stamp
        try:
            self._keys = {r.key_id: r for r in self.store.read()}
        except KeyStoreError as exc:
            log.error("%s: refusing every key until it is fixed", exc)
            self._keys = {}

    # --- how much

    def admit(self, principal: Principal, tokens: int, now: float) -> Ticket:
        """A request of ``tokens`` (prompt + max_tokens) against the key's ``max_streams`` and
        ``tpm``; raises RateLimited, or holds its share until the ticket is closed."""
        key = principal.key
        if key is None:
            return Ticket(None, 0)
        usage = self._usage_of(key, now)
        if key.limits.max_streams and usage.streams >= key.limits.max_streams:
            raise _limited(f"{key.limits.max_streams} requests in flight at once", 1.0)
        if usage.tokens is not None:
            wait = usage.tokens.wait_s(tokens, now)
            if wait > 0:
                raise _limited(f"{key.limits.tpm} tokens per minute (this request reserves {tokens})", wait)
            usage.tokens.take(tokens)
        usage.streams += 1
        return Ticket(usage, tokens)

    def _usage_of(self, key: KeyRecord, now: float) -> _Usage:
        usage = self._usage.get(key.key_id)
        if usage is None or usage.limits != key.limits:  # new, or its limits changed in the file
            streams = usage.streams if usage else 0
            usage = self._usage[key.key_id] = _Usage.fresh(key.limits, now)
            usage.streams = streams
        return usage


def _stamp(path: Path) -> tuple[int, int, int] | None:
    try:
        st = path.stat()
    except OSError:
        return None
    return st.st_ino, st.st_mtime_ns, st.st_size


def _asserted_tenant(asserted: list[str]) -> str | None:
    if not asserted:
        return None
    if len(asserted) > 1 or not valid_tenant(asserted[0]):
        raise InvalidRequest(f"Header {TENANT_HEADER} must be given once and match {TENANT_PATTERN}.")
    return asserted[0]


def _limited(limit: str, wait_s: float) -> RateLimited:
    return RateLimited(
        f"Rate limit reached for this API key: {limit}. Try again in {math.ceil(wait_s)} s.",
        code="rate_limit_exceeded",
        retry_after_s=wait_s,
    )


# --- on the HTTP edge -----------------------------------------------------------------------------


@dataclass
class Caller:
    """One HTTP request's principal, and the tickets it took (closed when its response ends)."""

    gate: Gate
    principal: Principal
    tickets: list[Ticket] = field(default_factory=list)

    @property
    def tenant(self) -> str:
        return self.principal.tenant

    def admit(self, tokens: int) -> Ticket:
        ticket = self.gate.admit(self.principal, tokens, time.monotonic())
        self.tickets.append(ticket)
        return ticket

    def close(self) -> None:
        for ticket in self.tickets:
            ticket.close()


def caller_of(request: Request) -> Caller:
    caller = request.scope.get(_CALLER)
    assert isinstance(caller, Caller), f"{request.url.path} is not behind AuthMiddleware"
    return caller


_ALSO_GUARDED = frozenset({"/tokenize", "/detokenize"})  # vLLM's paths: the model's work, like /v1


class AuthMiddleware:
    """Every ``/v1`` request is authenticated before its body is read (401/403/429 answered
    here); what it holds of its key's limits is released when its response has ended."""

    def __init__(self, app: ASGIApp, gate: Gate) -> None:
        self.app = app
        self.gate = gate

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not (scope["path"].startswith("/v1/") or scope["path"] in _ALSO_GUARDED):
            await self.app(scope, receive, send)
            return
        headers = Headers(scope=scope)
        try:
            principal = self.gate.authenticate(
                headers.get("authorization"), headers.getlist(TENANT_HEADER), time.monotonic()
            )
        except ApiError as exc:
            await _reply(send, exc)
            return
        caller = Caller(self.gate, principal)
        scope[_CALLER] = caller
        try:
            await self.app(scope, receive, send)
        finally:  # the response is over: its last byte sent, or its client gone
            caller.close()


async def _reply(send: Send, error: ApiError) -> None:
    headers: list[Any] = [(b"content-type", b"application/json")]
    headers += [(k.encode(), v.encode()) for k, v in error.headers().items()]
    await send({"type": "http.response.start", "status": error.status, "headers": headers})
    await send({"type": "http.response.body", "body": error.encoded()})
